"""Packed documents in `attention`: each document attended on its own.

`attention(q, k, v, document(ids) & causal())` over a row of packed documents must give
each document the bits it gets alone, whatever is packed beside it and in whatever
order (`attnkit.dropins.packed` says why one call over the row cannot: its blocks start at
positions that move with the packing). Where the mask says so exactly, the call is cut
into one call per document:

- one `document(ids)` (self-attention, L == S, ids sorted: each document one run of
  positions), alone or `&` masks that depend only on `j - i` (`causal`,
  `sliding_window`, with any alignment or offset: L == S in the row and in each
  document, so they read the same inside a document as in the row);
- the cut: q, k, v split along L per batch row (views), one call per document with the
  positional part as its mask, the results joined by `cat` (the backward writes each
  document's gradients into its rows, with no sum across documents).

Any other mask keeps the one call (exact, not order-invariant); so does a call that
`torch.compile` traces (the lengths are data).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.masks import Mask, and_masks
from attnkit.masks.structure import packed_documents

__all__ = ["Documents", "aligned_copy", "attend_documents", "documents"]

# one call: q (1, H, n, D), k and v (1, Hkv, n, D|Dv), its mask -> out, lse (or None)
AttendOne = Callable[[Tensor, Tensor, Tensor, Mask | None], tuple[Tensor, Tensor | None]]


@dataclass(frozen=True)
class Documents:
    """Each batch row's document lengths (summing to L) and the mask inside a document."""

    lengths: list[list[int]]
    inner: Mask | None


def documents(mask: object, q: Tensor, k: Tensor) -> Documents | None:
    """The documents of a call whose mask is packed documents and position only (see the
    module doc), or None (the call runs as one)."""
    packed = None if mask is None else packed_documents(mask)  # (None: most calls)
    if packed is None or q.dim() != 4 or k.dim() != 4:
        return None
    ids, inner = packed  # (B|1, L)
    (B, L), S = (q.shape[0], q.shape[2]), k.shape[2]
    if L != S or ids.shape[1] != L or ids.shape[0] not in (1, B) or B * L == 0:
        return None  # (an empty call runs as one: nothing to cut)
    starts = torch.ones(B, L, dtype=torch.bool)
    starts[:, 1:] = (ids[:, 1:] != ids[:, :-1]).cpu()  # a new document begins
    lengths = [torch.diff(row.nonzero()[:, 0], append=torch.tensor([L])).tolist() for row in starts]
    return Documents(lengths, None if not inner else and_masks(*inner))


def attend_documents(
    q: Tensor, k: Tensor, v: Tensor, packed: Documents, attend_one: AttendOne
) -> tuple[Tensor, Tensor | None]:
    """Each document of each batch row as its own call.

    Args:
        q: (B, H, L, D); k: (B, Hkv, L, D); v: (B, Hkv, L, Dv).
    Returns:
        out (B, H, L, Dv) and lse (B, H, L), or None where `attend_one` gives none.
    """
    rows_out, rows_lse = [], []
    for b, lengths in enumerate(packed.lengths):
        pieces = [torch.split(t[b : b + 1], lengths, dim=2) for t in (q, k, v)]  # (1, ., n, .)
        qs, ks, vs = ([aligned_copy(p) for p in part] for part in pieces)
        results = [attend_one(*qkv, packed.inner) for qkv in zip(qs, ks, vs, strict=True)]
        rows_out.append(torch.cat([out for out, _ in results], dim=2))  # (1, H, L, Dv)
        lses = [lse for _, lse in results]
        rows_lse.append(_joined(lses, dim=2))  # (1, H, L)
    return torch.cat(rows_out), _joined(rows_lse, dim=0)  # (B, H, L, Dv), (B, H, L)


def aligned_copy(t: Tensor) -> Tensor:
    """`t` in memory of its own: contiguous, from an aligned allocation.

    A view of a pack starts wherever its sequence sits, and the CPU kernels round a
    view at another offset differently (SDPA's flash kernel with AVX512 at head dims
    that are no multiple of its vectors: 5, 6, 7 floats), so each piece is copied to
    where any pack would put it: the same bits whatever is packed beside it."""
    return t.clone(memory_format=torch.contiguous_format)


def _joined(parts: list[Tensor | None], dim: int) -> Tensor | None:
    """`cat` of the parts, None where any part is None."""
    known = [p for p in parts if p is not None]
    return torch.cat(known, dim=dim) if len(known) == len(parts) else None
