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
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnkit._compat import cpu_flash_attention, cpu_flash_attention_backward
from attnkit.contracts import AttentionCall
from attnkit.masks import Mask
from attnkit.softmax import compute_dtype

__all__ = ["TILE", "TiledBackend", "TilePlan", "plan_tiles"]

TILE = 64  # query rows per tile
GRANULE = 64  # key spans start and end on multiples of this
MAX_GROUPS = 12  # more distinct block shapes than this get bucketed


@dataclass(frozen=True)
class Group:
    """`n` blocks of `rows` query rows × `keys` keys, run as one kernel call."""

    batch: Tensor  # (n,) batch row of each block
    row0: Tensor  # (n,) first query row
    key0: Tensor  # (n,) first key
    rows: int
    keys: int


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
    power = torch.floor(torch.log2(granules))
    base = torch.exp2(power)
    up = torch.where(granules <= base, base, torch.where(granules <= 1.5 * base, 1.5 * base,
                                                         2 * base))
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
    """Merge runs of tiles with equal spans into blocks, then blocks by shape."""
    B, n_tiles = lo.shape
    blocks: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
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
                blocks.setdefault((rows, stop_key - start_key), []).append((b, t * tile, start_key))
                area += min(rows, L - t * tile) * (stop_key - start_key)
            t = end
    groups = tuple(
        Group(*(torch.tensor(col) for col in zip(*members, strict=True)), rows=rows, keys=keys)
        for (rows, keys), members in sorted(blocks.items())
    )
    return TilePlan(groups=groups, area=area)


@dataclass
class _Block:
    """A group's gathered inputs: (n, Hkv, G·R, D) queries against (n, Hkv, K, D) keys."""

    q: Tensor
    k: Tensor
    v: Tensor
    attn_mask: Tensor | None  # additive (n|1, 1, G·R, K), None where all is visible
    rows: Tensor  # (n, R) query row of each block row
    keys: Tensor  # (n, K) key index of each block key
    seen: Tensor  # (n, R) the row sees some key
    valid: Tensor  # (n, R) the row exists (< L)


def _gather(q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, group: Group) -> _Block:
    B, H, L, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G, R, K = H // Hkv, group.rows, group.keys
    dev = q.device
    rows = group.row0.to(dev)[:, None] + torch.arange(R, device=dev)  # (n, R)
    keys = group.key0.to(dev)[:, None] + torch.arange(K, device=dev)  # (n, K)
    valid = rows < L
    rows = rows.clamp(max=L - 1)
    b = group.batch.to(dev)
    visible = valid[:, :, None].expand(-1, -1, K)  # (n, R, K)
    if mask is not None:
        predicate = mask.predicate(B, H, L, S, dev)
        h = torch.zeros((), dtype=torch.long, device=dev)
        visible = visible & predicate(b[:, None, None], h, rows[:, :, None], keys[:, None, :])
    seen, seen_keys = visible.any(-1), visible.any(-2)  # (n, R), (n, K)
    n = b.shape[0]
    qb = q[b[:, None], :, rows]  # (n, R, H, D)
    qb = torch.where(seen[:, :, None, None], qb, 0.0)  # rows that see nothing may hold NaN
    qb = qb.view(n, R, Hkv, G, -1).permute(0, 2, 3, 1, 4).reshape(n, Hkv, G * R, -1)
    kb, vb = (
        torch.where(seen_keys[:, :, None, None], t[b[:, None], :, keys], 0.0).transpose(1, 2)
        for t in (k, v)
    )  # (n, Hkv, K, D): keys nobody here sees may hold NaN
    attn_mask = None
    if not bool(visible.all()):
        if bool((visible == visible[:1]).all()):
            visible = visible[:1]  # one pattern shared by every block (a sliding band)
        additive = torch.zeros(visible.shape, dtype=q.dtype, device=dev).masked_fill(
            ~visible, -torch.inf
        )  # (n|1, R, K)
        attn_mask = additive[:, None].expand(-1, G, -1, -1).reshape(-1, 1, G * R, K)
    return _Block(qb, kb.contiguous(), vb.contiguous(), attn_mask, rows, keys, seen, valid)


def _rows_of(x: Tensor, blk: _Block, Hkv: int, G: int) -> Tensor:
    """(n, Hkv, G·R, ...) block rows -> (n·R valid rows, H, ...) in (B, L, H) order."""
    n, R = blk.rows.shape
    x = x.reshape(n, Hkv, G, R, *x.shape[3:]).movedim(3, 1)  # (n, R, Hkv, G, ...)
    x = x.reshape(n, R, Hkv * G, *x.shape[4:])
    return x[blk.valid]


