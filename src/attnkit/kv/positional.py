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
    the (L,) tensor of positions `offset` (a context-parallel shard's global positions),
    and returns `(q, k)` rotated, in their dtypes. Then q·k depends only on the
    relative position.

    Args:
        head_dim: D, the features rotated, an even int >= 2.
        base: the wavelength base of the frequencies `base^(-2i/D)` (default 10000.0).

    Raises:
        ShapeContractError: an odd `head_dim`; when called, inputs of another last dim,
            or positions that are not one per row.

    Examples:
        >>> rope = ak.RotaryEmbedding(8)
        >>> q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)  # (B, H, L, D)
        >>> q_rot, k_rot = rope(q, k, offset=3)  # positions 3 .. 6
        >>> q_rot.shape
        torch.Size([1, 2, 4, 8])
        >>> def score(i, j):  # q[0] at position i, k[0] at position j
        ...     return (rope.rotate(q[..., :1, :], i) * rope.rotate(k[..., :1, :], j)).sum()
        >>> torch.allclose(score(3, 1), score(10, 8), atol=1e-5)  # both 2 apart
        True
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
        """Rotate one tensor by its rows' positions.

        Args:
            x: (..., L, head_dim) queries or keys, any floating dtype.
            offset: the first row's position, rows at `offset ... offset + L - 1`
                (default 0), or an (L,) integer tensor of each row's position.

        Returns:
            `x` rotated, of its shape and dtype.

        Raises:
            ShapeContractError: a last dim other than `head_dim`, or positions that are
                not one per row.
        """
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
        """Rotate q and k alike, as `rope(q, k, offset)`.

        Args:
            q: (B, H, L, head_dim) queries.
            k: (B, Hkv, L, head_dim) keys at the same positions.
            offset: as `rotate` (default 0; a module passes its KV-cache length).

        Returns:
            `(q, k)` rotated, in their shapes and dtypes.
        """
        return self.rotate(q, offset), self.rotate(k, offset)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"
