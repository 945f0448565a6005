"""ALiBi (Press et al., "Train Short, Test Long", 2022): a per-head linear penalty
`-slope_h · |i' - j|` added to the scores, as a mask with a bias that hides nothing.

`alibi(num_heads)` combines with visibility masks by `&` (`causal() & alibi(8)`);
`alibi_bias` gives the same values as a dense (1, H, L, S) float tensor.

`alibi_at` takes slopes per head, per batch row or per query row, and per-row positions:
`flash_attn_func`'s `alibi_slopes` (H,) or (B, H) around each row's aligned position.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit.errors import ShapeContractError
from attnkit.masks.base import BiasFn, Mask, Predicate, conjuncts
from attnkit.masks.checks import causal_offset
from attnkit.masks.spans import Spans

__all__ = ["alibi", "alibi_at", "alibi_bias", "alibi_rows", "alibi_slopes"]


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's per-head slopes: the geometric sequence 2^(-8/n), 2^(-16/n), ... for n = H.

    For H not a power of two, the paper takes the slopes of the closest smaller power of
    two n and fills the rest with every other slope of 2n.

    Args:
        num_heads: H, the number of query heads (an int >= 1).

    Returns:
        (H,) float32 tensor on the CPU, head `h`'s slope at index `h`.

    Raises:
        ValueError: `num_heads` < 1.

    Examples:
        >>> ak.alibi_slopes(4)
        tensor([0.2500, 0.0625, 0.0156, 0.0039])
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}.")

    def powers(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = powers(closest) + powers(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes)


def alibi_bias(
    num_heads: int,
    L: int,
    S: int | None = None,
    *,
    align: str | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """ALiBi as a dense additive bias `-slope_h · |i' - j|`, `i'` the aligned query position.

    Pass it as `mask=` (a float mask is added to the scores); add causality with `-inf`,
    e.g. `bias.masked_fill(~causal().materialize(...), -inf)`. `alibi(H)` is the same
    bias as a structured mask, which builds no L×S tensor.

    Args:
        num_heads: H, query heads (one slope each, `alibi_slopes(H)`).
        L: query length.
        S: key length (default None: L).
        align: `"top_left"` or `"bottom_right"` places the queries when L != S, as in
            `causal` (default None: only for L == S).
        device: where the bias is made (default None: the CPU).

    Returns:
        (1, H, L, S) float32 bias: 0 on the aligned diagonal, more negative further away.

    Raises:
        ShapeContractError: L != S and no `align`.

    Examples:
        >>> ak.alibi_bias(2, 3)[0, 0] + 0.0  # head 0, slope 1/16 (+ 0.0: no -0.0)
        tensor([[ 0.0000, -0.0625, -0.1250],
                [-0.0625,  0.0000, -0.0625],
                [-0.1250, -0.0625,  0.0000]])
    """
    S = L if S is None else S
    offset = causal_offset(align, L, S, constructor="alibi_bias")
    i = torch.arange(L, device=device)[:, None] + offset
    j = torch.arange(S, device=device)[None, :]
    distance = (i - j).abs().float()  # (L, S)
    slopes = alibi_slopes(num_heads).to(device)
    return -(slopes[:, None, None] * distance)[None]  # (1, H, L, S)


class _ALiBi(Mask):
    """Every key visible; adds `-slope · |i' - j|` to the scores (a structured bias).

    `slopes`: (H,) per head, (B, H) per batch row and head, or (B, L, H) per query row
    too (packed sequences, each with its own slopes). `positions`: None (i' = i + the
    alignment's offset) or (B|1, L), each query row's aligned key position i'.
    """

    def __init__(self, slopes: Tensor, align: str | None, positions: Tensor | None = None) -> None:
        self.slopes = slopes
        self.align = align
        self.positions = positions

    @property
    def num_heads(self) -> int:
        return int(self.slopes.shape[-1])

    @property
    def batch_size(self) -> int | None:
        sizes = [t.shape[0] for t in (self.slopes, self.positions) if t is not None and t.dim() > 1]
        return max(sizes) if sizes else None

    def check(self, B: int, H: int, L: int, S: int) -> None:
        if self.positions is None:
            causal_offset(self.align, L, S, constructor="alibi")
        if H != self.slopes.shape[-1]:
            raise ShapeContractError(
                f"alibi has {self.slopes.shape[-1]} slopes (one per head) but the call has "
                f"H={H} query heads; build it with alibi({H})."
            )
        for name, t, rows in (("slopes", self.slopes, 3), ("positions", self.positions, 2)):
            if t is not None and t.dim() > 1 and t.shape[0] not in (1, B):
                raise ShapeContractError(
                    f"alibi {name} hold {t.shape[0]} batch rows but the call has B={B}."
                )
            if t is not None and t.dim() == rows and t.shape[1] != L:
                raise ShapeContractError(
                    f"alibi {name} hold {t.shape[1]} query rows but the call has L={L}."
                )

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        return lambda b, h, i, j: (i >= 0) & (j >= 0)  # every pair: a bias hides nothing

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        hi = torch.full((1, 1), S, dtype=torch.long, device=device or "cpu")
        return Spans(torch.zeros_like(hi), hi, exact=True)  # every row sees [0, S)

    @property
    def has_bias(self) -> bool:
        return True

    def bias(self, B: int, H: int, L: int, S: int, device: torch.device) -> BiasFn | None:
        slopes = self.slopes.to(device)
        if slopes.dim() > 1:
            slopes = slopes.expand(B, *slopes.shape[1:])
        at = None if self.positions is None else self.positions.to(device).expand(B, L)
        offset = 0 if at is not None else causal_offset(self.align, L, S, constructor="alibi")

        def aligned(b: Tensor, i: Tensor) -> Tensor:  # query row i's aligned key position
            return i + offset if at is None else at[b, i]

        if slopes.dim() == 1:
            return lambda b, h, i, j: -slopes[h] * (aligned(b, i) - j).abs()
        if slopes.dim() == 2:
            return lambda b, h, i, j: -slopes[b, h] * (aligned(b, i) - j).abs()
        return lambda b, h, i, j: -slopes[b, i, h] * (aligned(b, i) - j).abs()

    def describe(self) -> str:
        align = "" if self.align is None else f", align={self.align!r}"
        return f"alibi(H={self.slopes.shape[-1]}{align})"

    def rows(self, B: int, H: int, L: int, S: int) -> tuple[Tensor, Tensor]:
        """Each query row's slopes (B, L, H) float32 and aligned position (B, L) int64."""
        slopes = self.slopes.float()
        if slopes.dim() == 1:
            slopes = slopes[None, None]  # (1, 1, H)
        elif slopes.dim() == 2:
            slopes = slopes[:, None]  # (B, 1, H)
        if self.positions is None:
            offset = causal_offset(self.align, L, S, constructor="alibi")
            at = (torch.arange(L) + offset)[None]
        else:
            at = self.positions.to(torch.long)
        return slopes.expand(B, L, H).contiguous(), at.expand(B, L).contiguous()


def alibi_rows(mask: Mask, B: int, H: int, L: int, S: int) -> tuple[Tensor, Tensor] | None:
    """A mask whose one bias is ALiBi (`alibi(H)` alone or `&` visibility masks) as each
    query row's slopes (B, L, H) float32 and aligned key position (B, L) int64 on the CPU,
    so a kernel adds `-slope · |position - j|` itself; None for any other bias."""
    biased = [m for m in conjuncts(mask) if m.has_bias]
    if len(biased) != 1 or not isinstance(biased[0], _ALiBi):
        return None
    if biased[0].slopes.device.type != "cpu":
        return None
    return biased[0].rows(B, H, L, S)


def alibi_at(slopes: Tensor, positions: Tensor) -> Mask:
    """ALiBi around given positions: adds `-slope · |positions[b, i] - j|` to the scores.

    `slopes`: (H,) per head, (B, H) per batch row and head, or (B, L, H) per query row
    (packed sequences, each with its own slopes); `positions`: (B|1, L), each query
    row's aligned key position (flash-attention's `alibi_slopes` over packed rows)."""
    return _ALiBi(slopes, None, positions=positions)


def alibi(num_heads: int, *, align: str | None = None) -> Mask:
    """ALiBi as a structured mask: adds `-slope_h · |i' - j|` to the scores, hides nothing.

    Combine it with visibility masks by `&` (`causal() & alibi(8)`; `|` and `~` refuse
    a bias); `tiled` evaluates it per block and `native` per row, building no L×S
    tensor. `alibi_bias` gives the same values as a dense tensor.

    Args:
        num_heads: H, the call's query heads (one slope each, `alibi_slopes(H)`).
        align: keyword-only, `"top_left"` or `"bottom_right"` places the queries when
            L != S, as in `causal` (default None: only for L == S).

    Returns:
        A `Mask` with a bias (`has_bias` True), for calls with H query heads.

    Raises:
        ValueError: `num_heads` < 1.
        ShapeContractError: when it meets a call of another H, or L != S and no `align`.

    Examples:
        >>> q, k, v = (torch.randn(1, 4, 3, 8) for _ in range(3))
        >>> inf = float("inf")
        >>> dense = ak.alibi_bias(4, 3).masked_fill(~ak.causal().materialize(1, 4, 3, 3), -inf)
        >>> out = ak.attention(q, k, v, ak.causal() & ak.alibi(4))
        >>> torch.allclose(out, ak.attention(q, k, v, dense), atol=1e-6)
        True
    """
    return _ALiBi(alibi_slopes(num_heads), align)
