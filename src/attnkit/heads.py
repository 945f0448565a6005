"""Heads: split an embedding into heads and back, and the GQA grouping of K/V heads."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit._compat import apply
from attnkit.call.precision import compute_dtype
from attnkit.errors import ShapeContractError

__all__ = ["merge_heads", "repeat_kv", "repeat_kv_exact_grad", "split_heads", "sum_groups"]


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    """Split an embedding into heads: (B, L, E) -> (B, H, L, E/H).

    Head `h` gets the contiguous slice `E/H·h ... E/H·(h+1) - 1` of each embedding.

    Args:
        x: (B, L, E) tensor, any dtype.
        num_heads: H, an int >= 1 dividing E.

    Returns:
        (B, H, L, E/H) view of `x` (no copy), the layout `attention` takes.

    Raises:
        ShapeContractError: `x` not 3-D, or H not dividing E (naming the H that do).

    Examples:
        >>> x = torch.randn(2, 5, 12)  # (B, L, E)
        >>> ak.split_heads(x, 3).shape  # (B, H, L, E/H)
        torch.Size([2, 3, 5, 4])
        >>> torch.equal(ak.merge_heads(ak.split_heads(x, 3)), x)
        True
    """
    if x.dim() != 3:
        raise ShapeContractError(
            f"split_heads takes x of shape (B, L, E), got {x.dim()} dims {tuple(x.shape)}."
        )
    B, L, E = x.shape
    if num_heads < 1 or E % num_heads != 0:
        raise ShapeContractError(
            f"split_heads: E={E} is not divisible by num_heads={num_heads}; choose H that "
            f"divides E (e.g. {[h for h in range(1, min(E, 16) + 1) if E % h == 0]})."
        )
    return x.view(B, L, num_heads, E // num_heads).transpose(1, 2)  # (B, H, L, E/H)


def merge_heads(x: Tensor) -> Tensor:
    """Merge heads back into an embedding: (B, H, L, Dv) -> (B, L, H·Dv).

    The inverse of `split_heads`: an `attention` output goes back to the model's layout.

    Args:
        x: (B, H, L, Dv) tensor, any dtype.

    Returns:
        (B, L, H·Dv) tensor of `x`'s dtype, head `h` in the slice `Dv·h ... Dv·(h+1) - 1`.

    Raises:
        ShapeContractError: `x` not 4-D.

    Examples:
        >>> out = torch.randn(2, 3, 5, 4)  # (B, H, L, Dv), e.g. from ak.attention
        >>> ak.merge_heads(out).shape  # (B, L, H·Dv)
        torch.Size([2, 5, 12])
    """
    if x.dim() != 4:
        raise ShapeContractError(
            f"merge_heads takes x of shape (B, H, L, Dh), got {x.dim()} dims {tuple(x.shape)}."
        )
    B, H, L, Dh = x.shape
    return x.transpose(1, 2).reshape(B, L, H * Dh)  # (B, L, E)


def repeat_kv(x: Tensor, groups: int) -> Tensor:
    """(B, Hkv, S, D) -> (B, Hkv*G, S, D): query head h reads K/V head h // G.

    Contiguous groups, as `repeat_interleave` and `F.scaled_dot_product_attention(
    enable_gqa=True)` define them.
    """
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def repeat_kv_exact_grad(x: Tensor, groups: int) -> Tensor:
    """`repeat_kv` whose backward sums the G heads' gradients in float32 for half (then
    rounds once; `sum_groups`).

    For half K/V given to a kernel without GQA: autograd's own sum would add G half
    gradients in half precision, one rounding per head.
    """
    if groups == 1:
        return x
    out: Tensor = apply(_RepeatKV, x, groups)
    return out


class _RepeatKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, groups: int) -> Tensor:
        ctx.groups = groups
        return x.repeat_interleave(groups, dim=1)  # (B, Hkv·G, S, D)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return sum_groups(grad, ctx.groups), None


def sum_groups(grad: Tensor, groups: int) -> Tensor:
    """(B, Hkv·G, S, D) per-query-head gradients -> (B, Hkv, S, D): each group of G summed
    in the compute dtype (float32 for half; float64 stays float64), rounded once to
    `grad`'s dtype (the backward of `repeat_kv`)."""
    B, H, S, D = grad.shape
    per_head = grad.reshape(B, H // groups, groups, S, D)
    return per_head.sum(2, dtype=compute_dtype(grad.dtype)).to(grad.dtype)
