"""Converters from other mask conventions into attnkit's (`True` = may attend)."""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit._compat import torch_causal_bias
from attnkit.errors import MaskError, ShapeContractError
from attnkit.masks.base import Mask, _TensorMask
from attnkit.masks.positions import causal
from attnkit.masks.tokens import _KeyPadding

__all__ = [
    "from_additive_mask",
    "from_hf_attention_mask",
    "from_key_padding_mask",
    "from_torch_mask",
]

_ALIGNED = {"UPPER_LEFT": causal(align="top_left"), "LOWER_RIGHT": causal(align="bottom_right")}


def from_key_padding_mask(key_padding_mask: Tensor) -> Mask:
    """From `nn.MultiheadAttention`'s `key_padding_mask`, whose `True` means ignore.

    Args:
        key_padding_mask: (B, S) bool, `True` = a padded key to ignore.

    Returns:
        The `key_padding` mask of its opposite (`True` = real token), for batch B and
        S keys.

    Raises:
        MaskError: not a 2-D bool tensor.

    Examples:
        >>> ignore = torch.tensor([[False, False, True]])  # the last key is padding
        >>> print(ak.from_key_padding_mask(ignore).draw(2, 3))
        ■ ■ ·
        ■ ■ ·
    """
    if key_padding_mask.dtype != torch.bool or key_padding_mask.dim() != 2:
        raise MaskError(
            "from_key_padding_mask takes nn.MultiheadAttention's (B, S) bool mask "
            f"(True = ignore), got dtype {key_padding_mask.dtype} and shape "
            f"{tuple(key_padding_mask.shape)}."
        )
    return _KeyPadding(~key_padding_mask)


def from_hf_attention_mask(attention_mask: Tensor) -> Mask:
    """From a Hugging Face mask: the tokenizer's or the one an attention function gets.

    A 4-D mask stays a dense tensor: where the structure is known, build the `Mask`
    itself (`attnkit.integrations.transformers` does).

    Args:
        attention_mask: 2-D (B, S) integer or bool, 1 = real token, 0 = padding (the
            tokenizer's); or 4-D (B, 1|H, L, S) as transformers passes to attention
            functions: bool (`True` = may attend), 0/1 integers (1 = may attend) or
            additive floats (0 keeps; the dtype's minimum or `-inf` removes).

    Returns:
        A `Mask`: `key_padding` for 2-D, a dense tensor mask for 4-D.

    Raises:
        MaskError: another rank, a 2-D float mask, integers other than 0 and 1, or an
            additive mask holding other values (`from_additive_mask`).

    Examples:
        >>> print(ak.from_hf_attention_mask(torch.tensor([[1, 1, 0]])).draw(2, 3))
        ■ ■ ·
        ■ ■ ·
    """
    shape, dtype = tuple(attention_mask.shape), attention_mask.dtype
    if attention_mask.dim() == 4:
        if attention_mask.is_floating_point():
            return from_additive_mask(attention_mask)
        if dtype != torch.bool:
            _only_zero_and_one(attention_mask, "1 = may attend")
        return _TensorMask(attention_mask != 0 if dtype != torch.bool else attention_mask)
    if attention_mask.dim() != 2 or attention_mask.is_floating_point():
        raise MaskError(
            "from_hf_attention_mask takes a (B, S) integer or bool tensor of 1 = real token, "
            "or a 4-D (B, 1|H, L, S) bool, 0/1 or additive float mask, got dtype "
            f"{dtype} and shape {shape}."
        )
    _only_zero_and_one(attention_mask, "1 = real token")
    return _KeyPadding(attention_mask != 0)


def _only_zero_and_one(mask: Tensor, meaning: str) -> None:
    if not ((mask == 0) | (mask == 1)).all():
        raise MaskError(
            f"from_hf_attention_mask expects only 0 and 1 values ({meaning}); for "
            "other values build the visibility yourself, e.g. key_padding(m > 0)."
        )


def from_additive_mask(additive_mask: Tensor) -> Mask:
    """From an additive float mask whose entries are 0 (keep) or -inf (remove).

    Any other value is a bias, not a mask: pass that tensor directly as `mask=` instead.

    Args:
        additive_mask: float tensor broadcastable to (B, H, L, S); entries at or below
            the dtype's minimum (as transformers writes them) count as `-inf`.

    Returns:
        A dense `Mask` of its shape, `True` where the entry is 0.

    Raises:
        MaskError: a non-float tensor, or values other than 0 and `-inf`.

    Examples:
        >>> additive = torch.tensor([[0.0, -float("inf")], [0.0, 0.0]])
        >>> print(ak.from_additive_mask(additive).draw(2))
        ■ ·
        ■ ■
    """
    if not additive_mask.is_floating_point():
        raise MaskError(
            f"from_additive_mask takes a float tensor (0 keep, -inf remove), got dtype "
            f"{additive_mask.dtype}; for a bool mask (True = may attend) pass it directly."
        )
    removed = additive_mask <= torch.finfo(additive_mask.dtype).min
    if not ((additive_mask == 0) | removed).all():
        raise MaskError(
            "from_additive_mask: the mask holds values other than 0 and -inf, so it is a "
            "bias, not a visibility mask; pass the float tensor itself as mask= to add it."
        )
    return _TensorMask(~removed)


def from_torch_mask(mask: object, L: int | None = None, S: int | None = None) -> object:
    """torch's `CausalBias` (`causal_upper_left(L, S)` / `causal_lower_right(L, S)`) as
    the `causal` mask it stands for (top-left / bottom-right); any other mask as given.

    A `CausalBias` holds no values (it is a tensor only by type): read as a tensor it
    would be uninitialised memory. Its sizes must be the call's L and S (when known).
    """
    bias_types = torch_causal_bias()
    if bias_types is None or not isinstance(mask, bias_types[0]):
        return mask
    sizes = (mask.seq_len_q, mask.seq_len_kv)
    if L is not None and S is not None and sizes != (L, S):
        raise ShapeContractError(
            f"the CausalBias was made for L={sizes[0]} queries and S={sizes[1]} keys, but "
            f"the call has L={L} and S={S}; make it for these sizes, or pass "
            "attnkit.causal(align=...), which fits any size."
        )
    return _ALIGNED[mask.variant.name]