def _to_block_rows(x: Tensor, blk: _Block, b: Tensor, Hkv: int, G: int) -> Tensor:
    """(B, H, L, ...) -> (n, Hkv, G·R, ...): the inverse gather of `_rows_of`."""
    n, R = blk.rows.shape
    rows = x[b[:, None], :, blk.rows]  # (n, R, H, ...)
    rows = rows.reshape(n, R, Hkv, G, *rows.shape[3:]).movedim(1, 3)  # (n, Hkv, G, R, ...)
    return rows.reshape(n, Hkv, G * R, *rows.shape[4:])


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, plan: TilePlan,
        scale: float,
    ) -> tuple[Tensor, Tensor]:
        B, H, L, _ = q.shape
        Hkv = k.shape[1]
        G = H // Hkv
        flash = cpu_flash_attention()
        assert flash is not None
        out = q.new_zeros(B, L, H, v.shape[-1])  # (B, L, H, Dv): rows scatter in
        lse = q.new_full((B, L, H), -torch.inf)
        for group in plan.groups:
            blk = _gather(q, k, v, mask, group)
            ob, lb = flash(blk.q, blk.k, blk.v, 0.0, False, attn_mask=blk.attn_mask, scale=scale)
            seen = blk.seen[:, None, None, :].expand(-1, Hkv, G, -1).reshape(lb.shape)
            lb = torch.where(seen, lb, -torch.inf)  # the op reports 0 for empty rows
            b = group.batch.to(q.device)[:, None].expand_as(blk.rows)[blk.valid]
            r = blk.rows[blk.valid]
            out[b, r] = _rows_of(ob, blk, Hkv, G)
            lse[b, r] = _rows_of(lb, blk, Hkv, G)
        out = out.transpose(1, 2).contiguous()  # (B, H, L, Dv)
        lse = lse.transpose(1, 2).contiguous()  # (B, H, L)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.plan, ctx.scale = mask, plan, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dout: Tensor | None, dlse: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        if dout is None and dlse is None:
            return dq, dk, dv, None, None, None
        dout = torch.zeros_like(out) if dout is None else dout
        Hkv, G = k.shape[1], q.shape[1] // k.shape[1]
        backward_op = cpu_flash_attention_backward()
        assert backward_op is not None
        dq_rows = dq.transpose(1, 2)  # (B, L, H, D) view
        dk_rows, dv_rows = dk.transpose(1, 2), dv.transpose(1, 2)  # (B, S, Hkv, D) views
        safe_lse = torch.where(torch.isfinite(lse), lse, 0.0)  # masked scores stay -inf
        for group in ctx.plan.groups:
            blk = _gather(q, k, v, ctx.mask, group)
            b = group.batch.to(q.device)
            go, ob, lb = (_to_block_rows(t, blk, b, Hkv, G) for t in (dout, out, safe_lse))
            qb, kb, vb = blk.q, blk.k, blk.v
            if dlse is not None:
                qb, kb, vb, ob, go = _with_lse_gradient(
                    qb, kb, vb, ob, go, _to_block_rows(dlse, blk, b, Hkv, G)
                )
            gq, gk, gv = backward_op(
                go, qb, kb, vb, ob, lb, 0.0, False, attn_mask=blk.attn_mask, scale=ctx.scale
            )
            gq, gk, gv = gq[..., : q.shape[-1]], gk[..., : k.shape[-1]], gv[..., : v.shape[-1]]
            rb = b[:, None].expand_as(blk.rows)[blk.valid]
            dq_rows[rb, blk.rows[blk.valid]] = _rows_of(gq, blk, Hkv, G)
            kb_idx = b[:, None].expand_as(blk.keys).reshape(-1)
            keys = blk.keys.reshape(-1)
            dk_rows.index_put_((kb_idx, keys), gk.transpose(1, 2).flatten(0, 1), accumulate=True)
            dv_rows.index_put_((kb_idx, keys), gv.transpose(1, 2).flatten(0, 1), accumulate=True)
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

    return (pad(q, zeros[:1, :1, :1]), pad(k, zeros), pad(v, ones), pad(out, zeros[:1, :1, :1]),
            pad(dout, dlse[..., None]))


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

    def plan(self, call: AttentionCall) -> TilePlan:
        d = call.dims
        return plan_tiles(call.mask, d.B, d.L, d.S)

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int:
        plan, d = self.plan(call), call.dims
        largest = max((g.batch.shape[0] * g.keys for g in plan.groups), default=0)
        mask_bytes = max((g.rows * g.keys for g in plan.groups), default=0) * 4 * d.groups
        return (2 * largest * d.Hkv * d.D + d.B * d.H * d.L * (d.D + 1)) * 4 + mask_bytes

    def run(self, call: AttentionCall, *, need_lse: bool) -> tuple[Tensor, Tensor | None]:
        work = compute_dtype(call.q.dtype)
        q, k, v = call.q.to(work), call.k.to(work), call.v.to(work)
        out, lse = _TiledAttention.apply(q, k, v, call.mask, self.plan(call), call.scale)
        return out.to(call.q.dtype), lse if need_lse else None
