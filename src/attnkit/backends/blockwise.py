"""Backend `blockwise`: the reference's math in blocks of query rows, in bounded memory.

What the fused kernels cannot take (softcap, a bias with softcap, a mask that differs
between heads with D != Dv, dropout with a mask) `reference` serves by building the
whole (B, H, L, S) score tensor. Here each block of query rows computes its scores only
over the span of keys it may see (`masks.structure.key_bounds`), so memory is
O(rows · S) and masked-out key blocks cost nothing; every block runs under activation
checkpointing, so the backward pass recomputes one block at a time instead of keeping
L×S weights. The
result is exact and the log-sum-exp carries its gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from attnkit.backends.protocol import Backend, Probe
from attnkit.call import cost
from attnkit.call.precision import compute_dtype
from attnkit.call.visibility import effective_visibility, zero_unseen_of_call
from attnkit.contracts import AttentionCall
from attnkit.masks import causal
from attnkit.masks.structure import key_bounds
from attnkit.reference import weighted_values, weights_and_lse

__all__ = ["BlockwiseBackend"]

BLOCK_BYTES = 1 << 25  # one block's float32 scores (B, H, R, K): the memory bound
MIN_ROWS = 16


class BlockwiseBackend(Backend):
    """Serves every call on any device, like `reference`, without an L×S tensor."""

    name = "blockwise"
    values_exact = True
    # per pair: the reference's math over key spans; `call` per block: its Python and
    # operators, the mask's spans and the checkpoint (more than the reference's whole
    # call: `attnkit calibrate` times it on a tiny call, one block); `backward`:
    # forward+backward over forward, taken as tiled's (the same autograd ops)
    cost_factors = cost.Factors(
        {"pair": 4.0, "call": 320_000.0, "backward": 3.7}, {"amx": {"pair": 4.36}}
    )

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None:
        return None

    def cost(self, call: AttentionCall, *, need_lse: bool) -> float:
        d = call.dims
        rows = _rows(call)
        first, last, lo, hi = _block_bounds(call, rows)  # (T,) each
        pairs = int(((hi - lo).clamp(min=0) * (last + 1 - first)).sum())
        factors = self.factors(call.table)
        return factors["pair"] * d.B * d.H * pairs + factors["call"] * _block_count(call)

    def cost_floor(self, call: AttentionCall) -> float:
        """At least one block's call, and a dense call's every pair: the planner prices
        no further below that."""
        d, factors = call.dims, self.factors(call.table)
        dense = factors["pair"] * d.B * d.H * d.L * d.S if call.is_dense else 0.0
        return factors["call"] + dense

    def calibrate(self, probe: Probe) -> dict[str, float]:
        """Per block from a tiny causal call (one block), net of its pairs; per pair from
        a small one, net of its blocks."""
        return self.timed_call_and_pair(probe, causal(), _block_count)

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int:
        d = call.dims
        return 3 * d.B * d.H * _rows(call) * d.S * 4  # scores, their exp, the weights

    def run(self, call: AttentionCall, *, need_lse: bool) -> tuple[Tensor, Tensor | None]:
        d = call.dims
        q, k, v = zero_unseen_of_call(call)
        work = compute_dtype(q.dtype)
        outs, lses = [], []
        for r0, r1, lo, hi in _blocks(call, _rows(call)):
            if hi <= lo:  # no row of the block sees a key: zeros, lse -inf
                outs.append(q.new_zeros(d.B, d.H, r1 - r0, d.Dv))
                lses.append(q.new_full((d.B, d.H, r1 - r0), -torch.inf, dtype=work))
                continue
            block = _Block(call, r0, r1, lo, hi)
            qb, kb, vb = q[:, :, r0:r1], k[:, :, lo:hi], v[:, :, lo:hi]
            if torch.is_grad_enabled() and any(t.requires_grad for t in (qb, kb, vb)):
                out, lse = checkpoint(block, qb, kb, vb, use_reentrant=False)
            else:
                out, lse = block(qb, kb, vb)
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs, 2), torch.cat(lses, 2) if need_lse else None


class _Block:
    """One block: query rows [r0, r1) over keys [lo, hi), the reference's loop."""

    def __init__(self, call: AttentionCall, r0: int, r1: int, lo: int, hi: int) -> None:
        self.call, self.r0, self.r1, self.lo, self.hi = call, r0, r1, lo, hi

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        call, d = self.call, self.call.dims
        rows = torch.arange(self.r0, self.r1, device=q.device)
        cols = torch.arange(self.lo, self.hi, device=q.device)
        visible = None
        if call.mask is not None:  # (B|1, H|1, R, K)
            visible = call.mask.dense(d.B, d.H, d.L, d.S, q.device, rows=rows, cols=cols)
        bias = call.bias_rows(rows)  # (B|1, H|1, R|1, S|1)
        if bias is not None and bias.shape[-1] > 1:
            bias = bias[..., self.lo : self.hi]
        weights, lse = weights_and_lse(q, k, visible, bias, scale=call.scale, softcap=call.softcap)
        if call.dropout_p > 0:  # checkpoint replays the RNG: the backward sees the same mask
            weights = F.dropout(weights, call.dropout_p)
        out = weighted_values(weights, v, effective_visibility(visible, bias))  # (B, H, R, Dv)
        return out.to(q.dtype), lse


def _block_count(call: AttentionCall) -> int:
    """The blocks of query rows a call runs (`call` is priced per block)."""
    return math.ceil(call.dims.L / _rows(call))


def _rows(call: AttentionCall) -> int:
    """Query rows a block holds: its (B, H, rows, S) float32 scores fit `BLOCK_BYTES`."""
    d = call.dims
    rows = BLOCK_BYTES // max(1, 4 * d.B * d.H * d.S)
    return max(MIN_ROWS, min(d.L, rows))


def _blocks(call: AttentionCall, rows: int) -> list[tuple[int, int, int, int]]:
    """(r0, r1, lo, hi) of each block: its rows and the keys any batch row's may see."""
    bounds = (t.tolist() for t in _block_bounds(call, rows))
    return [(f, t + 1, a, b) for f, t, a, b in zip(*bounds, strict=True)]


def _block_bounds(call: AttentionCall, rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each block's first and last row and the keys [lo, hi) any batch row's may see,
    (T,) each: tensors, so pricing a call of any length walks no block in Python."""
    d = call.dims
    first = torch.arange(0, d.L, rows)
    last = (first + rows).clamp(max=d.L) - 1
    if call.mask is None:
        return first, last, torch.zeros_like(first), torch.full_like(first, d.S)
    lo_b, hi_b = key_bounds(call.mask, d.B, d.L, d.S, first, last)  # (B|1, T)
    return first, last, lo_b.amin(0), hi_b.amax(0)
