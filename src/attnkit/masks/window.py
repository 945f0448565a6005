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

from collections import OrderedDict

import torch
from torch import Tensor

from attnkit.errors import ShapeContractError
from attnkit.masks.base import BiasFn, Mask, Predicate

__all__ = ["window"]

_CACHE: OrderedDict[tuple[object, ...], _Window] = OrderedDict()
_CACHE_MAX = 256


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

    The same arguments give the same object while `mask`'s tensors are unchanged, so
    backends that prepare per mask object (flex's block masks) prepare once.
    """
    heads = (0, H) if heads is None else heads
    key = (id(mask), mask.state(), H, L, S, rows, cols, heads)
    found = _CACHE.get(key)
    if found is None or found.inner is not mask:
        found = _Window(mask, H, L, S, rows, cols, heads)
        _CACHE[key] = found
        while len(_CACHE) > _CACHE_MAX:
            _CACHE.popitem(last=False)
    _CACHE.move_to_end(key)
    return found


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

    @property
    def has_dense_tensor(self) -> bool:
        return self.inner.has_dense_tensor

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

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        r0, c0 = self.rows[0], self.cols[0]
        lo, hi = self.inner.key_bounds(B, self.L, self.S, first + r0, last + r0)
        return (lo - c0).clamp(0, S), (hi - c0).clamp(0, S)  # (B|1, T), clipped to the keys

    def exact_spans(self, B: int, L: int, S: int) -> bool:
        return self.inner.exact_spans(B, self.L, self.S)  # an interval ∩ the keys: one interval

    def _row_spans(self, L: int, S: int) -> tuple[Tensor, Tensor] | None:
        """Each row's exact span (1, L), for masks that hold no tensors; else None."""
        if self.inner.batch_size is not None or not self.inner.exact_spans(1, self.L, self.S):
            return None
        index = torch.arange(L)
        return self.key_bounds(1, L, S, index, index)

    def sees_all(self, L: int, S: int) -> bool:
        spans = self._row_spans(L, S)
        return spans is not None and bool((spans[0] == 0).all() and (spans[1] == S).all())

    def is_sdpa_causal(self, L: int, S: int) -> bool:
        spans = self._row_spans(L, S)
        if spans is None or L < S or self.inner.has_bias:
            return False
        lo, hi = spans
        return bool((lo == 0).all() and (hi == (torch.arange(L) + 1).clamp(max=S)).all())

    def describe(self) -> str:
        (r0, r1), (c0, c1), (h0, h1) = self.rows, self.cols, self.heads
        heads = "" if (h0, h1) == (0, self.H) else f", heads {h0}:{h1}"
        return f"{self.inner.describe()}[rows {r0}:{r1}, keys {c0}:{c1}{heads}]"
