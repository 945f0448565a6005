"""Key spans: each query row's interval of keys `[lo, hi)`, the structure backends read.

A mask states its spans once (`Mask.key_spans`): `lo`, `hi` of shape (B|1, L|1), and
whether they are exact (each row sees exactly its interval) or a superset. From them
come the rows and keys anybody sees (`seen_from_spans`, O(B·(L + S))) and the hull of a
range of rows (`range_bounds`: the keys a tile of query rows may see). This module reads
tensors and a mask's `key_spans` only: it imports no mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.masks.protocol import ReadableMask, Spans  # masks hand their spans in

__all__ = [
    "CHUNK_ELEMENTS",
    "Spans",
    "exact_spans",
    "range_bounds",
    "seen_from_spans",
    "tile_bounds",
]

CHUNK_ELEMENTS = 1 << 24  # mask entries evaluated at once where a mask has no exact spans


def exact_spans(
    mask: ReadableMask, B: int, L: int, S: int, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor] | None:
    """(lo, hi), each (B|1, L): the one interval of keys each row sees exactly, or None
    where the mask is not one interval a row (or differs between heads)."""
    if mask.head_dependent:
        return None
    spans = mask.key_spans(B, L, S, device)
    if spans is None or not spans.exact:
        return None
    return spans.lo.expand(-1, L), spans.hi.expand(-1, L)


def tile_bounds(
    spans: Spans | None, L: int, S: int, first: Tensor, last: Tensor
) -> tuple[Tensor, Tensor]:
    """Key span `[lo, hi)` holding every key visible to query rows `first..last` ((T,)
    row ranges), (B|1, T): the hull of the rows' spans, all S keys without spans."""
    if spans is None:
        zeros = torch.zeros(1, first.shape[0], dtype=torch.long, device=first.device)
        return zeros, zeros + S
    return range_bounds(spans.lo.expand(-1, L), spans.hi.expand(-1, L), first, last)


def seen_from_spans(lo: Tensor, hi: Tensor, S: int) -> tuple[Tensor, Tensor]:
    """(B, L) rows that see a key and (B, S) keys some row sees, from per-row spans.

    Row i sees keys [lo[b, i], hi[b, i]); a key is seen where the count of spans that
    open before it exceeds the count that close (a difference array, O(B·(L + S))).
    """
    B = lo.shape[0]
    rows = hi > lo  # (B, L)
    count = torch.zeros(B, S + 1, dtype=torch.long, device=lo.device)
    ones = rows.long()
    count.scatter_add_(1, torch.where(rows, lo, S), ones)
    count.scatter_add_(1, torch.where(rows, hi, S), -ones)
    return rows, count.cumsum(1)[:, :S] > 0


def range_bounds(lo: Tensor, hi: Tensor, first: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
    """The hull of the rows' intervals over each row range `first..last` (inclusive),
    (B|1, T); rows that see nothing take no part (a range of such rows gives 0, 0)."""
    if lo.shape[1] == 1:  # every row the same
        return lo.expand(-1, first.shape[0]), hi.expand(-1, first.shape[0])
    if torch.equal(first, last):  # one row a range (tiled's and the planner's row spans)
        return lo[:, first], hi[:, first]
    if bool((lo[:, 1:] >= lo[:, :-1]).all() and (hi[:, 1:] >= hi[:, :-1]).all()):
        # spans that only move right (causal, windows, chunks, prefixes, sorted documents
        # and their &): the first row's start and the last row's end, in O(T)
        return lo[:, first], hi[:, last]
    seen = hi > lo
    big = int(hi.max()) + 1 if hi.numel() else 1
    low = _range_min(torch.where(seen, lo, big), first, last)  # (B|1, T)
    high = -_range_min(torch.where(seen, -hi, 0), first, last)
    empty = low >= high
    return torch.where(empty, 0, low), torch.where(empty, 0, high)


def _range_min(x: Tensor, first: Tensor, last: Tensor) -> Tensor:
    """min of x[:, first..last] per range, (B|1, T), by a sparse table: level k holds the
    minimum of each run of 2^k rows, so a range is the minimum of two overlapping runs."""
    levels = [x]  # (B|1, L - 2^k + 1) each
    while 2 ** len(levels) <= x.shape[1]:
        prev, step = levels[-1], 2 ** (len(levels) - 1)
        levels.append(torch.minimum(prev[:, :-step], prev[:, step:]))
    length = last - first + 1  # (T,)
    k = torch.floor(torch.log2(length.double())).long()
    table = torch.nn.utils.rnn.pad_sequence(
        [t.T for t in levels], batch_first=True, padding_value=0
    )  # (levels, L, B|1): level k, row i -> min of x[:, i : i + 2^k]
    left = table[k, first]  # (T, B|1)
    right = table[k, last - (1 << k) + 1]
    return torch.minimum(left, right).T
