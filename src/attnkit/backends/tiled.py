"""Backend `tiled`: block-sparse attention over the key spans each query tile may see.

The mask's structure (`Mask.key_bounds`) gives, for every tile of `TILE` query rows and
every batch row, one span of keys `[lo, hi)` that holds all keys the tile may see; no
L×S tensor is built. Spans are rounded to `GRANULE` keys, consecutive tiles with the
same span merge into one block, and blocks of one shape run as ONE fused kernel call
(the CPU flash-attention op), with a tile-local mask where a block is not fully visible.
Each query row lies in exactly one block, so the kernel's log-sum-exp is the row's
log-sum-exp. The backward pass reruns the op's backward per block with the global
output and log-sum-exp, which makes the block gradients sum to the exact gradient
(as ring attention does).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnkit import cost
from attnkit._compat import cpu_flash_attention, cpu_flash_attention_backward
from attnkit.contracts import AttentionCall
from attnkit.masks import Mask
from attnkit.softmax import compute_dtype

__all__ = ["TILE", "TilePlan", "TiledBackend", "plan_tiles"]

TILE = 128  # query rows per tile
GRANULE = 64  # key spans start and end on multiples of this
MAX_GROUPS = 12  # more distinct block shapes than this get bucketed


@dataclass(frozen=True)
class Group:
    """`n` blocks of one batch row, each `rows` queries × `keys` keys: one kernel call."""

    batch: int
    row0: Tensor  # (n,) first query row of each block
    key0: Tensor  # (n,) first key of each block
    rows: int
    keys: int

    @property
    def key_step(self) -> int | None:
        """Block i's keys start at key0[0] + i·step: a strided view, no copy. Else None."""
        steps = self.key0.diff()
        if steps.numel() == 0:
            return 0
        step = int(steps[0])
        return step if step >= 0 and bool((steps == step).all()) else None


@dataclass(frozen=True)
class TilePlan:
    groups: tuple[Group, ...]
    area: int  # query-key pairs computed per head, over the batch

    @property
    def calls(self) -> int:
        return len(self.groups)


def _bucket(length: Tensor) -> Tensor:
    """Round lengths up to {1, 1.5} × 2^k granules so few distinct shapes remain."""
    granules = (length.double() / GRANULE).clamp(min=1)
    base = torch.exp2(torch.floor(torch.log2(granules)))
    up = torch.where(
        granules <= base, base, torch.where(granules <= 1.5 * base, 1.5 * base, 2 * base)
    )
    return (up * GRANULE).long()


