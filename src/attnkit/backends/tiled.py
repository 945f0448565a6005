"""Backend `tiled`: block-sparse attention over the key spans each query tile may see.

`tileplan` cuts the problem into blocks (query rows × one key span) from the mask's
structure alone. Each block runs through PyTorch's CPU flash-attention op with a
tile-local mask where it is not fully visible: for masks that are one key interval per
row (exact `Mask.key_spans`) that mask comes from two (B, L) tensors, otherwise from the
predicate on the block only. No L×S tensor is built. Blocks run in chunks of bounded
memory; query and key windows are strided views where they are evenly spaced.

Each query row lies in one block, so the kernel's log-sum-exp is the row's log-sum-exp,
except in causal runs: their rows take a causal square and then a rectangle of earlier
keys (the run's offset, or the earlier rows of a long run cut into bands), whose result
merges into theirs by log-sum-exp. The backward pass reruns the op's backward per block
with the global output and log-sum-exp, which makes the block gradients sum to the exact
gradient (as ring attention does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from attnkit._compat import apply, cpu_flash_attention, cpu_flash_attention_backward
from attnkit.backends import tilecost
from attnkit.backends.protocol import Backend, Block, Probe, Work
from attnkit.backends.tilemask import Visibility
from attnkit.backends.tileplan import BAND_MIN, GRANULE, BlockGroup, TilePlan, best_plan
from attnkit.call.precision import HalfKernels, compute_dtype
from attnkit.call.visibility import SeenRowsKeys, seen_rows_keys, zero_unseen
from attnkit.contracts import AttentionCall, unit_last_stride
from attnkit.masks.spans import exact_spans
from attnkit.masks.structure import has_dense_tensor, is_sdpa_causal
from attnkit.softmax import merge_in_place, with_lse_gradient

__all__ = ["CHUNK_BYTES", "FORWARD_CHUNK_BYTES", "TiledBackend"]

CHUNK_BYTES = 2 << 20  # temporaries of one backward call: block rows, gradients, masks
# ... of one forward call: fewer, larger calls run 4-8% faster (sliding window and
# documents, S=4096 fp32, 2 vs 32 MiB, round-robin; benchmarks/tile_levers.py's "one
# call"); the backward's larger gradients do not gain
FORWARD_CHUNK_BYTES = 32 << 20
BACKWARD_KEYS = 1024  # the backward cuts key spans to this width (its key gradients)


def _windows(x: Tensor, starts: tuple[int, ...], step: int | None, size: int) -> Tensor | None:
    """x (heads, T, ...) -> (n, heads, size, ...) windows x[:, s : s + size] as one view.

    None where the starts are not evenly spaced or a window runs past the end.
    """
    if step is None or starts[-1] + size > x.shape[1]:
        return None
    stride = x.stride()
    return x.as_strided(
        (len(starts), x.shape[0], size, *x.shape[2:]),
        (step * stride[1], stride[0], stride[1], *stride[2:]),
        x.storage_offset() + starts[0] * stride[1],
    )


def _block_rows(x: Tensor, g: BlockGroup, Hkv: int) -> Tensor:
    """Batch row `x` (H, L, ...) -> (n, Hkv, G·R, ...): the G heads of a K/V head stacked."""
    if x.shape[0] == Hkv and (view := _windows(x, g.row0, g.row_step, g.rows)) is not None:
        return view
    rows = g.index("rows").clamp(max=x.shape[1] - 1).reshape(-1).to(x.device)
    n, R = g.size, g.rows
    x = x.reshape(Hkv, x.shape[0] // Hkv, *x.shape[1:])[:, :, rows]  # (Hkv, G, n·R, ...)
    x = x.reshape(Hkv, x.shape[1], n, R, *x.shape[3:]).movedim(2, 0)  # (n, Hkv, G, R, ...)
    return x.reshape(n, Hkv, -1, *x.shape[4:])


def _write_rows(dst: Tensor, src: Tensor, g: BlockGroup, Hkv: int, *, add: bool = False) -> None:
    """Write (or `add`) block rows `src` (n, Hkv, G·R, ...) into batch row `dst` (H, L, ...)."""
    if dst.shape[0] == Hkv and (view := _windows(dst, g.row0, g.row_step, g.rows)) is not None:
        view.add_(src) if add else view.copy_(src)  # blocks never share a row: no overlap
        return
    rows = g.index("rows").reshape(-1).to(dst.device)
    valid, src = rows < dst.shape[1], src.to(dst.dtype)
    n, R, G = g.size, g.rows, dst.shape[0] // Hkv
    src = src.reshape(n, Hkv, G, R, *src.shape[3:]).movedim(0, 2)  # (Hkv, G, n, R, ...)
    src = src.reshape(Hkv, G, n * R, *src.shape[4:])[:, :, valid]
    target = dst.view(Hkv, G, *dst.shape[1:]).movedim(2, 0)  # (L, Hkv, G, ...), a view
    target.index_put_((rows[valid],), src.movedim(2, 0), accumulate=add)


def _block_keys(x: Tensor, g: BlockGroup) -> Tensor:
    """Batch row `x` (Hkv, S, D) -> (n, Hkv, K, D) key windows, as a view when strided."""
    view = _windows(x, g.key0, g.key_step, g.keys)
    if view is not None:
        return view
    keys = g.index("keys").reshape(-1).to(x.device)
    return x[:, keys].view(x.shape[0], g.size, g.keys, -1).transpose(0, 1)


def _chunk_blocks(g: BlockGroup, H: int, Hkv: int, D: int, bias: bool, budget: int) -> int:
    """How many blocks of `g` one kernel call takes so its temporaries stay near `budget`
    bytes."""
    per_block = H * g.rows * (3 * D + 2) + (H if bias else H // Hkv) * g.rows * g.keys
    if g.key_step is None:
        per_block += 2 * Hkv * g.keys * D
    return max(1, budget // (4 * per_block))


def _calls(
    group: BlockGroup, H: int, Hkv: int, D: int, bias: bool, budget: int
) -> Iterator[tuple[BlockGroup, Callable[[Tensor], Tensor]]]:
    """Each kernel call of `group`: a chunk of its blocks, and the query heads it takes.

    `heads` maps a batch row (H, L, ...) to the heads of the call: all of them, or for a
    causal run with GQA one query head per K/V head at a time (stacking G heads as rows
    would break `is_causal`, which counts rows from the block's corner).
    """
    G = H // Hkv
    if group.causal and G > 1:
        per_head = [_head_picker(Hkv, G, i) for i in range(G)]
    else:
        per_head = [_all_heads]
    for g in group.chunks(_chunk_blocks(group, H, Hkv, D, bias, budget)):
        for heads in per_head:
            yield g, heads


def _all_heads(x: Tensor) -> Tensor:
    return x


def _head_picker(Hkv: int, G: int, i: int) -> Callable[[Tensor], Tensor]:
    """x (H, L, ...) -> (Hkv, L, ...): query head i of each K/V head's group, a view."""
    return lambda x: x.view(Hkv, G, *x.shape[1:])[:, i]


def _band_rows(heads: int, Dv: int) -> int:
    """Query rows per forward band of a causal run: as many as fit one call's output,
    log-sum-exp and merge in CHUNK_BYTES, but at least `BAND_MIN` (below that the op
    splits queries finer and runs slower). Whole, a long run's output would be a second
    copy of its rows while it is written into place."""
    rows = CHUNK_BYTES // (4 * heads * (3 * Dv + 2))
    return max(BAND_MIN, rows // GRANULE * GRANULE)


def _merged(
    out: Tensor, lse: Tensor, ob: Tensor, lb: Tensor, g: BlockGroup, Hkv: int
) -> tuple[Tensor, Tensor]:
    """Block result (ob, lb) merged with the partial result in its rows of (out, lse):
    both weighted by their share of the summed exponentials (ob is overwritten)."""
    return merge_in_place(ob, lb, _block_rows(out, g, Hkv), _block_rows(lse, g, Hkv))


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        vis: Visibility,
        plan: TilePlan,
        scale: float,
        rows_keys: SeenRowsKeys | None,
    ) -> tuple[Tensor, Tensor]:
        B, H, L, D = q.shape
        Hkv = k.shape[1]
        flash = cpu_flash_attention()
        assert flash is not None
        if rows_keys is not None:  # (B, 1, L) rows and (B, 1, S) keys anybody sees
            q, k, v = zero_unseen(q, k, v, *rows_keys)
        # results merge and land in float32 (compute_dtype) whatever the kernel's dtype
        acc = q.new_empty(0, dtype=compute_dtype(q.dtype))
        if plan.covered == B * L:  # every row is written by some block
            out, lse = acc.new_empty(B, H, L, v.shape[-1]), acc.new_empty(B, H, L)
        else:
            out, lse = acc.new_zeros(B, H, L, v.shape[-1]), acc.new_full((B, H, L), -torch.inf)
        bands = (part for g in plan.groups for part in g.bands(_band_rows(Hkv, v.shape[-1])))
        for group in bands:
            b, masks = group.batch, vis.masks(group, H // Hkv, q.dtype)  # None if causal
            calls = _calls(group, H, Hkv, D, vis.bias is not None, FORWARD_CHUNK_BYTES)
            for g, heads in calls:
                ob, lb = flash(
                    _block_rows(heads(q[b]), g, Hkv),
                    _block_keys(k[b], g),
                    _block_keys(v[b], g),
                    0.0,
                    g.causal,
                    attn_mask=masks(g),
                    scale=scale,
                )  # (n, Hkv, G·R, Dv), (n, Hkv, G·R)
                if g.merge:
                    ob, lb = _merged(heads(out[b]), heads(lse[b]), ob.to(out.dtype), lb, g, Hkv)
                _write_rows(heads(out[b]), ob, g, Hkv)
                _write_rows(heads(lse[b]), lb, g, Hkv)
                del ob, lb  # freed before the next call allocates its output
        if rows_keys is not None:  # the op gives 0 on empty rows
            lse.masked_fill_(~rows_keys[0], -torch.inf)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.vis, ctx.plan, ctx.scale = vis, plan, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        grads = _blocks_backward(q, k, v, out, lse, dout, dlse, ctx.vis, ctx.plan, ctx.scale)
        return (*grads, None, None, None, None)


def _blocks_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor | None,
    dlse: Tensor | None,
    vis: Visibility,
    plan: TilePlan,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv block by block from the global output and log-sum-exp (q, k, v with
    unseen rows and keys zeroed, in the kernel's dtype)."""
    # block gradients sum in float32 (compute_dtype) whatever the kernel's dtype
    dq, dk, dv = (torch.zeros_like(t, dtype=compute_dtype(t.dtype)) for t in (q, k, v))
    if dout is None and dlse is None:
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    out = out.to(q.dtype)  # the op's dtype
    dout = torch.zeros_like(out) if dout is None else unit_last_stride(dout.to(q.dtype))
    H, D, Hkv = q.shape[1], q.shape[-1], k.shape[1]
    backward_op = cpu_flash_attention_backward()
    assert backward_op is not None
    safe_lse = torch.where(torch.isfinite(lse), lse, 0.0)  # masked scores stay -inf
    # with the global out and lse, the blocks' key spans may be cut: smaller gradients
    pieces = (part for g in plan.groups for part in g.pieces(BACKWARD_KEYS))
    for group in pieces:
        b, masks = group.batch, vis.masks(group, H // Hkv, q.dtype)
        for g, heads in _calls(group, H, Hkv, D, vis.bias is not None, CHUNK_BYTES):
            kb, vb = _block_keys(k[b], g), _block_keys(v[b], g)
            qb, go, ob, lb = (_block_rows(heads(t[b]), g, Hkv) for t in (q, dout, out, safe_lse))
            if dlse is not None:
                lse_grad = _block_rows(heads(dlse[b]), g, Hkv).to(q.dtype)
                qb, kb, vb, ob, go = with_lse_gradient(qb, kb, vb, ob, go, lse_grad)
            gq, gk, gv = backward_op(
                go, qb, kb, vb, ob, lb, 0.0, g.causal, attn_mask=masks(g), scale=scale
            )
            _write_rows(heads(dq[b]), gq[..., :D], g, Hkv, add=True)
            keys = g.index("keys").reshape(-1).to(q.device)
            for grad, part in ((dk, gk[..., :D]), (dv, gv[..., : v.shape[-1]])):
                flat = part.transpose(0, 1).reshape(Hkv, -1, part.shape[-1])  # (Hkv, n·K, D)
                grad[b].index_add_(1, keys, flat.to(grad.dtype))
            del gq, gk, gv  # freed before the next call allocates its gradients
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class TiledBackend(Backend):
    """Block-sparse: runs the fused kernel only on the key spans each query tile may see."""

    name = "tiled"
    cost_factors = tilecost.FACTORS

    def __init__(self, half: HalfKernels) -> None:
        self.half = half  # the runtime's: what half inputs compute in

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None:
        if call.q.device.type != "cpu" or cpu_flash_attention_backward() is None:
            return f"needs PyTorch's CPU flash kernel; not available on {call.q.device.type}"
        if call.bias_tensor is not None:
            return "an additive float bias tensor has no structure to tile (use alibi() etc.)"
        if call.softcap is not None or call.dropout_p > 0:
            return "the flash kernel it calls has no softcap or dropout"
        if call.dims.D != call.dims.Dv:
            return f"the flash kernel needs D == Dv (got D={call.dims.D}, Dv={call.dims.Dv})"
        if call.mask is not None and call.mask.head_dependent:
            return "the mask differs between heads"
        return None

    def plan(self, call: AttentionCall) -> TilePlan:
        """The tile plan of a call: made once per prepared call, for cost and run."""
        d = call.dims
        return call.plan_values.get(
            "tiled.plan",
            lambda: best_plan(call.mask, d.B, d.H, d.Hkv, d.L, d.S, self.factors(call.table)),
        )

    def notes(self, call: AttentionCall) -> list[str]:
        tiles, d = self.plan(call), call.dims
        runs = sum(g.size for g in tiles.groups if g.causal)
        share = tiles.area / (d.B * d.L * d.S)
        return [
            f"tiled: {tiles.calls} block group(s), tiles of {tiles.tile} rows, {runs} causal"
            f" run(s) whole; {share:.1%} of the L×S pairs computed"
        ]

    def work(self, call: AttentionCall) -> Work:
        tiles = self.plan(call)
        blocks = tuple(
            Block(g.batch, r0, g.rows, k0, g.keys, g.causal)
            for g in tiles.groups
            for r0, k0 in zip(g.row0, g.key0, strict=True)
        )
        return Work(blocks, tiles.calls, tiles.tile)

    def cost(self, call: AttentionCall, *, need_lse: bool) -> float:
        d, mask = call.dims, call.mask
        estimate = self.plan(call).cost(d.H, d.groups, self.factors(call.table))
        if mask is not None and has_dense_tensor(mask) and exact_spans(mask, d.B, d.L, d.S) is None:
            estimate *= self.factors(call.table)[
                "predicate"
            ]  # block masks gathered from an L×S tensor
        return estimate

    def calibrate(self, probe: Probe) -> dict[str, float]:
        return tilecost.calibrate(self, probe)

    def cost_floor(self, call: AttentionCall) -> float:
        """A lower bound on any plan's cost, in O(1): one group of blocks, plus the pairs
        every plan computes (a dense call's L·S per head, SDPA's causal mask's at least
        L·S/2) at tiled's lowest per-pair cost. The planner skips planning (ms for a long
        cache or a long causal prefill) where another backend's whole call costs no more."""
        d, mask = call.dims, call.mask
        causal = mask is not None and not call.has_bias and is_sdpa_causal(mask, d.L, d.S)
        pairs = d.B * d.H * d.L * d.S * (1.0 if call.is_dense else 0.5 if causal else 0.0)
        factors = self.factors(call.table)
        return factors["call"] + min(factors["pair"], factors["causal"]) * pairs

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int:
        """Output and log-sum-exp, plus one chunk's temporaries (float32)."""
        d = call.dims
        return 4 * d.B * d.H * d.L * (d.Dv + 1) + FORWARD_CHUNK_BYTES

    def _visibility(self, call: AttentionCall) -> tuple[Visibility, TilePlan, SeenRowsKeys | None]:
        """The plan's block masks, the plan, and the (B, 1, L) rows and (B, 1, S) keys
        anybody sees (`visibility.seen`: where the mask has no exact spans, from the
        plan's blocks alone; None without a mask), all made once per prepared call."""
        d, plan = call.dims, self.plan(call)
        vis = call.plan_values.get(
            "tiled.visibility", lambda: Visibility(call.mask, (d.B, d.H, d.L, d.S), call.q.device)
        )

        def from_blocks() -> SeenRowsKeys:
            bias = vis.bias is not None
            return vis.find_seen(
                plan, lambda g: _chunk_blocks(g, d.H, d.Hkv, d.D, bias, CHUNK_BYTES)
            )

        return vis, plan, seen_rows_keys(call, None if vis.spans is not None else from_blocks)

    def run(self, call: AttentionCall, *, need_lse: bool) -> tuple[Tensor, Tensor | None]:
        kernel_dtype = self.half.kernel_dtype(call.q.dtype, call.q.device, bias=call.has_bias)
        q, k, v = call.q.to(kernel_dtype), call.k.to(kernel_dtype), call.v.to(kernel_dtype)
        vis, plan, rows_keys = self._visibility(call)
        out, lse = apply(_TiledAttention, q, k, v, vis, plan, call.scale, rows_keys)
        return out.to(call.q.dtype), lse if need_lse else None

    def serves_backward(self, call: AttentionCall) -> bool:
        return self.can_use(call, need_lse=True) is None

    def backward(
        self, call: AttentionCall, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of q, k, v of a call (as `normalize_call` made them) from its output
        and log-sum-exp, whichever backend computed them (the math is one): for the
        compiled backward op, which then needs no second forward pass."""
        kernel_dtype = self.half.kernel_dtype(call.q.dtype, call.q.device, bias=call.has_bias)
        q, k, v = call.q.to(kernel_dtype), call.k.to(kernel_dtype), call.v.to(kernel_dtype)
        vis, plan, rows_keys = self._visibility(call)
        if rows_keys is not None:
            q, k, v = zero_unseen(q, k, v, *rows_keys)
        grads = _blocks_backward(q, k, v, out, lse, dout, dlse, vis, plan, call.scale)
        dq, dk, dv = grads
        return dq.to(call.q.dtype), dk.to(call.k.dtype), dv.to(call.v.dtype)
