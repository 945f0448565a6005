"""Masked (safe) softmax, and the log-sum-exp math every backend shares.

The textbook softmax `exp(s) / sum(exp(s))` overflows for large scores and gives
0/0 = NaN on a row whose scores are all `-inf` (a query that may see no key). Here:
subtract the row maximum (treating an all `-inf` row's maximum as 0), and divide by
the sum only where it is positive, so an empty row gives weights 0 and a finite, zero
gradient.

The log-sum-exp lets results over disjoint key sets merge exactly (`merge_partials`;
`merge_in_place` for tiled's blocks), adds attention sinks (`add_sinks`), and carries a
gradient into a fused backward kernel (`with_lse_gradient`): tiled, sdpa, blockwise,
the distributed pieces and the paged calls all take it from here.

Sinks: `add_sinks` merges a backend's result with a part of no value whose log-sum-exp
is the sink, `out·exp(lse − lse')` with `lse' = logaddexp(lse, sink)`, so every backend
whose lse has a gradient serves sinks, with no L×S tensor.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit._compat import broadcast_shapes
from attnkit.call.precision import compute_dtype
from attnkit.errors import ShapeContractError
from attnkit.masks import integer_mask_error

__all__ = [
    "add_sinks",
    "compute_dtype",
    "masked_softmax",
    "merge_in_place",
    "merge_partials",
    "part_gradients",
    "softmax_with_lse",
    "with_lse_gradient",
]


def softmax_with_lse(scores: Tensor, dim: int = -1) -> tuple[Tensor, Tensor]:
    """Stable softmax along `dim` and its log-sum-exp; masked entries are `-inf`.

    Returns `(weights, lse)`: weights have the shape of `scores`, with an all `-inf` row
    giving 0 everywhere; `lse` drops `dim`, natural log, `-inf` on such a row.
    """
    row_max = scores.amax(dim, keepdim=True).detach()  # softmax is shift-invariant
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - row_max)  # -inf -> exactly 0
    total = exp.sum(dim, keepdim=True)
    nonempty = total > 0
    safe_total = torch.where(nonempty, total, torch.ones_like(total))
    weights = exp / safe_total
    lse = torch.where(nonempty, row_max + torch.log(safe_total), torch.full_like(total, -torch.inf))
    return weights, lse.squeeze(dim)


def masked_softmax(scores: Tensor, mask: Tensor | None = None, dim: int = -1) -> Tensor:
    """Softmax over `dim` that only spreads weight over visible entries.

    Stable: the row maximum is subtracted first, and a row that sees nothing gets 0
    (never 0/0 = NaN), with finite, zero gradients.

    Args:
        scores: (..., L, S) raw scores, floating point.
        mask: broadcastable to `scores`; bool with `True` = visible, or float added as a
            bias (0 keeps, `-inf` removes). Default None: every entry visible.
        dim: the dim to normalize over (default -1, the keys).

    Returns:
        Weights of the shape and dtype of `scores`; hidden entries exactly 0, a row with
        nothing visible all 0 (never NaN). Half precision is computed in float32.

    Raises:
        ShapeContractError: `mask` does not broadcast to `scores`.
        MaskError: an integer mask (ambiguous: `integer_mask_error`).

    Examples:
        >>> scores = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
        >>> mask = torch.tensor([[True, True, False], [False, False, False]])
        >>> ak.masked_softmax(scores, mask)  # row 1 sees nothing: zeros, not NaN
        tensor([[0.2689, 0.7311, 0.0000],
                [0.0000, 0.0000, 0.0000]])
    """
    logits = scores.to(compute_dtype(scores.dtype))
    if mask is not None:
        try:
            fits = broadcast_shapes(mask.shape, scores.shape) == scores.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ShapeContractError(
                f"masked_softmax: mask of shape {tuple(mask.shape)} does not broadcast to "
                f"scores of shape {tuple(scores.shape)}; give it the scores' shape, or 1 "
                "where it is shared (e.g. (L, S) for every batch and head)."
            )
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, -torch.inf)
        elif mask.is_floating_point():
            logits = logits + mask
        else:
            raise integer_mask_error("mask", mask.dtype)
    weights, _ = softmax_with_lse(logits, dim)
    return weights.to(scores.dtype)


def merge_partials(outs: list[Tensor], lses: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Merge attention over disjoint key sets into attention over their union, exactly.

    Part `p` attended its keys with output `outs[p]` (B, H, L, Dv) and log-sum-exp
    `lses[p]` (B, H, L). The union's softmax reweights each part by `exp(lse_p - lse)`,
    `lse = logsumexp_p(lse_p)` (the flash-attention / ring-attention rescaling).
    Rows empty in every part stay 0 with lse `-inf`, and their gradients 0 (never NaN).
    """
    stacked = torch.stack(lses)  # (P, B, H, L)
    empty = (stacked == -math.inf).all(0)  # (B, H, L): no part saw a key
    # logsumexp over safe inputs where every part is -inf: its gradient there is NaN
    lse = torch.logsumexp(torch.where(empty, 0.0, stacked), dim=0).masked_fill(empty, -math.inf)
    safe = torch.where(empty, 0.0, lse)
    scale = torch.exp(stacked - safe)  # (P, B, H, L); empty parts give exp(-inf) = 0
    out = sum(s.unsqueeze(-1) * o.to(s.dtype) for s, o in zip(scale, outs, strict=True))
    assert isinstance(out, Tensor)
    return out.to(outs[0].dtype), lse


