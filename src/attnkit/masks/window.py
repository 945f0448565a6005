"""A rectangle of a larger mask: the piece of a global problem one call computes.

Context parallelism splits a (B, H, L, S) problem into calls over some query rows, some
keys and (Ulysses) some heads. `window(mask, ...)` is the global mask seen through such
a rectangle: local index `i` is global row `row0 + i`, `j` is key `col0 + j`, `h` is head
`head0 + h`, and the global mask is evaluated at the global (H, L, S). Structure carries
over: the spans of a window are the global spans shifted and clipped, so the tiled
backend still skips what a piece cannot see, and a window that sees every key needs no
mask at all.
"""

from __future__ import annotations

import torch

from attnkit.errors import ShapeContractError
from attnkit.masks.base import BiasFn, Mask, Predicate
from attnkit.masks.spans import Spans

__all__ = ["window"]


def window(
    mask: Mask,
    *,
    H: int,
    L: int,
    S: int,
    rows: tuple[int, int],
    cols: tuple[int, int],
    heads: tuple[int, int] | None = None,
) -> Mask:
    """`mask` over the global (H, L, S), restricted to `rows`, `cols` and `heads` ranges.

    A window is a value: the same arguments (the same `mask` object) give an equal
    window, whose prepared call `attention()` finds again (`by_mask.ByMask`).
    """
    return _Window(mask, H, L, S, rows, cols, (0, H) if heads is None else heads)


class _Window(Mask):
    def __init__(
        self,
        inner: Mask,
        H: int,
        L: int,
        S: int,
        rows: tuple[int, int],
        cols: tuple[int, int],
        heads: tuple[int, int],
    ) -> None:
        for name, (lo, hi), size in (("rows", rows, L), ("cols", cols, S), ("heads", heads, H)):
            if not 0 <= lo <= hi <= size:
                raise ShapeContractError(f"window {name} {lo}:{hi} is outside 0:{size}.")
        self.inner, self.H, self.L, self.S = inner, H, L, S
        self.rows, self.cols, self.heads = rows, cols, heads

    def _local(self, B: int, H: int, L: int, S: int) -> None:
        want = (self.heads[1] - self.heads[0], self.rows[1] - self.rows[0])
        want_s = self.cols[1] - self.cols[0]
        if (H, L, S) != (*want, want_s):
            raise ShapeContractError(
                f"a window of heads {self.heads}, rows {self.rows}, keys {self.cols} serves "
                f"H={want[0]}, L={want[1]}, S={want_s}; the call has H={H}, L={L}, S={S}."
            )

    def check(self, B: int, H: int, L: int, S: int) -> None:
        self._local(B, H, L, S)
        self.inner.check(B, self.H, self.L, self.S)

    @property
    def batch_size(self) -> int | None:
        return self.inner.batch_size

    @property
    def head_dependent(self) -> bool:
        return self.inner.head_dependent

    @property
    def has_bias(self) -> bool:
        return self.inner.has_bias

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        fn = self.inner.predicate(B, self.H, self.L, self.S, device)
        h0, r0, c0 = self.heads[0], self.rows[0], self.cols[0]
        return lambda b, h, i, j: fn(b, h + h0, i + r0, j + c0)

    def bias(self, B: int, H: int, L: int, S: int, device: torch.device) -> BiasFn | None:
        fn = self.inner.bias(B, self.H, self.L, self.S, device)
        if fn is None:
            return None
        h0, r0, c0 = self.heads[0], self.rows[0], self.cols[0]
        return lambda b, h, i, j: fn(b, h + h0, i + r0, j + c0)

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        """The global spans of the window's rows, shifted to its keys and clipped to them
        (an interval ∩ the keys is one interval: exact stays exact)."""
        spans = self.inner.key_spans(B, self.L, self.S, device)
        if spans is None:
            return None
        (r0, r1), c0 = self.rows, self.cols[0]
        lo, hi = (t if t.shape[1] == 1 else t[:, r0:r1] for t in (spans.lo, spans.hi))
        return Spans((lo - c0).clamp(0, S), (hi - c0).clamp(0, S), spans.exact)

    def describe(self) -> str:
        (r0, r1), (c0, c1), (h0, h1) = self.rows, self.cols, self.heads
        heads = "" if (h0, h1) == (0, self.H) else f", heads {h0}:{h1}"
        return f"{self.inner.describe()}[rows {r0}:{r1}, keys {c0}:{c1}{heads}]"