def plan_tiles(mask: Mask | None, B: int, L: int, S: int, tile: int = TILE) -> TilePlan:
    """Blocks of (batch row, query rows, key span) covering every visible pair."""
    n_tiles = math.ceil(L / tile)
    first = torch.arange(n_tiles) * tile
    last = (first + tile).clamp(max=L) - 1
    if mask is None:
        lo, hi = torch.zeros(1, n_tiles, dtype=torch.long), torch.full((1, n_tiles), S)
    else:
        lo, hi = mask.key_bounds(B, L, S, first, last)
    lo, hi = lo.expand(B, n_tiles), hi.expand(B, n_tiles)
    lo = torch.div(lo, GRANULE, rounding_mode="floor") * GRANULE
    hi = torch.where(hi > lo, ((hi + GRANULE - 1) // GRANULE * GRANULE).clamp(max=S), lo)
    if torch.unique(hi - lo).numel() > MAX_GROUPS:
        width = torch.minimum(_bucket(hi - lo), torch.tensor(S))
        lo = torch.where(hi > lo, (hi - width).clamp(min=0), lo)
        hi = torch.where(hi > lo, (lo + width).clamp(max=S), hi)
    return _group(lo, hi, tile, L)


def _group(lo: Tensor, hi: Tensor, tile: int, L: int) -> TilePlan:
    """Merge runs of tiles with equal spans into blocks, then blocks by batch row and shape."""
    B, n_tiles = lo.shape
    blocks: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    area = 0
    for b in range(B):
        spans = list(zip(lo[b].tolist(), hi[b].tolist(), strict=True))
        t = 0
        while t < n_tiles:
            end = t + 1
            while end < n_tiles and spans[end] == spans[t]:
                end += 1
            start_key, stop_key = spans[t]
            if stop_key > start_key:
                rows = (end - t) * tile
                blocks.setdefault((b, rows, stop_key - start_key), []).append((t * tile, start_key))
                area += min(rows, L - t * tile) * (stop_key - start_key)
            t = end
    groups = tuple(
        Group(
            b,
            torch.tensor([m[0] for m in members]),
            torch.tensor([m[1] for m in members]),
            rows=rows,
            keys=keys,
        )
        for (b, rows, keys), members in sorted(blocks.items())
    )
    return TilePlan(groups=groups, area=area)


@dataclass
class _Block:
    """A group with its tile-local mask evaluated (n blocks of R rows × K keys)."""

    group: Group
    rows: Tensor  # (n·R,) query row of each block row, clamped to L - 1
    valid: Tensor  # (n·R,) the row exists (< L)
    keys: Tensor  # (n·K,) key of each block key
    seen: Tensor  # (n, R) the row sees some key of its block
    seen_keys: Tensor  # (n, K) some row of the block sees the key
    attn_mask: Tensor | None  # additive (n|1, 1, G·R, K); None where all is visible


def _prepare(
    mask: Mask | None,
    group: Group,
    dims: tuple[int, ...],
    G: int,
    dtype: torch.dtype,
    dev: torch.device,
) -> _Block:
    B, H, L, S = dims
    R, K = group.rows, group.keys
    rows = group.row0.to(dev)[:, None] + torch.arange(R, device=dev)  # (n, R)
    keys = group.key0.to(dev)[:, None] + torch.arange(K, device=dev)  # (n, K)
    valid = rows < L
    rows = rows.clamp(max=L - 1)
    visible = valid[:, :, None].expand(-1, -1, K)  # (n, R, K)
    if mask is not None:
        b = torch.tensor(group.batch, device=dev)
        h = torch.zeros((), dtype=torch.long, device=dev)
        predicate = mask.predicate(B, H, L, S, dev)
        visible = visible & predicate(b, h, rows[:, :, None], keys[:, None, :])
    seen, seen_keys = visible.any(-1), visible.any(-2)
    attn_mask = None
    if not bool(visible.all()):
        if bool((visible == visible[:1]).all()):
            visible = visible[:1]  # one pattern shared by every block (a sliding band)
        additive = torch.zeros(visible.shape, dtype=dtype, device=dev)
        additive = additive.masked_fill(~visible, -torch.inf)  # (n|1, R, K)
        attn_mask = additive[:, None].expand(-1, G, -1, -1).reshape(-1, 1, G * R, K)
    return _Block(
        group, rows.reshape(-1), valid.reshape(-1), keys.reshape(-1), seen, seen_keys, attn_mask
    )


def _hide_unseen(
    q: Tensor, k: Tensor, v: Tensor, blocks: list[_Block]
) -> tuple[Tensor, Tensor, Tensor]:
    """Zero query rows that see nothing and keys nobody sees (they may hold NaN or Inf)."""
    B, _, L, _ = q.shape
    seen_rows = torch.zeros(B, L, dtype=torch.bool, device=q.device)
    seen_keys = torch.zeros(B, k.shape[2], dtype=torch.bool, device=q.device)
    for blk in blocks:
        seen_rows[blk.group.batch, blk.rows[blk.seen.reshape(-1) & blk.valid]] = True
        seen_keys[blk.group.batch, blk.keys[blk.seen_keys.reshape(-1)]] = True
    if not bool(seen_rows.all()):
        q = torch.where(seen_rows[:, None, :, None], q, 0.0)
    if not bool(seen_keys.all()):
        k = torch.where(seen_keys[:, None, :, None], k, 0.0)
        v = torch.where(seen_keys[:, None, :, None], v, 0.0)
    return q, k, v


def _block_rows(x: Tensor, blk: _Block, Hkv: int) -> Tensor:
    """Batch row `x` (H, L, ...) -> (n, Hkv, G·R, ...): the G heads of a K/V head stacked."""
    n, R = blk.seen.shape
    x = x.reshape(Hkv, x.shape[0] // Hkv, *x.shape[1:])[:, :, blk.rows]  # (Hkv, G, n·R, ...)
    x = x.reshape(Hkv, x.shape[1], n, R, *x.shape[3:]).movedim(2, 0)  # (n, Hkv, G, R, ...)
    return x.reshape(n, Hkv, -1, *x.shape[4:])


def _scatter_rows(dst: Tensor, src: Tensor, blk: _Block, Hkv: int) -> None:
    """Write block rows `src` (n, Hkv, G·R, ...) into batch row `dst` (H, L, ...)."""
    n, R = blk.seen.shape
    G = dst.shape[0] // Hkv
    src = src.reshape(n, Hkv, G, R, *src.shape[3:]).movedim(0, 2)  # (Hkv, G, n, R, ...)
    src = src.reshape(Hkv, G, n * R, *src.shape[4:])[:, :, blk.valid]
    dst.view(Hkv, G, *dst.shape[1:])[:, :, blk.rows[blk.valid]] = src


def _key_blocks(x: Tensor, blk: _Block) -> Tensor:
    """Batch row `x` (Hkv, S, D) -> (n, Hkv, K, D) key windows, as a view when strided."""
    group = blk.group
    n, K = blk.seen_keys.shape
    step = group.key_step
    if step is not None:
        s_h, s_s, s_d = x.stride()
        return x.as_strided(
            (n, x.shape[0], K, x.shape[2]),
            (step * s_s, s_h, s_s, s_d),
            x.storage_offset() + int(group.key0[0]) * s_s,
        )
    return x[:, blk.keys].view(x.shape[0], n, K, -1).transpose(0, 1)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Mask | None,
        plan: TilePlan,
        scale: float,
    ) -> tuple[Tensor, Tensor]:
        B, H, L, _ = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        flash = cpu_flash_attention()
        assert flash is not None
        blocks = [_prepare(mask, g, (B, H, L, S), H // Hkv, q.dtype, q.device) for g in plan.groups]
        q, k, v = _hide_unseen(q, k, v, blocks)
        out = q.new_zeros(B, H, L, v.shape[-1])
        lse = q.new_full((B, H, L), -torch.inf)
        for blk in blocks:
            b = blk.group.batch
            ob, lb = flash(
                _block_rows(q[b], blk, Hkv),
                _key_blocks(k[b], blk),
                _key_blocks(v[b], blk),
                0.0,
                False,
                attn_mask=blk.attn_mask,
                scale=scale,
            )  # (n, Hkv, G·R, Dv), (n, Hkv, G·R)
            seen = blk.seen[:, None, None, :].expand(-1, Hkv, H // Hkv, -1).reshape(lb.shape)
            _scatter_rows(out[b], ob, blk, Hkv)
            _scatter_rows(lse[b], torch.where(seen, lb, -torch.inf), blk, Hkv)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale = blocks, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        if dout is None and dlse is None:
            return dq, dk, dv, None, None, None
        dout = torch.zeros_like(out) if dout is None else dout
        Hkv = k.shape[1]
        backward_op = cpu_flash_attention_backward()
        assert backward_op is not None
        safe_lse = torch.where(torch.isfinite(lse), lse, 0.0)  # masked scores stay -inf
        for blk in ctx.blocks:
            b = blk.group.batch
            qb, kb, vb = _block_rows(q[b], blk, Hkv), _key_blocks(k[b], blk), _key_blocks(v[b], blk)
            go, ob, lb = (_block_rows(t[b], blk, Hkv) for t in (dout, out, safe_lse))
            if dlse is not None:
                qb, kb, vb, ob, go = _with_lse_gradient(
                    qb, kb, vb, ob, go, _block_rows(dlse[b], blk, Hkv)
                )
            gq, gk, gv = backward_op(
                go, qb, kb, vb, ob, lb, 0.0, False, attn_mask=blk.attn_mask, scale=ctx.scale
            )
            _scatter_rows(dq[b], gq[..., : q.shape[-1]], blk, Hkv)
            for grad, g in ((dk, gk[..., : k.shape[-1]]), (dv, gv[..., : v.shape[-1]])):
                flat = g.transpose(0, 1).reshape(Hkv, -1, g.shape[-1])  # (Hkv, n·K, D)
                grad[b].index_add_(1, blk.keys, flat)
        return dq, dk, dv, None, None, None


def _with_lse_gradient(
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


class TiledBackend:
    """Block-sparse: runs the fused kernel only on the key spans each query tile may see."""

    name = "tiled"

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None:
        if call.q.device.type != "cpu" or cpu_flash_attention_backward() is None:
            return f"needs PyTorch's CPU flash kernel; not available on {call.q.device.type}"
        if call.bias is not None:
            return "an additive float bias has no structure to tile"
        if call.softcap is not None or call.dropout_p > 0:
            return "the flash kernel it calls has no softcap or dropout"
        if call.dims.D != call.dims.Dv:
            return f"the flash kernel needs D == Dv (got D={call.dims.D}, Dv={call.dims.Dv})"
        if call.mask is not None and call.mask.head_dependent:
            return "the mask differs between heads"
        return None

    def __init__(self) -> None:
        # the plan of the call `auto` just costed, which it then runs; a weak reference,
        # so the call's tensors are not kept alive
        self._last: tuple[weakref.ref[AttentionCall], TilePlan] | None = None

    def plan(self, call: AttentionCall) -> TilePlan:
        """The tile plan of a call (computed once for cost and run)."""
        if self._last is None or self._last[0]() is not call:
            d = call.dims
            self._last = (weakref.ref(call), plan_tiles(call.mask, d.B, d.L, d.S))
        return self._last[1]

    def cost(self, call: AttentionCall, *, need_lse: bool) -> float:
        plan = self.plan(call)
        return cost.TILED_PAIR * plan.area * call.dims.H + cost.TILED_CALL * plan.calls

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int:
        """Output and log-sum-exp, plus the largest group's copies and mask (float32)."""
        d = call.dims
        largest = 0
        for g in self.plan(call).groups:
            n = g.row0.shape[0]
            strided = g.key_step is not None
            copies = n * g.rows * d.H * (d.D + d.Dv) + (
                0 if strided else 2 * n * g.keys * d.Hkv * d.D
            )
            mask = (1 if strided else n) * d.groups * g.rows * g.keys
            largest = max(largest, copies + mask)
        return 4 * (d.B * d.H * d.L * (d.Dv + 1) + largest)

    def run(self, call: AttentionCall, *, need_lse: bool) -> tuple[Tensor, Tensor | None]:
        work = compute_dtype(call.q.dtype)
        q, k, v = call.q.to(work), call.k.to(work), call.v.to(work)
        out, lse = _TiledAttention.apply(  # type: ignore[no-untyped-call]
            q, k, v, call.mask, self.plan(call), call.scale
        )
        return out.to(call.q.dtype), lse if need_lse else None
