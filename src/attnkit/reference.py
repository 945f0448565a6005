"""The readable implementation: attention as the seed chapters write it, bugs fixed.

One closed loop: scores `QKᵀ·scale` (B, H, L, S) -> hide what the mask hides -> stable
softmax over keys -> weighted sum of V (B, H, L, Dv). Every fast backend is tested
against this file run in float64.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.call.precision import compute_dtype
from attnkit.call.visibility import effective_visibility, values_poison, zero_unseen_by_visibility
from attnkit.errors import MaskError, ShapeContractError
from attnkit.heads import repeat_kv
from attnkit.masks import Mask, causal_offset, integer_mask_error, structure
from attnkit.softmax import softmax_with_lse

__all__ = [
    "attend",
    "attention_weights",
    "build_attention_mask",
    "build_causal_mask",
    "scaled_dot_product_attention",
    "weighted_values",
    "weights_and_lse",
]


def build_causal_mask(seq_len: int, *, device: torch.device | str | None = None) -> Tensor:
    """The causal mask as a tensor: `True` on and below the diagonal, query i sees keys 0..i.

    Args:
        seq_len: L (= S), an int >= 0.
        device: keyword-only, where the tensor is made (default None: the CPU).

    Returns:
        (L, L) bool tensor, `True` = may attend (`causal().materialize(1, 1, L, L)[0, 0]`).

    Raises:
        ValueError: `seq_len` not an int >= 0.

    Examples:
        >>> ak.build_causal_mask(3)
        tensor([[ True, False, False],
                [ True,  True, False],
                [ True,  True,  True]])
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be an int >= 0, got {seq_len!r}.")
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


def build_attention_mask(key_padding_mask: Tensor, query_length: int, causal: bool) -> Tensor:
    """A (B, 1, L, S) bool mask from a padding mask, causal or not.

    Args:
        key_padding_mask: (B, S) bool, `True` = real token.
        query_length: L.
        causal: also hide later keys (`j <= i`); needs L == S: for L != S use
            `causal(align='top_left' | 'bottom_right')`.

    Returns:
        (B, 1, L, S) bool tensor, `True` = may attend (a broadcast view when not causal).

    Raises:
        MaskError: `key_padding_mask` not bool (a float or integer mask).
        ShapeContractError: `key_padding_mask` not 2-D, or `causal` with L != S.

    Examples:
        >>> real = torch.tensor([[True, True, False]])  # the last key is padding
        >>> ak.build_attention_mask(real, 3, causal=True)[0, 0]
        tensor([[ True, False, False],
                [ True,  True, False],
                [ True,  True, False]])
    """
    if key_padding_mask.dtype != torch.bool:
        if key_padding_mask.is_floating_point():
            raise MaskError(
                f"key_padding_mask must be bool (True = real token), got "
                f"{key_padding_mask.dtype}; convert with m.bool() if 1 = real token."
            )
        raise integer_mask_error("key_padding_mask", key_padding_mask.dtype)
    if key_padding_mask.dim() != 2:
        raise ShapeContractError(
            f"key_padding_mask must be (B, S), got shape {tuple(key_padding_mask.shape)}."
        )
    B, S = key_padding_mask.shape
    L = query_length
    mask = key_padding_mask.view(B, 1, 1, S).expand(B, 1, L, S)  # (B, 1, L, S)
    if causal:
        causal_offset(None, L, S)  # raises for L != S, naming both alignments
        mask = mask & build_causal_mask(L, device=key_padding_mask.device)
    return mask


