"""Packed sequences, each attended on its own: what `varlen_attn` and
`flash_attn_varlen_func` run.

Sequence n of a pack is query rows `cu_q[n] .. cu_q[n+1]-1` and its keys `cu_k[n] ..`
(the first `used[n]` of them with `seqused_k`). Its result must not depend on what is
packed beside it, nor on where it sits: a kernel that sums over blocks of a packed row
starts its blocks at positions that move with the packing, and rounds differently
(float32 out by ~1e-7, bfloat16 gradients by ~0.06 between two orders of one pack). So
each sequence is one `attention_with_lse` call on (1, H, n, D) views of its own rows,
with its own mask (`window_mask`: flash-attention's window, bottom-right aligned): the
same call wherever the sequence sits, so the same bits (batch-invariant inference and
torch's `test_batch_invariance`). The inputs are cut with `split` and the results joined
with `cat`, so the backward writes each sequence's gradients into its own rows, with no
sum across sequences.

While `torch.compile` traces, the lengths are not known: the pack then runs as one call
over each query's key interval (`row_spans`), exact but not order-invariant.

`window_mask` writes the window as `causal(offset=S - L + right)` or
`sliding_window(left, right, offset=S - L)`: values, so the prepared calls of one
sequence serve the next of the same sizes. The cu offsets and `seqused_k` are checked
first (a `ValueError` naming them). Under `torch.compile` the spans are `row_spans(lo,
hi)` (`masks.tokens`: query row i sees keys `lo[i] <= j < hi[i]`).

Last, what `dropins` and `flash_attn` share of flash-attention's conventions: the window
around each query's bottom-right aligned position as key spans (`window_spans`), their
mask with ALiBi (`spans_mask`), and a sequence's mask (`sequence_mask`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import Tensor

from attnkit.call.documents import aligned_copy
from attnkit.call.functional import attention_with_lse
from attnkit.masks import Mask, causal, row_spans, sliding_window
from attnkit.masks.biases import alibi_at

__all__ = [
    "KeySpans",
    "MaskOf",
    "Window",
    "attend_packed",
    "attend_spans",
    "flash_window",
    "sequence_mask",
    "spans_mask",
    "window_mask",
    "window_spans",
]

# the mask of sequence n with L queries and S keys (None: every query sees every key)
MaskOf = Callable[[int, int, int], Mask | None]


def window_mask(window: tuple[int, int], L: int, S: int) -> Mask | None:
    """flash-attention's `window_size=(left, right)` for L queries over S keys: query i
    sees keys j with i' - left <= j <= i' + right, i' = i + S - L (-1: unlimited)."""
    left, right = window
    if left < 0 and right < 0:
        return None
    if left < 0:
        return causal(offset=S - L + right)
    # right unlimited: past the last key from every aligned position (i' >= -L)
    return sliding_window(left, right if right >= 0 else S + L, offset=S - L)


