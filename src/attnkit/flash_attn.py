"""flash-attention 2's functions with their signatures, on attnkit (CPU included).

`flash_attn_func`, `flash_attn_varlen_func` and `flash_attn_with_kvcache` as the
`flash_attn` package defines them, and its packed forms `flash_attn_qkvpacked_func`
(qkv (B, L, 3, H, D)), `flash_attn_kvpacked_func` (kv (B, S, 2, Hkv, D)),
`flash_attn_varlen_qkvpacked_func` (qkv (T, 3, H, D)) and
`flash_attn_varlen_kvpacked_func` (kv (T_k, 2, Hkv, D)), whose gradients flow back into
the packed tensor: layout (B, L, H, D) (packed (T, H, D) for varlen),
`causal` aligned bottom-right (query i sees keys j <= i + S - L), `window_size=(left,
right)` around that aligned position (-1: unlimited), `softcap` (0: none) on the scaled
scores, `alibi_slopes` (H,) or (B, H) adding `-slope · |i + S - L - j|`, GQA/MQA by head
count. Code written for them runs unchanged, imported from `attnkit.flash_attn`. The packed
forms call the others on views of the packed dim; `flash_attn_varlen_func` runs each sequence
on its own (`packed.attend_packed`); `flash_attn_func` (and a varlen pack under `torch.compile`)
is one `attention_with_lse` over each query's window as `row_spans` (`dropins.window_spans`).

What differs (each docstring says it again): any dtype and device attnkit serves, not
only half on CUDA; a query that sees no key gives 0 and log-sum-exp -inf;
`return_attn_probs=True` returns `(out, softmax_lse, None)` (the probabilities are
`attnkit.attention_probs`); `deterministic` is accepted (attnkit's backward always is);
`dropout_p` is applied as attnkit's dropout (the same distribution, other random draws).
Outputs and log-sum-exps are contiguous in their layout (`out.view(B, L, H * D)` works);
a `block_table` that lists too few pages for a sequence, or a used entry that is no page
of the pool, raises `attnkit.BlockTableError` before anything is read or written.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.dropins import (
    KeySpans,
    check_block_table,
    check_cache_room,
    decode_packed,
    gather_pages,
    packed_spans,
    window_spans,
)
from attnkit.errors import ShapeContractError
from attnkit.flash_cache import cache_lengths, decode_pages, pool_size, read_cache, write_new
from attnkit.functional import attention_with_lse
from attnkit.masks import Mask, row_spans
from attnkit.masks.biases import _ALiBi
from attnkit.packed import MaskOf, attend_packed, window_mask

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

Window = tuple[int, int]


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
    """flash-attention's `flash_attn_func`: q (B, L, H, D), k and v (B, S, Hkv, D).

    Returns out (B, L, H, Dv); with `return_attn_probs`, (out, softmax_lse (B, H, L), None),
    both contiguous. Backward for q, k, v. Differs: see the module's docstring.
    """
    B, L, S = q.shape[0], q.shape[1], k.shape[1]
    index = torch.arange(L, device=q.device)[None].expand(B, L)
    first = torch.zeros(B, 1, dtype=torch.long, device=q.device)
    spans = window_spans(first, torch.full_like(first, S), L, index, _window(causal, window_size))
    mask = _mask(spans, alibi_slopes, q.dtype)
    out, lse = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                       softmax_scale, softcap, dropout_p)  # fmt: skip
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
    """flash-attention's `flash_attn_varlen_func`: packed q (T_q, H, D), k and v
    (T_k, Hkv, D), or with `block_table` (N, max_pages) pages (pages, page_size, Hkv, D)
    holding each sequence's cu_seqlens_k lengths.

    Returns out (T_q, H, Dv); with `return_attn_probs`, (out, softmax_lse (H, T_q), None),
    both contiguous. Backward for q, k, v. Differs: see the module's docstring.
    """
    if block_table is not None:
        lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(block_table.device)
        check_block_table("flash_attn_varlen_func", block_table, lengths, pool_size(k),
                          "cu_seqlens_k[{next}] - cu_seqlens_k[{n}]")  # fmt: skip
        window = _window(causal, window_size)
        if alibi_slopes is None and dropout_p == 0:
            decoded = decode_packed(q, k, v, cu_seqlens_q, block_table, lengths, window,
                                    softmax_scale, softcap)  # fmt: skip
            if decoded is not None:  # (T_q, H, Dv), (T_q, H)
                out, lse = decoded
                return (out, lse.T.contiguous(), None) if return_attn_probs else out
        k, v, cu_seqlens_k = gather_pages(k, v, block_table, lengths)
        used: Tensor | None = lengths
    else:
        used = None
    window = _window(causal, window_size)
    if torch.compiler.is_compiling():  # lengths unknown: the pack as one call
        spans, seq = packed_spans(cu_seqlens_q, cu_seqlens_k, q.shape[0], window, used)
        if alibi_slopes is not None and alibi_slopes.dim() == 2:  # per sequence: per row
            alibi_slopes = alibi_slopes[seq.to(alibi_slopes.device)][None]  # (1, T_q, H)
        mask = _mask(spans.one_batch_row(), alibi_slopes, q.dtype)
        qp, kp, vp = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, H, T, D)
        out, lse = _attend(qp, kp, vp, mask, softmax_scale, softcap, dropout_p)
        out, lse = out[0].transpose(0, 1), lse[0]  # (T_q, H, Dv), (H, T_q)
    else:  # each sequence on its own: order-invariant
        out, lse = attend_packed(
            q, k, v, cu_seqlens_q, cu_seqlens_k, _sequence_mask(window, alibi_slopes, q.dtype),
            scale=softmax_scale, softcap=softcap if softcap > 0 else None,
            dropout_p=dropout_p, used=used,
        )  # fmt: skip
    out = out.contiguous()  # (T_q, H, Dv)
    return (out, lse.contiguous(), None) if return_attn_probs else out


def _sequence_mask(window: Window, alibi_slopes: Tensor | None, dtype: torch.dtype) -> MaskOf:
    """Sequence n's mask: its window, and ALiBi with its slopes (H,) or row n of (N, H)
    around each query's aligned position."""
    if alibi_slopes is None:
        return lambda n, L, S: window_mask(window, L, S)

    def mask_of(n: int, L: int, S: int, slopes: Tensor = alibi_slopes) -> Mask:
        rows = torch.arange(L, device=slopes.device)
        spans = window_spans(rows.new_zeros(()), rows.new_tensor(S), L, rows, window)
        return _mask(spans.one_batch_row(), slopes[n] if slopes.dim() == 2 else slopes, dtype)

    return mask_of


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Any:
    """flash-attention's `flash_attn_with_kvcache`: q (B, L, H, D) against a cache
    (B_cache, S_cache, Hkv, D), or with `block_table` (B, max_pages) pages
    (pages, page_size, Hkv, D).

    `k`, `v` (B, L_new, Hkv, D), if given, are written into the cache in place at
    positions cache_seqlens.. of each sequence, then attended with the rest. The keys of
    sequence b are cache positions cache_leftpad[b] .. cache_seqlens[b] + L_new - 1.
    `rotary_cos`/`rotary_sin` (S_ro, rotary_dim / 2) rotate the new keys at their
    positions, and q at positions cache_seqlens.. (causal or local) or all at
    cache_seqlens (otherwise); `rotary_interleaved` pairs dims (0, 1), (2, 3), ... else
    (0, rotary_dim / 2), ... (GPT-NeoX). Returns out (B, L, H, Dv); with
    `return_softmax_lse`, (out, lse (B, H, L)), both contiguous. `num_splits` is accepted.
    No backward, as in flash-attention. With `block_table`, cache_seqlens[b] + L_new past
    max_pages · page_size, or a used page id outside the pool, raises `BlockTableError`
    and writes nothing. Differs: see the module's docstring.
    """
    B, L = q.shape[0], q.shape[1]
    dev = q.device
    rows_held = k_cache.shape[1] if block_table is None else None
    seqlens = cache_lengths(cache_seqlens, B, rows_held, dev)
    new = 0 if k is None else k.shape[1]
    if block_table is not None:  # before any write
        named = "cache_seqlens[{n}]" + (f" + {new} new keys" if new else "")
        check_block_table("flash_attn_with_kvcache", block_table, seqlens + new, pool_size(k_cache),
                          named)  # fmt: skip
    else:
        check_cache_room(seqlens + new, k_cache.shape[1], new)
    if rotary_cos is not None and rotary_sin is not None:
        local = causal or tuple(window_size) != (-1, -1)
        q_at = seqlens[:, None] + (torch.arange(L, device=dev)[None] if local else 0)
        q = _rotate(q, rotary_cos, rotary_sin, q_at.expand(B, L), rotary_interleaved)
        if k is not None:
            k_at = seqlens[:, None] + torch.arange(new, device=dev)[None]
            k = _rotate(k, rotary_cos, rotary_sin, k_at, rotary_interleaved)
    rows = torch.arange(B, device=dev) if cache_batch_idx is None else cache_batch_idx.long()
    if k is not None and v is not None:
        write_new(k_cache, v_cache, k, v, seqlens, rows, block_table)
    end = (seqlens + new)[:, None]  # (B, 1)
    first = (
        torch.zeros(B, dtype=torch.long, device=dev)
        if cache_leftpad is None
        else cache_leftpad.long().to(dev)
    )[:, None]
    index = torch.arange(L, device=dev)[None].expand(B, L)
    spans = window_spans(first, end - first, L, index, _window(causal, window_size))
    if block_table is not None and L == 1 and alibi_slopes is None:
        lo, hi = spans.lo[:, 0], spans.hi[:, 0]
        decoded = decode_pages(q, k_cache, v_cache, block_table, lo, hi, softmax_scale, softcap)
        if decoded is not None:
            return decoded if return_softmax_lse else decoded[0]
    keys, values = read_cache(k_cache, v_cache, rows, block_table, end)  # (B, S, Hkv, D)
    mask = _mask(spans, alibi_slopes, q.dtype)
    with torch.no_grad():
        out, lse = _attend(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                           mask, softmax_scale, softcap, 0.0)  # fmt: skip
    out = out.transpose(1, 2).contiguous()  # (B, L, H, Dv)
    return (out, lse.contiguous()) if return_softmax_lse else out


