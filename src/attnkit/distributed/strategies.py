"""How K/V reach the queries that need them: `ring`, `allgather`, `ulysses`.

`ring` and `allgather` keep queries where they are and bring keys and values to them:
two transports (`transports.py`) behind one schedule, an autograd function whose
forward merges the pieces by log-sum-exp and whose backward takes each piece's
gradients (fused from the global out and lse where it can, else through the piece's
graph, kept or recomputed from K/V fetched again) and returns the key/value gradients
to their owners.

`ulysses` moves queries instead: an all-to-all turns sequence shards into head shards
(every rank then attends over the whole sequence for H/P heads) and back.

The fused backward (CPU, a positive scale, a backend whose backward takes the piece;
`attnkit.call.gradients`): the weights of any shard of keys are `P = exp(s − lse)` with the
global lse and `dS = P ⊙ (dP − rowsum(dO ⊙ O))` with the global O (plus `P·dlse`), which
is what one fused backward per rectangle computes (SDPA's flash backward for unmasked
and causal rectangles, the native kernel's or `tiled`'s elsewhere): no piece is
recomputed, no graph kept, and the slower lse-gradient path is not taken; the forward
keeps only the shards (its own; every one under allgather) and the ring fetches the
others again. Elsewhere each piece gets `w_s·dout` and `w_s·(⟨dout, out_s − out⟩ +
dlse)` (`w_s = exp(lse_s − lse)`) through its own graph (kept from the forward for the
rank's own keys, all of them under allgather; the ring's others recomputed).

`ulysses` needs Hkv % P == 0 (else a `ValueError` saying why), windows the mask to its
head shard, and has autograd through the exchanges.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit._compat import apply
from attnkit.call.functional import attention_with_lse
from attnkit.distributed.comm import Group, all_to_all_heads
from attnkit.distributed.pieces import GlobalCall, RunningMerge
from attnkit.distributed.transports import FORWARD, TRANSPORTS, Transport
from attnkit.masks.window import window
from attnkit.softmax import part_gradients

__all__ = ["STRATEGIES", "run_strategy"]

STRATEGIES = ("ring", "allgather", "ulysses")


def run_strategy(
    strategy: str,
    global_call: GlobalCall,
    group: Group,
    needs: list[list[bool]],
    q: Tensor,
    k: Tensor,
    v: Tensor,
) -> tuple[Tensor, Tensor]:
    """out (B, H, n, Dv) in q's dtype and lse (B, H, n) of this rank's queries;
    `needs[r][s]`: rank r's queries see some of rank s's keys (`GlobalCall.needs`)."""
    if strategy == "ulysses":
        return _ulysses(global_call, group, q, k, v)
    transport = TRANSPORTS[strategy]
    out, lse = apply(_KeysToQueries, q, k, v, global_call, group, transport, needs)
    return out, lse


class _KeysToQueries(torch.autograd.Function):
    """Bring K/V to the queries; the backward brings key/value gradients back.

    The pieces the transport keeps (`Transport.keeps`: the ring its own, allgather every
    one) keep their autograd graphs from the forward pass (or their shards alone, where
    the gradients come fused from the global out and lse); the others are recomputed in
    the backward from K/V fetched again (`fetch_again`).
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        global_call: GlobalCall,
        group: Group,
        transport: Transport,
        needs: list[list[bool]],
    ) -> tuple[Tensor, Tensor]:
        r = group.rank
        acc = RunningMerge(q.shape[0], global_call.H, q.shape[2], global_call.Dv, q)
        grad = any(ctx.needs_input_grad[:3])
        fused = grad and global_call.fused_backward(q)  # gradients from the global out, lse
        kept: dict[int, _Piece | tuple[Tensor, Tensor]] = {}
        for s, k_s, v_s in transport.fetch(group, needs, k, v, FORWARD):
            keep = grad and transport.keeps(s, r)
            if keep and not fused:
                kept[s] = piece = _Piece(global_call, r, s, q, k_s, v_s)
                acc.add(piece.out.detach(), piece.lse.detach())
                continue
            if keep:
                kept[s] = (k_s, v_s)  # the shard alone: no graph, no piece recomputed
            acc.add(*global_call.piece(r, s, q, k_s, v_s))
        ctx.save_for_backward(q, k, v, acc.out, acc.lse)
        ctx.global_call, ctx.group, ctx.transport, ctx.needs, ctx.kept = (
            global_call,
            group,
            transport,
            needs,
            kept,
        )
        ctx.fused = fused
        return acc.out.to(q.dtype), acc.lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        global_call, group, needs, kept = ctx.global_call, ctx.group, ctx.needs, ctx.kept
        ctx.kept = None  # the graphs are used once
        r, D = group.rank, global_call.D
        dout = dout.to(out.dtype)
        lse_grad = None if dlse is None else dlse.to(lse.dtype)
        dq = q.new_zeros(q.shape, dtype=out.dtype)  # (B, H, n, D), compute dtype
        transport: Transport = ctx.transport
        returns = transport.returns(group, needs, k, v, out.dtype)

        def take(s: int, shard: _Piece | tuple[Tensor, Tensor]) -> None:
            """Add the gradients of rank s's piece: fused from the global out and lse
            where it can, else by autograd through the piece (kept or recomputed)."""
            nonlocal dq
            grads = None
            if ctx.fused and not isinstance(shard, _Piece):
                grads = global_call.piece_grads(r, s, q, *shard, out, lse, dout, lse_grad)
            if grads is None:
                piece = shard if isinstance(shard, _Piece) else _Piece(global_call, r, s, q, *shard)
                zeros = torch.zeros_like(lse) if lse_grad is None else lse_grad
                grads = piece.grads(out, lse, dout, zeros)
            dq = dq + grads[0]
            returns.add(s, grads[1], grads[2])

        for s, piece in kept.items():
            take(s, piece)
        for s, k_s, v_s in transport.fetch_again(group, needs, k, v, set(kept)):
            take(s, (k_s, v_s))
        dkv = returns.finish()
        dk, dv = dkv[..., :D].to(k.dtype), dkv[..., D:].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None