def attend_packed(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    mask_of: MaskOf,
    *,
    scale: float | None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    used: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Each packed sequence attended on its own.

    Args:
        query: (T_q, H, D); key: (T_k, Hkv, D); value: (T_k, Hkv, Dv).
        cu_q, cu_k: (N + 1,) cumulative lengths (checked: see `_lengths`).
        mask_of: sequence n's mask for its L queries and S keys.
        used: (N,) keys used per sequence (the first of its keys), or None (all).
    Returns:
        out (T_q, H, Dv) and lse (H, T_q), both contiguous.
    """
    lq, first_k, stored, lk = _lengths(cu_q, cu_k, query.shape[0], key.shape[0], used)
    keys, values = (_cut(t, first_k, stored, lk) for t in (key, value))
    outs, lses = [], []
    for n, (q, k, v) in enumerate(zip(torch.split(query, lq), keys, values, strict=True)):
        q, k, v = (aligned_copy(t.transpose(0, 1)[None]) for t in (q, k, v))  # (1, H|Hkv, L|S, D)
        out, lse = attention_with_lse(
            q,
            k,
            v,
            mask_of(n, q.shape[2], k.shape[2]),
            scale=scale,
            softcap=softcap,
            dropout_p=dropout_p,
        )  # (1, H, L, Dv), (1, H, L)
        outs.append(out[0].transpose(0, 1))  # (L, H, Dv)
        lses.append(lse[0])  # (H, L)
    if not outs:  # no sequence: nothing to attend
        out = query.new_zeros(0, query.shape[1], value.shape[-1])
        return out, query.new_zeros(query.shape[1], 0, dtype=torch.float32)
    return torch.cat(outs), torch.cat(lses, dim=1)  # (T_q, H, Dv), (H, T_q)


def _lengths(
    cu_q: Tensor, cu_k: Tensor, T_q: int, T_k: int, used: Tensor | None
) -> tuple[list[int], int, list[int], list[int]]:
    """Query lengths, the first key of the pack, key lengths and the keys used, as ints:
    cu_q must rise from 0 to T_q, cu_k must not fall nor pass T_k, `used` must not pass
    a sequence's keys."""
    q_at, k_at = cu_q.long().tolist(), cu_k.long().tolist()
    if q_at[0] != 0 or q_at[-1] != T_q or any(b < a for a, b in pairwise(q_at)):
        raise ValueError(f"cu_seq_q must rise from 0 to the {T_q} packed queries, got {q_at}")
    if len(k_at) != len(q_at):
        raise ValueError(
            f"cu_seq_q and cu_seq_k must both hold N + 1 offsets, got {len(q_at)} and {len(k_at)}"
        )
    if k_at[0] < 0 or k_at[-1] > T_k or any(b < a for a, b in pairwise(k_at)):
        raise ValueError(f"cu_seq_k must rise within the {T_k} packed keys, got {k_at}")
    stored = [b - a for a, b in pairwise(k_at)]
    counts = stored if used is None else used.long().tolist()
    fits = len(counts) == len(stored) and all(
        0 <= u <= n for u, n in zip(counts, stored, strict=True)
    )
    if not fits:
        raise ValueError(
            f"seqused_k must give each of the {len(stored)} sequences at most its {stored} "
            f"keys, got {counts}"
        )
    return [b - a for a, b in pairwise(q_at)], k_at[0], stored, counts


def _cut(x: Tensor, first: int, stored: list[int], used: list[int]) -> list[Tensor]:
    """Each sequence's rows of packed keys or values: its first `used[n]` of them."""
    pieces = torch.split(x[first : first + sum(stored)], stored)
    return [p if n == len(p) else p[:n] for p, n in zip(pieces, used, strict=True)]


# ------------------------------------------------------ flash-attention's windows and masks

Window = tuple[int, int]


@dataclass(frozen=True)
class KeySpans:
    """Per query row: its keys [lo, hi) and its aligned key position `at` (the i' of
    flash-attention's convention, for ALiBi), integer tensors of one shape."""

    lo: Tensor
    hi: Tensor
    at: Tensor

    def one_batch_row(self) -> KeySpans:
        """Spans of packed rows (T,) as one batch row (1, T)."""
        return KeySpans(self.lo[None], self.hi[None], self.at[None])


def window_spans(
    first_key: Tensor, len_k: Tensor, len_q: Tensor | int, row: Tensor, window: tuple[int, int]
) -> KeySpans:
    """The keys of query `row` of a sequence of `len_q` queries whose keys are
    first_key .. first_key + len_k - 1: those within (left, right) of its bottom-right
    aligned position i' = row + len_k - len_q (-1: unlimited), flash-attention's window."""
    at = row + len_k - len_q
    left, right = window
    lo = torch.zeros_like(at) if left < 0 else (at - left).clamp(min=0)
    hi = len_k + torch.zeros_like(at) if right < 0 else torch.minimum(at + right + 1, len_k)
    return KeySpans(first_key + lo, first_key + torch.maximum(hi, lo), first_key + at)


def sequence_mask(window: Window, alibi_slopes: Tensor | None, dtype: torch.dtype) -> MaskOf:
    """Sequence n's mask: its window, and ALiBi with its slopes (H,) or row n of (N, H)
    around each query's aligned position."""
    if alibi_slopes is None:
        return lambda n, L, S: window_mask(window, L, S)

    def mask_of(n: int, L: int, S: int, slopes: Tensor = alibi_slopes) -> Mask:
        rows = torch.arange(L, device=slopes.device)
        spans = window_spans(rows.new_zeros(()), rows.new_tensor(S), L, rows, window)
        return spans_mask(spans.one_batch_row(), slopes[n] if slopes.dim() == 2 else slopes, dtype)

    return mask_of


def flash_window(causal: bool, window_size: Window) -> Window:
    """flash-attention's window with `causal` folded in (it sets the right side to 0)."""
    left, right = (int(w) for w in window_size)
    return (left, 0) if causal else (left, right)


def spans_mask(spans: KeySpans, alibi_slopes: Tensor | None, dtype: torch.dtype) -> Mask:
    """Each row's key interval, and ALiBi around each row's aligned position (its bias in
    float64 for float64 calls, else float32)."""
    mask = row_spans(spans.lo, spans.hi)
    if alibi_slopes is None:
        return mask
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return mask & alibi_at(alibi_slopes.to(wide), spans.at)


def attend_spans(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask,
    scale: float | None,
    softcap: float,
    dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """attnkit's call on (B, H, L, D): out and lse (B, H, L)."""
    return attention_with_lse(
        q, k, v, mask, scale=scale, softcap=softcap if softcap > 0 else None, dropout_p=dropout_p
    )
