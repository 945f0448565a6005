"""Attention modules: the seed's `SingleHeadAttention`, on attnkit's machinery."""

from __future__ import annotations

from torch import Tensor, nn

from attnkit.errors import MaskError, ShapeContractError
from attnkit.reference import build_attention_mask, build_causal_mask, scaled_dot_product_attention

__all__ = ["SingleHeadAttention"]


def _real_tokens(attention_mask: Tensor, B: int, L: int) -> Tensor:
    """(B, L) bool, True = real token, from 1/True = real token."""
    if attention_mask.shape != (B, L):
        raise ShapeContractError(
            f"attention_mask must be (B, L) = {(B, L)} like x's first two dims, got "
            f"{tuple(attention_mask.shape)}."
        )
    if attention_mask.is_floating_point():
        raise MaskError(
            "attention_mask must be bool or 0/1 integers (1 = real token), got "
            f"{attention_mask.dtype}."
        )
    return attention_mask != 0


class SingleHeadAttention(nn.Module):
    """One attention head over (B, L, E) inputs: the seed chapters' module, bugs fixed.

    q, k, v are linear maps E -> head_dim (no bias); the output is the weighted sum of
    values, (B, L, head_dim), returned with the weights (B, L, L). Unlike the seed it
    projects v from x (not `x(x)`), keeps hidden weights exactly 0 (no clamping that
    would un-mask future or padded keys), and gives zeros, not NaN, to a query that
    sees nothing.
    """

    def __init__(self, n_embed: int, head_dim: int, *, causal: bool = True) -> None:
        super().__init__()
        if n_embed < 1 or head_dim < 1:
            raise ValueError(f"n_embed and head_dim must be >= 1, got {n_embed}, {head_dim}.")
        self.q_proj = nn.Linear(n_embed, head_dim, bias=False)
        self.k_proj = nn.Linear(n_embed, head_dim, bias=False)
        self.v_proj = nn.Linear(n_embed, head_dim, bias=False)
        self.causal = causal

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x: (B, L, E); attention_mask: (B, L), 1/True = real token. -> (out, weights)."""
        if x.dim() != 3:
            raise ShapeContractError(f"x must be (B, L, E), got shape {tuple(x.shape)}.")
        B, L, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, L, head_dim) each
        mask: Tensor | None = None
        if attention_mask is not None:
            real = _real_tokens(attention_mask, B, L)
            mask = build_attention_mask(real, L, self.causal)[:, 0]  # (B, L, L)
        elif self.causal:
            mask = build_causal_mask(L, device=x.device)  # (L, L)
        out, weights = scaled_dot_product_attention(q, k, v, mask)
        return out, weights  # (B, L, head_dim), (B, L, L)

    def extra_repr(self) -> str:
        return f"causal={self.causal}"
