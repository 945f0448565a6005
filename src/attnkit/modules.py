"""Attention modules: the seed's `SingleHeadAttention` and `MultiHeadAttention`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit.backends import backend_names
from attnkit.call.habits import points_habits
from attnkit.errors import MaskError, ShapeContractError
from attnkit.heads import merge_heads, split_heads
from attnkit.kv.attender import PLAIN, Attender
from attnkit.kv.cache import KVCache
from attnkit.kv.paged import PagedLayer
from attnkit.kv.positional import RotaryEmbedding
from attnkit.masks import Mask
from attnkit.reference import build_attention_mask, build_causal_mask, scaled_dot_product_attention

__all__ = ["MultiHeadAttention", "SingleHeadAttention"]


def _zero_one(name: str, mask: Tensor) -> Tensor:
    """Bool from a mask of 1/True = keep: bool, integer or float 0/1 (what collate
    functions yield); any other value is refused."""
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise MaskError(
            f"{name} must hold only 0 and 1 (1 = keep), got values such as "
            f"{sorted(set(mask[(mask != 0) & (mask != 1)].tolist()))[:4]}; for an additive "
            "float bias use attnkit.attention(..., mask=bias)."
        )
    return mask != 0


def _real_tokens(attention_mask: Tensor, B: int, L: int) -> Tensor:
    """(B, L) bool, True = real token, from 1/True = real token."""
    if tuple(attention_mask.shape) != (B, L):
        raise ShapeContractError(
            f"attention_mask must be (B, L) = {(B, L)} like x's first two dims, got "
            f"{tuple(attention_mask.shape)}."
        )
    return _zero_one("attention_mask", attention_mask)


class SingleHeadAttention(nn.Module):
    """One attention head over (B, T, n_embed) inputs: the seed chapters' module, bugs fixed.

    q, k, v are linear maps n_embed -> head_dim (no bias), and `proj` maps the weighted
    sum of values back to n_embed, as in the seed (same parameter names, so a seed
    checkpoint loads). Unlike the seed it projects v from x (not `x(x)`), keeps hidden
    weights exactly 0 (no clamping that would un-mask future or padded keys), and gives
    zeros, not NaN, to a query that sees nothing. Calling it returns
    `(out (B, T, n_embed), weights (B, T, T))` (see `forward`).

    Args:
        n_embed: E, the width of x and of the output, an int >= 1.
        head_dim: the width of q, k and v, an int >= 1.
        causal: query t sees only keys up to t (default True).

    Raises:
        ValueError: n_embed or head_dim below 1.

    Examples:
        >>> head = ak.SingleHeadAttention(n_embed=8, head_dim=4)
        >>> x = torch.randn(2, 5, 8)  # (B, T, n_embed)
        >>> real = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])  # row 1: 2 padding
        >>> out, weights = head(x, attention_mask=real)
        >>> out.shape, weights.shape
        (torch.Size([2, 5, 8]), torch.Size([2, 5, 5]))
        >>> (weights[0, 1] > 0).tolist()  # causal: query 1 sees keys 0 and 1 only
        [True, True, False, False, False]
        >>> bool((weights[1, :, 3:] == 0).all())  # nobody attends to padding
        True
    """

    def __init__(self, n_embed: int, head_dim: int, *, causal: bool = True) -> None:
        super().__init__()
        if n_embed < 1 or head_dim < 1:
            raise ValueError(f"n_embed and head_dim must be >= 1, got {n_embed}, {head_dim}.")
        self.n_embed, self.head_dim = n_embed, head_dim
        self.q_proj = nn.Linear(n_embed, head_dim, bias=False)
        self.k_proj = nn.Linear(n_embed, head_dim, bias=False)
        self.v_proj = nn.Linear(n_embed, head_dim, bias=False)
        self.proj = nn.Linear(head_dim, n_embed)
        self.causal = causal

    def forward(
        self, x: Tensor, attention_mask: Tensor | None = None, *, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Attend x to itself.

        Args:
            x: (B, T, n_embed) inputs.
            attention_mask: (B, T), 1/True = real token (bool, integer or float 0/1);
                padding keys are hidden (default None: all real).
            mask: (T, T) or (B, T, T), 1/True = query may see key, the seed's first
                version (default None). Both combine with the causal mask when `causal`.

        Returns:
            `(out, weights)`: (B, T, n_embed) in x's dtype, and the (B, T, T) weights
            (each row sums to 1, or is all 0 where a query sees nothing).

        Raises:
            ShapeContractError: x, attention_mask or mask of another shape.
            MaskError: a mask holding values other than 0 and 1.
        """
        if x.dim() != 3 or x.shape[-1] != self.n_embed:
            raise ShapeContractError(
                f"x must be (B, T, n_embed={self.n_embed}), got shape {tuple(x.shape)}."
            )
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, T, head_dim) each
        visible: Tensor | None = build_causal_mask(T, device=x.device) if self.causal else None
        if attention_mask is not None:
            real = _real_tokens(attention_mask, B, T)  # (B, T)
            visible = build_attention_mask(real, T, self.causal)[:, 0]  # (B, T, T)
        if mask is not None:
            if tuple(mask.shape) not in ((T, T), (B, T, T)):
                raise ShapeContractError(
                    f"mask must be (T, T) or (B, T, T) with T={T}, B={B}; got {tuple(mask.shape)}."
                )
            given = _zero_one("mask", mask)
            visible = given if visible is None else visible & given
        out, weights = scaled_dot_product_attention(q, k, v, visible)
        return self.proj(out), weights  # (B, T, n_embed), (B, T, T)

    def extra_repr(self) -> str:
        return f"causal={self.causal}"


