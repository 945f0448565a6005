"""Positions: attention alone is blind to token order, so models add them.

RoPE (Su et al., "RoFormer", 2021) rotates q and k by angles proportional to their
positions, so q·k depends only on the relative position. ALiBi, the other way (a
penalty added to the scores), is a mask with a bias: `attnkit.masks.biases`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit.errors import ShapeContractError

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding of q and k (the "rotate half" layout of GPT-NeoX/LLaMA).

    `rope(q, k, offset=0)` rotates both (B, H, L, head_dim) tensors by positions
    `offset ... offset + L - 1` (a module passes its KV-cache length as `offset`), or by
    the (L,) tensor of positions `offset` (a context-parallel shard's global positions).
    """

    inv_freq: Tensor

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim < 2 or head_dim % 2:
            raise ShapeContractError(
                f"RotaryEmbedding rotates pairs of features: head_dim={head_dim} must be even."
            )
        self.head_dim, self.base = head_dim, base
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (head_dim/2,)

    def angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of shape (len(positions), head_dim) for float32 positions."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (L, head_dim/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (L, head_dim)
        return emb.cos(), emb.sin()

    def rotate(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """Rotate (..., L, head_dim) by positions offset .. offset + L - 1, or by the (L,)
        positions `offset`."""
        if x.shape[-1] != self.head_dim:
            raise ShapeContractError(
                f"RotaryEmbedding was built for head_dim={self.head_dim}, got x with last dim "
                f"{x.shape[-1]}."
            )
        if isinstance(offset, Tensor):
            if offset.shape != (x.shape[-2],):
                raise ShapeContractError(
                    f"RotaryEmbedding: positions of shape {tuple(offset.shape)} for x with "
                    f"L={x.shape[-2]} rows; pass one position per row, ({x.shape[-2]},)."
                )
            positions = offset.to(x.device)
        else:
            positions = torch.arange(offset, offset + x.shape[-2], device=x.device)
        cos, sin = self.angles(positions)  # (L, head_dim)
        half = self.head_dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    def forward(self, q: Tensor, k: Tensor, offset: int | Tensor = 0) -> tuple[Tensor, Tensor]:
        return self.rotate(q, offset), self.rotate(k, offset)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"