def weights_and_lse(
    q: Tensor,
    k: Tensor,
    visible: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    scale: float,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention weights (B, H, L, S) and log-sum-exp (B, H, L), in the compute dtype."""
    compute = compute_dtype(q.dtype)
    G = q.shape[1] // k.shape[1]
    # cast before repeating: the G heads' key gradients then sum in the compute dtype
    k = repeat_kv(k.to(compute), G)  # (B, H, S, D)
    # a non-finite key makes the scores of the rows that see it NaN, and nobody else's
    # (a hidden score's gradient is 0, and 0·NaN would reach the row through q·kᵀ)
    finite = torch.isfinite(k).all(-1)  # (B, H, S)
    broken = None if bool(finite.all()) else ~finite.unsqueeze(2)  # (B, H, 1, S)
    # (a row hides a key by the mask or by a bias of -inf)
    if broken is not None:
        k = torch.where(broken.transpose(-2, -1), 0.0, k)
    scores = (q.to(compute) @ k.transpose(-2, -1)) * scale  # (B, H, L, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)  # Gemma 2's logit softcapping
    if bias is not None:
        scores = scores + bias.to(compute)
    if visible is not None:
        scores = scores.masked_fill(~visible, -torch.inf)
    if broken is not None:
        hidden_by = effective_visibility(visible, bias)
        seen = broken if hidden_by is None else broken & hidden_by  # (B, H, L, S)
        scores = scores.masked_fill(seen, torch.nan)
    return softmax_with_lse(scores)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    visible: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    scale: float,
    softcap: float | None = None,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """The whole loop on validated inputs: returns `(out, weights, lse)`.

    Args:
        q: (B, H, L, D); k: (B, Hkv, S, D); v: (B, Hkv, S, Dv), H % Hkv == 0.
        visible: bool broadcastable to (B, H, L, S), `True` = may attend.
        bias: float broadcastable to (B, H, L, S), added to the scores.

    Returns:
        out (B, H, L, Dv) and weights (B, H, L, S) in q's dtype; lse (B, H, L) in the
        compute dtype (float32 for half inputs), `-inf` on empty rows.
    """
    effective = effective_visibility(visible, bias)
    q, k, v, _ = zero_unseen_by_visibility(q, k, v, effective)
    weights, lse = weights_and_lse(q, k, visible, bias, scale=scale, softcap=softcap)
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = weighted_values(dropped, v, effective)  # (B, H, L, Dv)
    return out.to(q.dtype), weights.to(q.dtype), lse


def weighted_values(weights: Tensor, v: Tensor, visible: Tensor | None) -> Tensor:
    """The weighted sum of the values each row sees, in the weights' dtype.

    A hidden key's weight is 0, but `0 * NaN = NaN`: so the finite values are summed,
    and a row gets a non-finite value only where it sees its key (`values_poison`).

    Args:
        weights: (B, H, L, S) attention weights, 0 where hidden.
        v: (B, Hkv, S, Dv) values, H % Hkv == 0.
        visible: bool broadcastable to (B, H, L, S), `True` = may attend, or None (all).

    Returns:
        (B, H, L, Dv).
    """
    v = repeat_kv(v.to(weights.dtype), weights.shape[1] // v.shape[1])  # (B, H, S, Dv), sums too
    finite = torch.isfinite(v)
    if visible is None or bool(finite.all()):
        return weights @ v  # (B, H, L, Dv)
    cols = (~finite).any(-1).any(1).any(0).nonzero().flatten()  # (N,) keys holding one
    seen = visible[..., cols] if visible.shape[-1] > 1 else visible  # (B|1, H|1, L|1, N|1)
    out = weights @ torch.where(finite, v, 0.0)  # (B, H, L, Dv)
    return out + values_poison(seen, v[:, :, cols]).to(out.dtype)


def _as_4d(t: Tensor) -> Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t


def _seed_inputs(
    mask: Mask | Tensor | None, q: Tensor, k: Tensor, scale: float | None
) -> tuple[Tensor | None, Tensor | None, float]:
    """(visible, bias, scale) for the seed functions, 4-D as `_as_4d(q)` is.

    A tensor mask is bool (visibility) or float (added to the scores); a `Mask` gives its
    visibility and, for a bias kind such as `alibi`, its bias over q's heads.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if mask is None:
        return None, None, scale
    if isinstance(mask, Tensor):
        if not (mask.dtype == torch.bool or mask.is_floating_point()):
            raise integer_mask_error("mask", mask.dtype)
        lifted = _as_4d(mask)
        return (None, lifted, scale) if mask.is_floating_point() else (lifted, None, scale)
    B = q.shape[0] if q.dim() >= 3 else 1
    H = q.shape[1] if q.dim() == 4 else 1
    L, S = q.shape[-2], k.shape[-2]
    visible = mask.dense(B, H, L, S, q.device)  # (B|1, H|1, L, S)
    bias = structure.dense_bias(mask, B, H, L, S, q.device)
    if q.dim() == 3:  # q is lifted to (1, B, L, D): the batch takes the head's place
        visible = visible.transpose(0, 1)
        bias = None if bias is None else bias.transpose(0, 1)
    return visible, bias, scale


def _check_seed_shapes(q: Tensor, k: Tensor, v: Tensor | None = None) -> None:
    if q.dim() < 2 or q.dim() > 4 or k.dim() != q.dim():
        raise ShapeContractError(
            f"q and k must both be (L, D), (B, L, D) or (B, H, L, D); got q {tuple(q.shape)} "
            f"and k {tuple(k.shape)}."
        )
    if q.shape[-1] != k.shape[-1]:
        raise ShapeContractError(
            f"head dim mismatch: q has D={q.shape[-1]} but k has D={k.shape[-1]}; scores "
            "are q·kᵀ, so both need the same head dim."
        )
    if v is not None and (v.dim() != k.dim() or v.shape[-2] != k.shape[-2]):
        raise ShapeContractError(
            f"K/V length mismatch: k is {tuple(k.shape)} but v is {tuple(v.shape)}; v needs "
            "one value per key (same S)."
        )


def attention_weights(
    q: Tensor, k: Tensor, mask: Mask | Tensor | None = None, *, scale: float | None = None
) -> Tensor:
    """The attention weights softmax(q·kᵀ·scale) over keys, the mask applied first.

    Args:
        q: (L, D), (B, L, D) or (B, H, L, D) queries, floating point.
        k: keys of q's rank, (..., S, D); with heads, (B, Hkv, S, D), H % Hkv == 0.
        mask: a `Mask`, a bool tensor broadcastable to (..., L, S) (`True` = may attend)
            or a float one added to the scores. Default None: every key visible.
        scale: keyword-only, multiplies q·kᵀ (default None: 1/√D).

    Returns:
        (..., L, S) weights in q's dtype, each row summing to 1; hidden keys exactly 0,
        a query that sees nothing all 0.

    Raises:
        ShapeContractError: ranks or head dims of q and k that differ.
        MaskError: an integer mask.

    Examples:
        >>> q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
        >>> w = ak.attention_weights(q, k, ak.causal())
        >>> w.shape, bool(w[0, 0, 0, 1:].eq(0).all())  # query 0 sees key 0 alone
        (torch.Size([1, 2, 3, 3]), True)
    """
    _check_seed_shapes(q, k)
    visible, bias, scale = _seed_inputs(mask, q, k, scale)
    weights, _ = weights_and_lse(_as_4d(q), _as_4d(k), visible, bias, scale=scale)
    return weights.to(q.dtype).reshape(*q.shape[:-1], k.shape[-2])


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The readable attention loop, returning the weights too. For production use
    `attnkit.attention`, held to this function's results.

    Args:
        q: (L, D), (B, L, D) or (B, H, L, D) queries, floating point.
        k: keys (..., S, D), of q's rank; with heads (B, Hkv, S, D), H % Hkv == 0.
        v: values (..., S, Dv), of k's rank and length.
        mask: as in `attention_weights` (default None: every key visible).
        scale: keyword-only, multiplies q·kᵀ (default None: 1/√D).

    Returns:
        `(output, weights)`: (..., L, Dv) and (..., L, S), in q's dtype; a query that
        sees nothing gets output 0 and weights 0.

    Raises:
        ShapeContractError: ranks, head dims or lengths of q, k, v that do not fit.
        MaskError: an integer mask.

    Examples:
        >>> q, k, v = (torch.randn(2, 3, 4) for _ in range(3))  # (B, L, D)
        >>> out, weights = ak.scaled_dot_product_attention(q, k, v, ak.causal())
        >>> out.shape, weights.shape
        (torch.Size([2, 3, 4]), torch.Size([2, 3, 3]))
        >>> torch.allclose(out, weights @ v)
        True
    """
    _check_seed_shapes(q, k, v)
    visible, bias, scale = _seed_inputs(mask, q, k, scale)
    out, weights, _ = attend(_as_4d(q), _as_4d(k), _as_4d(v), visible, bias, scale=scale)
    return out.reshape(*q.shape[:-1], v.shape[-1]), weights.reshape(*q.shape[:-1], k.shape[-2])
