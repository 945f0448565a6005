"""Which global sequence positions each rank holds: the `contiguous` and `zigzag` layouts.

`contiguous`: rank r holds rows [r·n, (r+1)·n), n = L/P. `zigzag`: the sequence is cut
into 2P equal chunks and rank r holds chunks r and 2P-1-r, so under a causal mask every
rank has one early and one late chunk and the same work. A rank's local rows are its
chunks in this order, concatenated.

A length that does not split raises `ShapeContractError` naming the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.errors import ShapeContractError

__all__ = ["LAYOUTS", "Layout"]

LAYOUTS = ("contiguous", "zigzag")
Span = tuple[int, int]


@dataclass(frozen=True)
class Layout:
    """A layout of a global length `L` over `P` ranks."""

    name: str
    P: int
    L: int

    @staticmethod
    def of(name: str, P: int, L: int, *, what: str = "sequence") -> Layout:
        if name not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {name!r}.")
        parts = P * (2 if name == "zigzag" else 1)
        if L % parts:
            pad = -L % parts
            raise ShapeContractError(
                f"the {what} of length L={L} does not split into {parts} equal chunks "
                f"(layout {name!r} over P={P} ranks): pad it by {pad} position(s) to "
                f"L={L + pad} (and hide the padding with key_padding)."
            )
        return Layout(name, P, L)

    @property
    def local(self) -> int:
        """Rows each rank holds."""
        return self.L // self.P

    def chunks(self, rank: int) -> list[Span]:
        """The global row ranges rank `rank` holds, in local order."""
        if self.name == "contiguous":
            n = self.local
            return [(rank * n, (rank + 1) * n)]
        c = self.L // (2 * self.P)
        return [(rank * c, (rank + 1) * c), ((2 * self.P - 1 - rank) * c, (2 * self.P - rank) * c)]

    def local_chunks(self, rank: int) -> list[tuple[Span, Span]]:
        """(local range, global range) of each of rank's chunks."""
        out, start = [], 0
        for g0, g1 in self.chunks(rank):
            out.append(((start, start + g1 - g0), (g0, g1)))
            start += g1 - g0
        return out

    def positions(self, rank: int) -> Tensor:
        """Global position of each local row of `rank`: (L/P,) int64."""
        return torch.cat([torch.arange(g0, g1) for g0, g1 in self.chunks(rank)])

    def order(self) -> Tensor:
        """The rows of all ranks concatenated (rank 0's first) as global positions: (L,)."""
        return torch.cat([self.positions(r) for r in range(self.P)])
