"""flash-attention 2's packed forms on attnkit: `flash_attn_func` and
`flash_attn_varlen_func` on views of one stacked tensor (qkv, or kv), with gradients
flowing back into it.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnkit.dropins.flash import flash_attn_func, flash_attn_varlen_func
from attnkit.dropins.flash_cache import unpacked
from attnkit.dropins.packed import Window

__all__ = [
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]


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
    """flash-attention's `flash_attn_qkvpacked_func`: `flash_attn_func` on views of one
    stacked tensor (self-attention), with backward into qkv.

    Args:
        qkv: (B, L, 3, H, D): q, k, v stacked at dim 2.
        dropout_p: as in `flash_attn_func`.
        softmax_scale: as in `flash_attn_func`.
        causal: as in `flash_attn_func`.
        window_size: as in `flash_attn_func`.
        softcap: as in `flash_attn_func`.
        alibi_slopes: as in `flash_attn_func`.
        deterministic: as in `flash_attn_func`.
        return_attn_probs: as in `flash_attn_func`.

    Returns:
        As `flash_attn_func`: out (B, L, H, D), or `(out, softmax_lse (B, H, L), None)`.

    Raises:
        ShapeContractError: qkv not (B, L, 3, H, D).

    Examples:
        >>> from attnkit.flash_attn import flash_attn_func, flash_attn_qkvpacked_func
        >>> qkv = torch.randn(2, 5, 3, 4, 8)  # (B, L, 3, H, D)
        >>> out = flash_attn_qkvpacked_func(qkv, causal=True)
        >>> out.shape, torch.allclose(out, flash_attn_func(*qkv.unbind(2), causal=True))
        (torch.Size([2, 5, 4, 8]), True)
    """
    q, k, v = unpacked("flash_attn_qkvpacked_func", "qkv", qkv, 2, "(B, L, 3, H, D)")
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


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
    """flash-attention's `flash_attn_kvpacked_func`: `flash_attn_func` with k and v
    stacked in one tensor, with backward into q and kv.

    Args:
        q: (B, L, H, D) queries.
        kv: (B, S, 2, Hkv, D): k and v stacked at dim 2, q's dtype.
        dropout_p: as in `flash_attn_func`.
        softmax_scale: as in `flash_attn_func`.
        causal: as in `flash_attn_func`.
        window_size: as in `flash_attn_func`.
        softcap: as in `flash_attn_func`.
        alibi_slopes: as in `flash_attn_func`.
        deterministic: as in `flash_attn_func`.
        return_attn_probs: as in `flash_attn_func`.

    Returns:
        As `flash_attn_func`: out (B, L, H, D), or `(out, softmax_lse (B, H, L), None)`.

    Raises:
        ShapeContractError: kv not (B, S, 2, Hkv, D).

    Examples:
        >>> from attnkit.flash_attn import flash_attn_func, flash_attn_kvpacked_func
        >>> q, kv = torch.randn(2, 1, 4, 8), torch.randn(2, 6, 2, 2, 8)  # Hkv = 2
        >>> out = flash_attn_kvpacked_func(q, kv, causal=True)  # 1 query, the last
        >>> out.shape, torch.allclose(out, flash_attn_func(q, *kv.unbind(2), causal=True))
        (torch.Size([2, 1, 4, 8]), True)
    """
    k, v = unpacked("flash_attn_kvpacked_func", "kv", kv, 2, "(B, S, 2, Hkv, D)")
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


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
    """flash-attention's `flash_attn_varlen_qkvpacked_func`: `flash_attn_varlen_func`
    on views of one stacked tensor (self-attention), with backward into qkv.

    Args:
        qkv: (T, 3, H, D): packed q, k, v stacked at dim 1.
        cu_seqlens: (N + 1,) int32 cumulative lengths, for queries and keys alike.
        max_seqlen: the longest sequence (accepted; attnkit reads the lengths).
        dropout_p: as in `flash_attn_func`.
        softmax_scale: as in `flash_attn_func`.
        causal: as in `flash_attn_func`.
        window_size: as in `flash_attn_func`.
        softcap: as in `flash_attn_func`.
        alibi_slopes: as in `flash_attn_varlen_func`.
        deterministic: as in `flash_attn_func`.
        return_attn_probs: as in `flash_attn_func`.

    Returns:
        As `flash_attn_varlen_func`: out (T, H, D), or `(out, softmax_lse (H, T), None)`.

    Raises:
        ShapeContractError: qkv not (T, 3, H, D).

    Examples:
        >>> from attnkit.flash_attn import flash_attn_varlen_qkvpacked_func as packed
        >>> qkv, cu = torch.randn(7, 3, 2, 8), torch.tensor([0, 3, 7], dtype=torch.int32)
        >>> out = packed(qkv, cu, 4, causal=True)  # (T, H, D)
        >>> out.shape, torch.allclose(out[:3], packed(qkv[:3], cu[:2], 3, causal=True))
        (torch.Size([7, 2, 8]), True)
    """
    q, k, v = unpacked("flash_attn_varlen_qkvpacked_func", "qkv", qkv, 1, "(T, 3, H, D)")
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


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
    """flash-attention's `flash_attn_varlen_kvpacked_func`: `flash_attn_varlen_func`
    with k and v stacked in one tensor, with backward into q and kv.

    Args:
        q: (T_q, H, D) packed queries.
        kv: (T_k, 2, Hkv, D): packed k and v stacked at dim 1, q's dtype.
        cu_seqlens_q: as in `flash_attn_varlen_func`.
        cu_seqlens_k: as in `flash_attn_varlen_func`.
        max_seqlen_q: as in `flash_attn_varlen_func`.
        max_seqlen_k: as in `flash_attn_varlen_func`.
        dropout_p: as in `flash_attn_func`.
        softmax_scale: as in `flash_attn_func`.
        causal: as in `flash_attn_func`.
        window_size: as in `flash_attn_func`.
        softcap: as in `flash_attn_func`.
        alibi_slopes: as in `flash_attn_varlen_func`.
        deterministic: as in `flash_attn_func`.
        return_attn_probs: as in `flash_attn_func`.

    Returns:
        As `flash_attn_varlen_func`: out (T_q, H, D), or `(out, softmax_lse (H, T_q),
        None)`.

    Raises:
        ShapeContractError: kv not (T_k, 2, Hkv, D).

    Examples:
        >>> from attnkit.flash_attn import flash_attn_varlen_kvpacked_func
        >>> q, kv = torch.randn(2, 4, 8), torch.randn(9, 2, 2, 8)  # 1 query a sequence
        >>> cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
        >>> cu_k = torch.tensor([0, 4, 9], dtype=torch.int32)  # 4 and 5 keys
        >>> flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 1, 5).shape  # (T_q, H, D)
        torch.Size([2, 4, 8])
    """
    k, v = unpacked("flash_attn_varlen_kvpacked_func", "kv", kv, 1, "(T_k, 2, Hkv, D)")
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )
