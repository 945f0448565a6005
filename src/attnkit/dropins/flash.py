"""flash-attention 2's `flash_attn_func` and `flash_attn_varlen_func` on attnkit (what
`attnkit.flash_attn` holds, whose docstring says what differs from flash-attention's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.dropins.flash_cache import (
    check_block_table,
    pool_size,
)
from attnkit.dropins.packed import (
    Window,
    attend_packed,
    attend_spans,
    flash_window,
    sequence_mask,
    spans_mask,
    window_spans,
)
from attnkit.dropins.pytorch import decode_packed, gather_pages, packed_spans

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attention's `flash_attn_func`, on attnkit, with backward for q, k, v.

    Args:
        q: (B, L, H, D) queries (flash-attention's layout: length before heads).
        k: (B, S, Hkv, D) keys, q's dtype; H % Hkv == 0 (GQA/MQA by head count).
        v: (B, S, Hkv, Dv) values, q's dtype.
        dropout_p: dropout on the weights (default 0.0; attnkit's random draws).
        softmax_scale: multiplies q·kᵀ (default None: 1/√D).
        causal: query i sees keys j <= i + S - L, bottom-right aligned (default False).
        window_size: (left, right): query i sees keys from i' - left to i' + right,
            i' = i + S - L; -1 is unlimited (default (-1, -1)).
        softcap: if > 0, scores become `c·tanh(s/c)` (default 0.0: none).
        alibi_slopes: (H,) or (B, H) float32: adds `-slope·|i' - j|` (default None).
        deterministic: accepted; attnkit's backward always is (default False).
        return_attn_probs: also return the log-sum-exp (default False).

    Returns:
        out (B, L, H, Dv) in q's dtype; with `return_attn_probs`, `(out, softmax_lse,
        None)`, softmax_lse (B, H, L) float32 (float64 for float64 inputs), -inf where
        a query sees nothing. Both contiguous.

    Raises:
        ShapeContractError: sizes that do not fit, named by letter.
        DtypeMismatchError: q, k, v of different dtypes.

    Examples:
        >>> from attnkit.flash_attn import flash_attn_func
        >>> q = torch.randn(2, 5, 4, 8)  # (B, L, H, D)
        >>> k, v = torch.randn(2, 5, 2, 8), torch.randn(2, 5, 2, 8)  # Hkv = 2
        >>> out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        >>> out.shape, lse.shape  # (B, L, H, Dv), (B, H, L)
        (torch.Size([2, 5, 4, 8]), torch.Size([2, 4, 5]))
        >>> heads = lambda t: t.transpose(1, 2)  # (B, L, H, D) -> (B, H, L, D)
        >>> same = ak.attention(heads(q), heads(k), heads(v), ak.causal())
        >>> torch.allclose(out, heads(same), atol=1e-6)
        True
    """
    B, L, S = q.shape[0], q.shape[1], k.shape[1]
    index = torch.arange(L, device=q.device)[None].expand(B, L)
    first = torch.zeros(B, 1, dtype=torch.long, device=q.device)
    spans = window_spans(
        first, torch.full_like(first, S), L, index, flash_window(causal, window_size)
    )
    mask = spans_mask(spans, alibi_slopes, q.dtype)
    out, lse = attend_spans(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        mask,
        softmax_scale,
        softcap,
        dropout_p,
    )
    out = out.transpose(1, 2).contiguous()  # (B, L, H, Dv)
    return (out, lse.contiguous(), None) if return_attn_probs else out


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Tensor | None = None,
) -> Any:
    """flash-attention's `flash_attn_varlen_func`: sequences of different lengths packed
    along one dim, each attended on its own (order-invariant), with backward.

    Args:
        q: (T_q, H, D) packed queries: sequence n is rows cu_seqlens_q[n] .. [n+1]-1.
        k: (T_k, Hkv, D) packed keys, q's dtype; or with `block_table` pages
            (pages, page_size, Hkv, D).
        v: (T_k, Hkv, Dv), laid out as `k`.
        cu_seqlens_q: (N + 1,) int32 cumulative query lengths, from 0 to T_q.
        cu_seqlens_k: (N + 1,) int32 cumulative key lengths (with `block_table`: each
            sequence's key count).
        max_seqlen_q: the longest query sequence (accepted; attnkit reads the lengths).
        max_seqlen_k: the longest key sequence (likewise).
        dropout_p: as in `flash_attn_func`.
        softmax_scale: as in `flash_attn_func`.
        causal: as in `flash_attn_func`, per sequence (i' = i + len_k - len_q).
        window_size: as in `flash_attn_func`, per sequence.
        softcap: as in `flash_attn_func`.
        alibi_slopes: (H,) or (N, H), as in `flash_attn_func`.
        deterministic: as in `flash_attn_func`.
        return_attn_probs: as in `flash_attn_func`.
        block_table: (N, max_pages) int32 page ids of each sequence's keys (default None).

    Returns:
        out (T_q, H, Dv) in q's dtype; with `return_attn_probs`, `(out, softmax_lse,
        None)`, softmax_lse (H, T_q) float32 (float64 for float64). Both contiguous.

    Raises:
        ValueError: cu offsets that do not rise from 0 to T_q.
        BlockTableError: a length past max_pages · page_size, or a used page id outside
            the pool, before anything is read.

    Examples:
        >>> from attnkit.flash_attn import flash_attn_func, flash_attn_varlen_func
        >>> q, k, v = torch.randn(7, 2, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
        >>> cu = torch.tensor([0, 3, 7], dtype=torch.int32)  # lengths 3 and 4
        >>> out = flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True)
        >>> out.shape  # (T_q, H, Dv)
        torch.Size([7, 2, 8])
        >>> alone = flash_attn_func(q[None, 3:], k[None, 3:], v[None, 3:], causal=True)
        >>> torch.allclose(out[3:], alone[0], atol=1e-6)  # sequence 1 as if alone
        True
    """
    if block_table is not None:
        lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(block_table.device)
        check_block_table(
            "flash_attn_varlen_func",
            block_table,
            lengths,
            pool_size(k),
            "cu_seqlens_k[{next}] - cu_seqlens_k[{n}]",
        )
        window = flash_window(causal, window_size)
        if alibi_slopes is None and dropout_p == 0:
            decoded = decode_packed(
                q, k, v, cu_seqlens_q, block_table, lengths, window, softmax_scale, softcap
            )
            if decoded is not None:  # (T_q, H, Dv), (T_q, H)
                out, lse = decoded
                return (out, lse.T.contiguous(), None) if return_attn_probs else out
        k, v, cu_seqlens_k = gather_pages(k, v, block_table, lengths)
        used: Tensor | None = lengths
    else:
        used = None
    window = flash_window(causal, window_size)
    if torch.compiler.is_compiling():  # lengths unknown: the pack as one call
        spans, seq = packed_spans(cu_seqlens_q, cu_seqlens_k, q.shape[0], window, used)
        if alibi_slopes is not None and alibi_slopes.dim() == 2:  # per sequence: per row
            alibi_slopes = alibi_slopes[seq.to(alibi_slopes.device)][None]  # (1, T_q, H)
        mask = spans_mask(spans.one_batch_row(), alibi_slopes, q.dtype)
        qp, kp, vp = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, H, T, D)
        out, lse = attend_spans(qp, kp, vp, mask, softmax_scale, softcap, dropout_p)
        out, lse = out[0].transpose(0, 1), lse[0]  # (T_q, H, Dv), (H, T_q)
    else:  # each sequence on its own: order-invariant
        out, lse = attend_packed(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            sequence_mask(window, alibi_slopes, q.dtype),
            scale=softmax_scale,
            softcap=softcap if softcap > 0 else None,
            dropout_p=dropout_p,
            used=used,
        )
    out = out.contiguous()  # (T_q, H, Dv)
    return (out, lse.contiguous(), None) if return_attn_probs else out
