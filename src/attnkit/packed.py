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
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import torch
from torch import Tensor

from attnkit.documents import placed_alike
from attnkit.functional import attention_with_lse
from attnkit.masks import Mask, causal, sliding_window

__all__ = ["MaskOf", "attend_packed", "window_mask"]

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
        q, k, v = (placed_alike(t.transpose(0, 1)[None]) for t in (q, k, v))  # (1, H|Hkv, L|S, D)
        out, lse = attention_with_lse(
            q, k, v, mask_of(n, q.shape[2], k.shape[2]), scale=scale, softcap=softcap,
            dropout_p=dropout_p,
        )  # fmt: skip  # (1, H, L, Dv), (1, H, L)
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