class MultiHeadAttention(nn.Module):
    """Multi-head self- or cross-attention on (B, L, E), with GQA/MQA, RoPE and a KV cache.

    Every call reads project → attend → merge: q, k and v are projected and split into
    heads of head_dim = E / H, attend through one protocol (`attnkit.kv.attender`):
    `attnkit.attention(..., backend=)`, a `KVCache`, a paged cache's layer, or, with
    `context` set (`attnkit.distributed.parallelize`), context-parallel attention over a
    sequence sharded across processes (self-attention, no cache); then the heads are
    merged and projected back to E. `from_torch` / `to_torch` convert from and to
    `nn.MultiheadAttention` (weights copied; attnkit is batch-first).

    Args:
        embed_dim: E, the width of query and of the output; divisible by num_heads.
        num_heads: H, query heads.
        num_kv_heads: Hkv, key/value heads, dividing H: fewer shares each K/V head
            among G = H / Hkv query heads (GQA; 1 is MQA). Default None: H.
        kdim: width of the key input (default None: E), for cross-attention.
        vdim: width of the value input (default None: E).
        bias: whether the four projections have biases (default True).
        dropout: dropout on the attention weights in training mode, in [0, 1)
            (default 0.0; `.eval()` turns it off).
        rope: True for a `RotaryEmbedding(head_dim)`, or one to use: rotates q and k by
            position, offset by the cache length (default None: no rotation).
        backend: the `attnkit.attention` backend the heads run on (default "auto").

    Raises:
        ValueError: E not divisible by H, H not by Hkv, dropout outside [0, 1), or an
            unknown backend.

    Examples:
        >>> mha = ak.MultiHeadAttention(64, 8, num_kv_heads=2)  # GQA: 4 query heads a K/V head
        >>> x = torch.randn(2, 10, 64)  # (B, L, E)
        >>> mha(x, mask=ak.causal()).shape  # (B, L, E)
        torch.Size([2, 10, 64])
        >>> cross = ak.MultiHeadAttention(64, 8, kdim=32, vdim=16, bias=False, dropout=0.1)
        >>> memory, values = torch.randn(2, 7, 32), torch.randn(2, 7, 16)  # S = 7 keys
        >>> cross.eval()(x, memory, values).shape  # queries (B, L, E) attend to S keys
        torch.Size([2, 10, 64])
        >>> torch_mha = torch.nn.MultiheadAttention(64, 8, batch_first=True)
        >>> ours = ak.MultiHeadAttention.from_torch(torch_mha)
        >>> torch.allclose(ours(x), torch_mha(x, x, x, need_weights=False)[0], atol=1e-5)
        True
    """

    context: Any = None  # an attnkit.distributed.ContextParallel, or None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        rope: bool | RotaryEmbedding | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        _check_heads(embed_dim, num_heads, num_kv_heads)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout}.")
        if backend not in backend_names():
            raise ValueError(f"unknown backend {backend!r}; choose one of {backend_names()}.")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.dropout, self.backend = dropout, backend
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(self.kdim, kv_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, kv_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.rope = RotaryEmbedding(self.head_dim) if rope is True else (rope or None)

    def project(
        self, query: Tensor, key: Tensor, value: Tensor, offset: int | Tensor = 0
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, L, hd), k and v (B, Hkv, S, hd): projected, split and rotated."""
        q = split_heads(self.q_proj(query), self.num_heads)  # (B, H, L, hd)
        k = split_heads(self.k_proj(key), self.num_kv_heads)  # (B, Hkv, S, hd)
        v = split_heads(self.v_proj(value), self.num_kv_heads)  # (B, Hkv, S, hd)
        if self.rope is not None:
            q, k = self.rope(q, k, offset)
        return q, k, v

    @points_habits
    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Mask | Tensor | None = None,
        cache: KVCache | PagedLayer | None = None,
    ) -> Tensor:
        """Attend query to key/value (self-attention when they are left out).

        Args:
            query: (B, L, E).
            key: (B, S, kdim) (default None: query).
            value: (B, S, vdim) (default None: key).
            mask: as `attnkit.attention` takes it, over (B, H, L, S) (default None).
            cache: a `KVCache`: the new keys/values are appended and attended with the
                cached ones (pass `causal(align="bottom_right")` so query i sees keys up
                to its position); or `pages.layer(step, i)` of a `PagedKVCache`: query
                is the step's new tokens of many sequences packed as (1, T, E), each
                attending causally to its own sequence (mask None or
                `sliding_window(left)`), RoPE by position in its sequence.

        Returns:
            (B, L, E) in query's dtype.

        Raises:
            ShapeContractError: inputs of another width, or key and value whose B or S
                disagree.
            TypeError: SDPA's or nn.MultiheadAttention's keywords (`attn_mask`,
                `key_padding_mask`, ...), naming the attnkit way.
        """
        attender = self._attender(cache)
        dropout_p = self.dropout if self.training else 0.0
        attender.check(query, key, value, dropout_p)
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value)
        positions = attender.positions(query.shape[1], query.device)
        q, k, v = self.project(query, key, value, positions)
        out = attender.attend_heads(q, k, v, mask, dropout_p=dropout_p, backend=self.backend)
        projected: Tensor = self.out_proj(merge_heads(out))  # (B, L, E)
        return projected

    def _attender(self, cache: KVCache | PagedLayer | None) -> Attender:
        """Where the heads attend: the context this module was parallelized under (it
        takes no cache), else the cache, else plain attention."""
        if self.context is None:
            return PLAIN if cache is None else cache
        if cache is not None:
            raise ValueError(
                "context parallelism shards one sequence for self-attention: call the module "
                "with the query rows only (no key, value or cache), or set .context = None."
            )
        context: Attender = self.context
        return context

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        """Shapes against the projections, named, before a Linear raises a bare error."""
        for name, t, width in (
            ("query", query, self.embed_dim),
            ("key", key, self.kdim),
            ("value", value, self.vdim),
        ):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
            if t.dim() != 3 or t.shape[-1] != width:
                raise ShapeContractError(
                    f"{name} must be (B, length, {width}) (batch first), got shape "
                    f"{tuple(t.shape)}; the module was built for "
                    f"{'embed_dim' if name == 'query' else name[0] + 'dim'}={width}."
                )
        if key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
            raise ShapeContractError(
                f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                f"{tuple(value.shape)} need one batch size B, and key and value one length S."
            )

    @classmethod
    def from_torch(
        cls, module: nn.MultiheadAttention, *, backend: str = "auto"
    ) -> MultiHeadAttention:
        """The same attention as `module`, its weights copied (attnkit is batch-first)."""
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError(
                "from_torch: add_bias_kv and add_zero_attn append extra keys; attnkit has no "
                "equivalent, build the module without them."
            )
        E = module.embed_dim
        ours = cls(
            E,
            module.num_heads,
            kdim=module.kdim,
            vdim=module.vdim,
            bias=module.in_proj_bias is not None,
            dropout=module.dropout,
            backend=backend,
        )
        ours.to(device=module.out_proj.weight.device, dtype=module.out_proj.weight.dtype)
        with torch.no_grad():
            if module.in_proj_weight is not None:
                weights = module.in_proj_weight.chunk(3)
            else:
                weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
            for proj, weight in zip((ours.q_proj, ours.k_proj, ours.v_proj), weights, strict=True):
                proj.weight.copy_(weight)
            if module.in_proj_bias is not None:
                for proj, b in zip(
                    (ours.q_proj, ours.k_proj, ours.v_proj),
                    module.in_proj_bias.chunk(3),
                    strict=True,
                ):
                    assert proj.bias is not None
                    proj.bias.copy_(b)
            ours.out_proj.load_state_dict(module.out_proj.state_dict())
        return ours

    def to_torch(self) -> nn.MultiheadAttention:
        """An `nn.MultiheadAttention` (batch_first=True) with these weights, where possible."""
        if self.num_kv_heads != self.num_heads or self.rope is not None:
            raise ValueError(
                "to_torch: nn.MultiheadAttention has no GQA/MQA (num_kv_heads != num_heads) "
                "and no RoPE; only plain multi-head attention converts."
            )
        has_bias = self.q_proj.bias is not None
        weight = self.out_proj.weight
        module = nn.MultiheadAttention(
            self.embed_dim,
            self.num_heads,
            dropout=self.dropout,
            bias=has_bias,
            kdim=self.kdim,
            vdim=self.vdim,
            batch_first=True,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            projections = (self.q_proj, self.k_proj, self.v_proj)
            if module.in_proj_weight is not None:
                module.in_proj_weight.copy_(torch.cat([p.weight for p in projections]))
            else:
                module.q_proj_weight.copy_(self.q_proj.weight)
                module.k_proj_weight.copy_(self.k_proj.weight)
                module.v_proj_weight.copy_(self.v_proj.weight)
            if has_bias:
                biases: list[Tensor] = [p.bias for p in projections if p.bias is not None]
                module.in_proj_bias.copy_(torch.cat(biases))
            module.out_proj.load_state_dict(self.out_proj.state_dict())
        return module

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, backend={self.backend!r}"
        )


def _check_heads(embed_dim: int, num_heads: int, num_kv_heads: int) -> None:
    if num_heads < 1 or embed_dim % num_heads:
        raise ValueError(
            f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}: each head "
            "gets embed_dim / num_heads features; choose num_heads that divides embed_dim."
        )
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}: GQA "
            "shares each K/V head among num_heads / num_kv_heads query heads."
        )