class _Piece:
    """One piece computed with its autograd graph, on leaves of its own."""

    def __init__(
        self, global_call: GlobalCall, r: int, s: int, q: Tensor, k: Tensor, v: Tensor
    ) -> None:
        with torch.enable_grad():
            self.leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
            self.out, self.lse = global_call.piece(r, s, *self.leaves)  # (B, H, n, Dv), (B, H, n)

    def grads(
        self, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """dq, dk, dv of this piece in the whole result (`softmax.part_gradients`)."""
        g_out, g_lse = part_gradients(self.out.detach(), self.lse.detach(), out, lse, dout, dlse)
        outputs = [(t, g) for t, g in ((self.out, g_out), (self.lse, g_lse)) if t.requires_grad]
        piece_grads: tuple[Tensor | None, ...] = (None, None, None)  # a piece that sees nothing
        if outputs:
            piece_grads = torch.autograd.grad(
                [t for t, _ in outputs], self.leaves, [g for _, g in outputs], allow_unused=True
            )
        dq, dk, dv = (
            (torch.zeros_like(x) if g is None else g).to(out.dtype)
            for g, x in zip(piece_grads, self.leaves, strict=True)
        )
        return dq, dk, dv


def _ulysses(
    global_call: GlobalCall, group: Group, q: Tensor, k: Tensor, v: Tensor
) -> tuple[Tensor, Tensor]:
    """Sequence shards -> head shards (all-to-all), whole-sequence attention, and back."""
    P, r, L = group.size, group.rank, global_call.L
    order = global_call.layout.order().to(q.device)  # global position of each gathered row
    inverse = torch.argsort(order)
    qh, kh, vh = (all_to_all_heads(t, group, to_heads=True)[:, :, inverse] for t in (q, k, v))
    per = global_call.H // P
    mask = global_call.mask
    if mask is not None:
        mask = window(
            mask,
            H=global_call.H,
            L=L,
            S=L,
            rows=(0, L),
            cols=(0, L),
            heads=(r * per, (r + 1) * per),
        )
    out, lse = attention_with_lse(
        qh, kh, vh, mask, scale=global_call.scale, softcap=global_call.softcap
    )
    out = all_to_all_heads(out[:, :, order], group, to_heads=False)  # (B, H, n, Dv)
    lse = all_to_all_heads(lse[:, :, order, None], group, to_heads=False)[..., 0]  # (B, H, n)
    return out, lse
