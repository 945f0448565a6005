"""How K/V reach the queries that need them: `ring`, `allgather`, `ulysses`.

`ring` and `allgather` keep queries where they are and bring keys and values (packed as
one (B, Hkv, n, D + Dv) tensor, GQA heads unexpanded) to them; both run inside one
autograd function whose backward fetches K/V again, recomputes each piece and sends the
key/value gradients back to their owners, so no rank ever holds more than a few shards:

- `ring`: at step t rank r sends its shard to rank r+t and receives rank r-t's, point to
  point, only where the receiver's queries see some of those keys; the next step's
  transfer is in flight while this step computes (double buffering).
- `allgather`: one all-gather of every shard, then local pieces; the backward sums the
  gradients with one reduce-scatter.

`ulysses` moves queries instead: an all-to-all turns sequence shards into head shards
(every rank then attends over the whole sequence for H/P heads) and back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit.distributed.comm import Group, all_gather, all_to_all_heads
from attnkit.distributed.pieces import Accumulator, Problem
from attnkit.functional import attention_with_lse
from attnkit.masks.window import window
from attnkit.softmax import part_gradients

__all__ = ["STRATEGIES", "run_strategy"]

STRATEGIES = ("ring", "allgather", "ulysses")
_FORWARD, _BACKWARD, _GRADS = 0, 1 << 12, 2 << 12  # tag bases of the three exchanges


def run_strategy(
    strategy: str,
    problem: Problem,
    group: Group,
    needs: list[list[bool]],
    q: Tensor,
    k: Tensor,
    v: Tensor,
) -> tuple[Tensor, Tensor]:
    """out (B, H, n, Dv) in q's dtype and lse (B, H, n) of this rank's queries;
    `needs[r][s]`: rank r's queries see some of rank s's keys (`Problem.needs`)."""
    if strategy == "ulysses":
        return _ulysses(problem, group, q, k, v)
    out, lse = _KeysToQueries.apply(q, k, v, problem, group, strategy, needs)  # type: ignore[no-untyped-call]
    return out, lse


class _KeysToQueries(torch.autograd.Function):
    """Bring K/V to the queries; the backward brings key/value gradients back.

    The pieces a rank can keep without holding more than its own shard (its own keys;
    every piece under allgather, which holds all shards anyway) keep their autograd
    graphs from the forward pass; the ring's other pieces are recomputed in the backward
    from K/V fetched again, so a rank never holds more than a few shards.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        problem: Problem,
        group: Group,
        strategy: str,
        needs: list[list[bool]],
    ) -> tuple[Tensor, Tensor]:
        r = group.rank
        acc = Accumulator(q.shape[0], problem.H, q.shape[2], problem.Dv, q)
        grad = any(ctx.needs_input_grad[:3])
        fused = grad and problem.fused_backward(q)  # gradients from the global out, lse
        kept: dict[int, _Piece | tuple[Tensor, Tensor]] = {}
        for s, k_s, v_s in _fetch(strategy, group, needs, k, v, _FORWARD):
            keep = grad and (s == r or strategy == "allgather")
            if keep and not fused:
                kept[s] = piece = _Piece(problem, r, s, q, k_s, v_s)
                acc.add(piece.out.detach(), piece.lse.detach())
                continue
            if keep:
                kept[s] = (k_s, v_s)  # the shard alone: no graph, no piece recomputed
            acc.add(*problem.piece(r, s, q, k_s, v_s))
        ctx.save_for_backward(q, k, v, acc.out, acc.lse)
        ctx.problem, ctx.group, ctx.strategy, ctx.needs, ctx.kept = (
            problem, group, strategy, needs, kept
        )  # fmt: skip
        ctx.fused = fused
        return acc.out.to(q.dtype), acc.lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        problem, group, needs, kept = ctx.problem, ctx.group, ctx.needs, ctx.kept
        ctx.kept = None  # the graphs are used once
        r, D = group.rank, problem.D
        dout = dout.to(out.dtype)
        lse_grad = None if dlse is None else dlse.to(lse.dtype)
        dq = q.new_zeros(q.shape, dtype=out.dtype)  # (B, H, n, D), compute dtype
        returns = _Returns(ctx.strategy, group, needs, k, v, out.dtype)

        def take(s: int, held: _Piece | tuple[Tensor, Tensor]) -> None:
            """Add the gradients of rank s's piece: fused from the global out and lse
            where it can, else by autograd through the piece (kept or recomputed)."""
            nonlocal dq
            found = None
            if ctx.fused and not isinstance(held, _Piece):
                found = problem.piece_grads(r, s, q, *held, out, lse, dout, lse_grad)
            if found is None:
                piece = held if isinstance(held, _Piece) else _Piece(problem, r, s, q, *held)
                zeros = torch.zeros_like(lse) if lse_grad is None else lse_grad
                found = piece.grads(out, lse, dout, zeros)
            dq = dq + found[0]
            returns.add(s, found[1], found[2])

        for s, piece in kept.items():
            take(s, piece)
        if ctx.strategy == "ring":  # every rank takes part: its peers need its K/V again
            for s, k_s, v_s in _fetch("ring", group, needs, k, v, _BACKWARD):
                if s not in kept:
                    take(s, (k_s, v_s))
        dkv = returns.finish()
        dk, dv = dkv[..., :D].to(k.dtype), dkv[..., D:].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None


