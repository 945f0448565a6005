"""KV cache for incremental decoding: keys and values of past positions, kept once.

Storage grows geometrically (doubling), so appending one token at a time costs O(1)
amortized copies instead of re-concatenating the whole history at every step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.call.functional import attention
from attnkit.errors import ShapeContractError
from attnkit.kv.attender import Attender
from attnkit.masks import Mask

__all__ = ["KVCache"]


def _shape(t: object) -> object:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


class KVCache(Attender):
    """The keys and values of one layer's past positions, for incremental decoding.

    Empty until the first forward that is given it (`MultiHeadAttention(x, cache=...)`);
    then `length` counts the cached positions. A module given a cache appends its new
    keys/values (B, Hkv, L, D) and attends its L queries over all `length` keys, rotating
    them (RoPE) from position `length`: so a decoding step (L=1 query, S=length keys)
    passes `causal(align="bottom_right")`. Storage doubles as it fills (O(1) amortized
    copies a token); `crop` rolls back, `reset` starts the next sequence. Use one cache
    per layer.

    Examples:
        >>> mha = ak.MultiHeadAttention(16, 4, rope=True)
        >>> x = torch.randn(1, 6, 16)  # (B, L, E): a prompt of 4 tokens, then 2 more
        >>> cache = ak.KVCache()
        >>> outs = [mha(x[:, :4], mask=ak.causal(), cache=cache)]  # prefill
        >>> for t in (4, 5):  # one token a step: its query sees every cached key
        ...     outs.append(mha(x[:, t : t + 1], mask=ak.causal(align="bottom_right"), cache=cache))
        >>> cache.length
        6
        >>> torch.allclose(torch.cat(outs, dim=1), mha(x, mask=ak.causal()), atol=1e-5)
        True
    """

    def __init__(self) -> None:
        self._k: Tensor | None = None  # (B, Hkv, capacity, D)
        self._v: Tensor | None = None  # (B, Hkv, capacity, Dv)
        self.length = 0

    # a module's attender (`attnkit.kv.attender`): the new rows follow the cached ones
    def positions(self, rows: int, device: torch.device) -> int | Tensor:
        return self.length

    def attend_heads(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Mask | Tensor | None,
        *,
        dropout_p: float,
        backend: str,
    ) -> Tensor:
        """Append the new k, v and attend q over every cached key: (B, H, L, Dv)."""
        keys, values = self.append(k, v)  # (B, Hkv, length, D|Dv)
        return attention(q, keys, values, mask, dropout_p=dropout_p, backend=backend)

    @property
    def capacity(self) -> int:
        """Positions the storage holds before it grows again."""
        return 0 if self._k is None else self._k.shape[2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store n new positions after the cached ones and return all of them.

        Args:
            k: (B, Hkv, n, D) keys of the new positions.
            v: (B, Hkv, n, Dv) values, k's dtype and device.

        Returns:
            `(keys, values)`: (B, Hkv, length, D) and (B, Hkv, length, Dv) views of the
            storage, every cached position in order (valid until the next append).

        Raises:
            ShapeContractError: k or v not 4-D, disagreeing on (B, Hkv, n), or with
                other B, Hkv, D or Dv than the cache holds.
            TypeError: k and v of different dtypes or devices.
        """
        if not (isinstance(k, Tensor) and isinstance(v, Tensor)) or k.dim() != 4 or v.dim() != 4:
            raise ShapeContractError(
                f"KVCache.append takes k (B, Hkv, n, D) and v (B, Hkv, n, Dv), got "
                f"{_shape(k)} and {_shape(v)}; split heads first (split_heads)."
            )
        if k.shape[:3] != v.shape[:3]:
            raise ShapeContractError(
                f"KVCache.append: k {tuple(k.shape)} and v {tuple(v.shape)} must agree on "
                "(B, Hkv, n): one value per key, for the same batch and heads."
            )
        if k.dtype != v.dtype or k.device != v.device:
            raise TypeError(
                f"KVCache.append: k is {k.dtype} on {k.device}, v is {v.dtype} on {v.device}; "
                "give both one dtype and device."
            )
        if self._k is not None and self._v is not None:
            want = (self._k.shape[:2], self._k.shape[3], self._v.shape[3])
            if (k.shape[:2], k.shape[3], v.shape[3]) != want:
                raise ShapeContractError(
                    f"KVCache holds (B, Hkv)={tuple(self._k.shape[:2])}, D={self._k.shape[3]}, "
                    f"Dv={self._v.shape[3]}; got k {tuple(k.shape)}, v {tuple(v.shape)}. Use "
                    "one cache per layer and reset() it between sequences."
                )
        n = k.shape[2]
        if self.length + n > self.capacity:
            self._grow(k, v, max(self.length + n, 2 * self.capacity, 16))
        assert self._k is not None and self._v is not None
        self._k[:, :, self.length : self.length + n] = k
        self._v[:, :, self.length : self.length + n] = v
        self.length += n
        return self._k[:, :, : self.length], self._v[:, :, : self.length]

    def _grow(self, k: Tensor, v: Tensor, capacity: int) -> None:
        B, Hkv = k.shape[:2]
        new_k = k.new_empty(B, Hkv, capacity, k.shape[3])
        new_v = v.new_empty(B, Hkv, capacity, v.shape[3])
        if self._k is not None and self._v is not None:
            new_k[:, :, : self.length] = self._k[:, :, : self.length]
            new_v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = new_k, new_v

    def crop(self, length: int) -> None:
        """Keep only the first `length` positions (e.g. to roll back rejected draft tokens).

        Raises:
            ValueError: `length` not an int in [0, self.length].
        """
        if (
            isinstance(length, bool)
            or not isinstance(length, int)
            or not 0 <= length <= self.length
        ):
            raise ValueError(
                f"crop length must be an int in [0, {self.length}] (the cached positions), "
                f"got {length!r}; reset() forgets them all."
            )
        self.length = length

    def reset(self) -> None:
        """Forget every position (storage is kept for the next sequence)."""
        self.length = 0

    def __repr__(self) -> str:
        return f"KVCache(length={self.length}, capacity={self.capacity})"