def part_gradients(
    out_part: Tensor, lse_part: Tensor, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor
) -> tuple[Tensor, Tensor]:
    """The gradients one part of a merge receives: `out = Σ_p w_p·out_p` with
    `w_p = exp(lse_p - lse)`, so `out_p` gets `w_p·dout` and `lse_p` gets
    `w_p·(⟨dout, out_p - out⟩ + dlse)` (0 on rows that nobody saw). Shapes as
    `merge_partials`: (B, H, L, Dv) outputs, (B, H, L) log-sum-exps."""
    finite = torch.isfinite(lse)
    w = torch.where(finite, torch.exp(lse_part - torch.where(finite, lse, 0)), 0)  # (B, H, L)
    return w[..., None] * dout, w * ((dout * (out_part - out)).sum(-1) + dlse)


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Attention sinks: one more logit per head in every row's softmax denominator, with
    no value (GPT-OSS's `s_aux`).

    It is a merge (`merge_partials`) with a part of no value whose log-sum-exp is the
    sink: the real keys keep the share `exp(lse - lse')`, `lse' = logaddexp(lse, sink)`.
    `out` (B, H, L, Dv), `lse` (B, H, L), `sinks` (H,) finite. A row that sees no key
    gives 0 and lse' = its sink. Gradients reach `sinks` and, through `lse`, q and k.
    """
    sink = sinks.to(lse.dtype).view(1, -1, 1)  # (1, H, 1)
    total = torch.logaddexp(lse, sink)  # (B, H, L), finite: the sink is
    keep = torch.exp(lse - total)  # (B, H, L); 0 where lse = -inf
    return (out.to(keep.dtype) * keep.unsqueeze(-1)).to(out.dtype), total


def merge_in_place(
    out: Tensor, lse: Tensor, old_out: Tensor, old_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """`merge_partials` of a new part (out, lse) with a running one (old_out, old_lse),
    written into `out`: both weighted by their share of the summed exponentials. Shapes
    (..., L, Dv) and (..., L); returns `out` and the merged lse."""
    new_lse = torch.logaddexp(old_lse, lse)  # (..., L)
    out.mul_((lse - new_lse).exp_()[..., None])
    out.addcmul_(old_out, (old_lse - new_lse).exp_()[..., None])
    return out, new_lse


def with_lse_gradient(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, dlse: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Fold d(lse) into the op's backward with one extra feature.

    The op forms dS = P∘(dP - Δ), Δ = rowsum(dO∘O); the log-sum-exp adds P∘dlse. A value
    column of ones with dO = dlse and O = 0 in that column adds dlse to dP and nothing
    to Δ. q and k get a zero column so every head dim stays equal (the op needs that).
    """
    ones, zeros = (f(*v.shape[:-1], 1) for f in (v.new_ones, v.new_zeros))

    def pad(t: Tensor, extra: Tensor) -> Tensor:
        return torch.cat([t, extra.expand(*t.shape[:-1], 1)], dim=-1)

    return (
        pad(q, zeros[:1, :1, :1]),
        pad(k, zeros),
        pad(v, ones),
        pad(out, zeros[:1, :1, :1]),
        pad(dout, dlse[..., None]),
    )