class _Piece:
    """One piece computed with its autograd graph, on leaves of its own."""

    def __init__(self, problem: Problem, r: int, s: int, q: Tensor, k: Tensor, v: Tensor) -> None:
        with torch.enable_grad():
            self.leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
            self.out, self.lse = problem.piece(r, s, *self.leaves)  # (B, H, n, Dv), (B, H, n)

    def grads(
        self, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """dq, dk, dv of this piece in the whole result (`softmax.part_gradients`)."""
        g_out, g_lse = part_gradients(self.out.detach(), self.lse.detach(), out, lse, dout, dlse)
        outputs = [(t, g) for t, g in ((self.out, g_out), (self.lse, g_lse)) if t.requires_grad]
        found: tuple[Tensor | None, ...] = (None, None, None)  # a piece that sees nothing
        if outputs:
            found = torch.autograd.grad(
                [t for t, _ in outputs], self.leaves, [g for _, g in outputs], allow_unused=True
            )
        dq, dk, dv = (
            (torch.zeros_like(x) if g is None else g).to(out.dtype)
            for g, x in zip(found, self.leaves, strict=True)
        )
        return dq, dk, dv


def _pack(k: Tensor, v: Tensor) -> Tensor:
    return torch.cat([k, v.to(k.dtype)], -1)  # (B, Hkv, n, D + Dv)


def _unpack(kv: Tensor, D: int) -> tuple[Tensor, Tensor]:
    return kv[..., :D], kv[..., D:]


def _fetch(
    strategy: str, group: Group, needs: list[list[bool]], k: Tensor, v: Tensor, tag: int
) -> Iterator[tuple[int, Tensor, Tensor]]:
    """(s, k_s, v_s) of every rank s whose keys this rank's queries need, this rank's own
    (k, v themselves) first; other shards travel packed as one tensor."""
    r, P, D = group.rank, group.size, k.shape[-1]
    yield r, k, v
    if P == 1:
        return
    kv = _pack(k, v)
    if strategy == "allgather":
        shards = all_gather(kv, group)
        yield from ((s, *_unpack(shards[s], D)) for s in range(P) if s != r and needs[r][s])
        return
    sends: list[Any] = []
    pending = _post(group, needs, kv, 1, tag, sends)
    for t in range(1, P):
        recv, src, buf = pending
        if t + 1 < P:  # the next step in flight while this one computes
            pending = _post(group, needs, kv, t + 1, tag, sends)
        if recv is not None:
            recv.wait()
            yield (src, *_unpack(buf, D))
    for send in sends:
        send.wait()


def _post(
    group: Group, needs: list[list[bool]], kv: Tensor, t: int, tag: int, sends: list[Any]
) -> tuple[Any, int, Tensor]:
    """Start step t: send our shard to rank r+t if it needs it, receive rank r-t's if we do."""
    r, P = group.rank, group.size
    dst, src = (r + t) % P, (r - t) % P
    if needs[dst][r]:
        sends.append(group.isend(kv, dst, tag + t))
    buf = torch.empty_like(kv)
    return (group.irecv(buf, src, tag + t) if needs[r][src] else None), src, buf


class _Returns:
    """Key/value gradients back to the ranks that own them, summed there."""

    def __init__(
        self,
        strategy: str,
        group: Group,
        needs: list[list[bool]],
        k: Tensor,
        v: Tensor,
        dtype: torch.dtype,
    ) -> None:
        self.strategy, self.group, self.needs, self.D = strategy, group, needs, k.shape[-1]
        r, P = group.rank, group.size
        B, Hkv, n, _ = k.shape
        shape = (P if strategy == "allgather" and P > 1 else 1, B, Hkv, n, self.D + v.shape[-1])
        self.total = k.new_zeros(shape, dtype=dtype)  # (P|1, B, Hkv, n, D + Dv)
        self.sends: list[Any] = []
        self.recvs: list[tuple[Any, Tensor]] = []
        if strategy == "ring":  # rank r+t computed our shard's gradient at its step t
            for t in range(1, P):
                if needs[(r + t) % P][r]:
                    buf = torch.empty_like(self.total[0])
                    self.recvs.append((group.irecv(buf, (r + t) % P, _GRADS + t), buf))

    def add(self, s: int, dk: Tensor, dv: Tensor) -> None:
        r, P, D = self.group.rank, self.group.size, self.D
        if s == r or self.strategy == "allgather":
            total = self.total[s if self.total.shape[0] > 1 else 0]
            total[..., :D] += dk
            total[..., D:] += dv
        else:
            self.sends.append(self.group.isend(torch.cat([dk, dv], -1), s, _GRADS + (r - s) % P))

    def finish(self) -> Tensor:
        if self.total.shape[0] > 1:  # allgather: every rank's part, summed where it belongs
            mine = torch.empty_like(self.total[0])
            dist.reduce_scatter(mine, list(self.total.unbind(0)), group=self.group.group)
            return mine
        for recv, buf in self.recvs:
            recv.wait()
            self.total[0] += buf
        for send in self.sends:
            send.wait()
        return self.total[0]


def _ulysses(
    problem: Problem, group: Group, q: Tensor, k: Tensor, v: Tensor
) -> tuple[Tensor, Tensor]:
    """Sequence shards -> head shards (all-to-all), whole-sequence attention, and back."""
    P, r, L = group.size, group.rank, problem.L
    order = problem.layout.order().to(q.device)  # global position of each gathered row
    inverse = torch.argsort(order)
    qh, kh, vh = (all_to_all_heads(t, group, to_heads=True)[:, :, inverse] for t in (q, k, v))
    per = problem.H // P
    mask = problem.mask
    if mask is not None:
        mask = window(
            mask, H=problem.H, L=L, S=L, rows=(0, L), cols=(0, L), heads=(r * per, (r + 1) * per)
        )
    out, lse = attention_with_lse(qh, kh, vh, mask, scale=problem.scale, softcap=problem.softcap)
    out = all_to_all_heads(out[:, :, order], group, to_heads=False)  # (B, H, n, Dv)
    lse = all_to_all_heads(lse[:, :, order, None], group, to_heads=False)[..., 0]  # (B, H, n)
    return out, lse
