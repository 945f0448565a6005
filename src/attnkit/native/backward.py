"""The span kernel's backward as a Python call, and the forward op's gradient.

`span_backward(q, k, v, out, dout, lse, visible, scale, ...)` is
`torch.ops.attnkit_native.span_backward` (span_backward.cpp): dq, dk, dv of the span
call from its saved output and log-sum-exp, with no forward recomputed as a graph; `glse`
the gradient reaching lse, if any. Deterministic: two passes with no atomics (the same
inputs give the same bits), dk and dv summed over a K/V head's G query heads in a fixed
order; softcap's derivative included, ALiBi's slopes constants. `register_autograd` gives
`span_forward` this gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.native.ops import AlibiTerms, RowIntervals, _check, _unit_last

__all__ = ["backward_blocking", "register_autograd", "span_backward"]

# A tile's stacked rows (G heads × R query rows) and a block's keys: P and dS of one tile
# against one block (M × KB floats each) stay in the L2 cache of a core.
STACKED_ROWS, KEY_BLOCK = 128, 128


def backward_blocking(L: int, groups: int) -> tuple[int, int]:
    """(rows, keys): query rows of a tile and keys of a block for L queries of `groups`
    heads per K/V head."""
    return min(max(L, 1), max(STACKED_ROWS // groups, 8)), KEY_BLOCK


def span_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    dout: Tensor,
    lse: Tensor,
    visible: RowIntervals | None,
    scale: float,
    glse: Tensor | None = None,
    softcap: float = 0.0,
    bias: AlibiTerms | None = None,
    *,
    half: bool = False,
    amx: bool = False,
    rest: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (q's, k's, v's shapes, in q's dtype) of the span call whose output is
    `out` (B, H, L, Dv; in q's dtype, or float32 as the forward computed it: then Δ =
    dO·O from it, else Σ P·dP for half inputs) and log-sum-exp `lse` (B, H, L) float32,
    given `dout` (out's shape) and `glse` (lse's, or None); `visible` None: every row
    saw every key; `softcap` and `bias` (`ops.alibi_terms`) as the forward had them;
    `half`: bfloat16 blocks multiplied on the half units (`ops.span_forward`'s); `amx`
    (with `half`): the products of at least `ops.TILE_ROWS` stacked rows on AMX's tiles
    where the CPU has them; `rest` (lse's shape) what the span forward's rounding of lse
    to float32 left out (its op's third output), so that the weights stay exact where
    |lse| is large: given, lse is this call's own, and a decoding step's few rows take
    their weights normalised by the backward's own scores (their forward scored through
    the BLAS); None (an lse from elsewhere, a context-parallel piece's): 0."""
    _check(q, k, v, float(scale), float(softcap))
    B, H, L, _ = q.shape
    shape = (B, H, L, v.shape[3])
    if out.shape != shape or dout.shape != shape or dout.dtype != q.dtype:
        raise ValueError(f"out and dout must be {shape} in {q.dtype} (out also float32).")
    if out.dtype not in (q.dtype, torch.float32):
        raise ValueError(f"out must be in {q.dtype} or float32 (got {out.dtype}).")
    for name, t in (("lse", lse), ("glse", glse), ("rest", rest)):
        if t is not None and (t.shape != (B, H, L) or t.dtype != torch.float32):
            raise ValueError(f"{name} must be ({B}, {H}, {L}) float32 (got {tuple(t.shape)}).")
    if visible is not None and (visible.lo.shape != (B, L) or visible.S != k.shape[2]):
        raise ValueError(
            f"visible must be ops.row_intervals(lo, hi, B={B}, L={L}, S={k.shape[2]})."
        )
    if bias is not None and (bias.slopes.shape != (B, L, H) or bias.positions.shape != (B, L)):
        raise ValueError(
            f"bias must be ops.alibi_terms(slopes, positions, B={B}, L={L}, H={H}, S)."
        )
    rows, keys = backward_blocking(L, H // k.shape[1])
    lo, hi = (None, None) if visible is None else (visible.lo, visible.hi)
    slopes, positions = (None, None) if bias is None else (bias.slopes, bias.positions)
    half = half and q.dtype == torch.bfloat16
    grads: tuple[Tensor, Tensor, Tensor] = torch.ops.attnkit_native.span_backward(
        _unit_last(q),
        _unit_last(k),
        _unit_last(v),
        _unit_last(out),
        _unit_last(dout),
        lse.contiguous(),
        None if glse is None else glse.contiguous(),
        lo,
        hi,
        slopes,
        positions,
        float(scale),
        float(softcap),
        rows,
        keys,
        half,
        half and amx,
        None if rest is None else rest.contiguous(),
    )
    return grads


def _fake(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape)


def _setup_context(
    ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]
) -> None:
    q, k, v, lo, hi, slopes, positions, scale, softcap = inputs[:9]
    ctx.scale, ctx.softcap = scale, softcap
    ctx.half, ctx.amx = inputs[11], inputs[12]  # (after rows, keys; then float_out)
    ctx.save_for_backward(q, k, v, lo, hi, slopes, positions, *output)
    ctx.mark_non_differentiable(output[2])  # lse's rest: the backward's, no gradient to take


def _backward(ctx: Any, dout: Tensor, glse: Tensor | None, _: Any) -> tuple[Any, ...]:
    q, k, v, lo, hi, slopes, positions, out, lse, rest = ctx.saved_tensors
    visible = None if lo is None else RowIntervals(lo, hi, k.shape[2])
    bias = None if slopes is None else AlibiTerms(slopes, positions)
    grads = span_backward(
        q,
        k,
        v,
        out,
        dout.to(q.dtype),
        lse,
        visible,
        ctx.scale,
        glse,
        ctx.softcap,
        bias,
        half=ctx.half,
        amx=ctx.amx,
        rest=rest,
    )
    return *grads, *([None] * 11)


def register_autograd() -> None:
    """The backward op's shapes for tracing, and `span_forward`'s gradient (once, after
    the library is loaded)."""
    torch.library.register_fake("attnkit_native::span_backward", _fake)
    torch.library.register_autograd(
        "attnkit_native::span_forward", _backward, setup_context=_setup_context
    )