# ------------------------------------------------------------------ the packed forms


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attention's `flash_attn_qkvpacked_func`: `flash_attn_func` on
    qkv (B, L, 3, H, D) (self-attention, as many key heads as query heads).

    Returns out (B, L, H, D); with `return_attn_probs`, (out, softmax_lse (B, H, L), None).
    Backward into qkv. Differs: see the module's docstring.
    """
    q, k, v = _unpacked("flash_attn_qkvpacked_func", "qkv", qkv, 2, "(B, L, 3, H, D)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)  # fmt: skip


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attention's `flash_attn_kvpacked_func`: `flash_attn_func` on q (B, L, H, D)
    and kv (B, S, 2, Hkv, D).

    Returns out (B, L, H, D); with `return_attn_probs`, (out, softmax_lse (B, H, L), None).
    Backward into q and kv. Differs: see the module's docstring.
    """
    k, v = _unpacked("flash_attn_kvpacked_func", "kv", kv, 2, "(B, S, 2, Hkv, D)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)  # fmt: skip


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attention's `flash_attn_varlen_qkvpacked_func`: `flash_attn_varlen_func` on
    packed qkv (T, 3, H, D), the same `cu_seqlens` (N + 1,) for queries and keys.

    Returns out (T, H, D); with `return_attn_probs`, (out, softmax_lse (H, T), None).
    Backward into qkv. Differs: see the module's docstring.
    """
    q, k, v = _unpacked("flash_attn_varlen_qkvpacked_func", "qkv", qkv, 1, "(T, 3, H, D)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
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
) -> Any:
    """flash-attention's `flash_attn_varlen_kvpacked_func`: `flash_attn_varlen_func` on
    packed q (T_q, H, D) and kv (T_k, 2, Hkv, D).

    Returns out (T_q, H, D); with `return_attn_probs`, (out, softmax_lse (H, T_q), None).
    Backward into q and kv. Differs: see the module's docstring.
    """
    k, v = _unpacked("flash_attn_varlen_kvpacked_func", "kv", kv, 1, "(T_k, 2, Hkv, D)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic,
                                  return_attn_probs)  # fmt: skip


def _unpacked(call: str, name: str, packed: Tensor, dim: int, layout: str) -> tuple[Tensor, ...]:
    """The views of `packed` along `dim` (3 for qkv, 2 for kv), after checking that the
    layout's packed dim has that size; autograd takes their gradients back into it."""
    count = len(name)  # qkv: 3, kv: 2
    if packed.dim() != dim + 3 or packed.shape[dim] != count:  # (..., count, H, D)
        raise ShapeContractError(
            f"{call}: {name} must be {layout} ({count} at dim {dim}), got "
            f"{tuple(packed.shape)}; stack the tensors with torch.stack(..., dim={dim})"
        )
    return packed.unbind(dim)


# ------------------------------------------------------------------ the shared steps


def _window(causal: bool, window_size: Window) -> Window:
    """flash-attention's window with `causal` folded in (it sets the right side to 0)."""
    left, right = (int(w) for w in window_size)
    return (left, 0) if causal else (left, right)


def _mask(spans: KeySpans, alibi_slopes: Tensor | None, dtype: torch.dtype) -> Mask:
    """Each row's key interval, and ALiBi around each row's aligned position (its bias in
    float64 for float64 calls, else float32)."""
    mask = row_spans(spans.lo, spans.hi)
    if alibi_slopes is None:
        return mask
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return mask & _ALiBi(alibi_slopes.to(wide), None, positions=spans.at)


def _attend(
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


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of the first rotary_dim = 2·cos.shape[1] dims of x (B, n, H, D) at
    `positions` (B, n), flash-attention's convention (interleaved: pairs (0, 1), (2, 3),
    ...; else (0, rotary_dim / 2), (1, rotary_dim / 2 + 1), ...)."""
    half = cos.shape[1]
    c, s = (t[positions][:, :, None].to(torch.float32) for t in (cos, sin))  # (B, n, 1, half)
    rot, rest = x[..., : 2 * half].float(), x[..., 2 * half :]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        turned = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    return torch.cat([turned.to(x.dtype), rest], dim=-1)
