"""How shards of K/V travel to the queries that need them, and their gradients back.

The schedule (`strategies._KeysToQueries`) is one: attend this rank's queries to its
own keys, then to every shard the transport brings, merging by log-sum-exp; in the
backward, take each piece's gradients and hand the key/value gradients to the
transport, which returns them to their owners. Two transports:

- `Ring`: at step t rank r sends its shard to rank r+t and receives rank r-t's, point
  to point, only where the receiver's queries see some of those keys; the next step's
  transfer is in flight while this step computes (double buffering). A rank holds a
  few shards at a time, so the forward keeps only its own piece and the backward
  fetches the others again; gradients go back point to point.
- `AllGather`: one all-gather of every shard; the forward keeps every piece, and the
  backward sums the gradients where they belong with one reduce-scatter.

Shards travel packed as one (B, Hkv, n, D + Dv) tensor, GQA heads unexpanded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit.distributed.comm import Group, all_gather

__all__ = ["FORWARD", "TRANSPORTS", "AllGather", "Returns", "Ring", "Transport"]

FORWARD, BACKWARD, GRADS = 0, 1 << 12, 2 << 12  # tag bases of the three exchanges
Shards = Iterator[tuple[int, Tensor, Tensor]]  # (s, k_s, v_s) of the ranks whose keys we need


class Returns:
    """Key/value gradients of the pieces, summed at the ranks that own the keys."""

    def add(self, s: int, dk: Tensor, dv: Tensor) -> None:
        raise NotImplementedError

    def finish(self) -> Tensor:
        """This rank's own (B, Hkv, n, D + Dv) key/value gradient, summed."""
        raise NotImplementedError


class Transport:
    """Brings shards (`fetch`), says which pieces the forward keeps for the backward
    (`keeps`) and which the backward fetches again (`fetch_again`), and carries the
    gradients back (`returns`)."""

    name: str

    def fetch(
        self, group: Group, needs: list[list[bool]], k: Tensor, v: Tensor, tag: int
    ) -> Shards:
        raise NotImplementedError

    def keeps(self, s: int, r: int) -> bool:
        raise NotImplementedError

    def fetch_again(
        self, group: Group, needs: list[list[bool]], k: Tensor, v: Tensor, kept: set[int]
    ) -> Shards:
        raise NotImplementedError

    def returns(
        self, group: Group, needs: list[list[bool]], k: Tensor, v: Tensor, dtype: torch.dtype
    ) -> Returns:
        raise NotImplementedError


def _pack(k: Tensor, v: Tensor) -> Tensor:
    return torch.cat([k, v.to(k.dtype)], -1)  # (B, Hkv, n, D + Dv)


def _unpack(kv: Tensor, D: int) -> tuple[Tensor, Tensor]:
    return kv[..., :D], kv[..., D:]


def _add(total: Tensor, dk: Tensor, dv: Tensor) -> None:
    """Sum a piece's key and value gradients into a packed (..., D + Dv) total."""
    D = dk.shape[-1]
    total[..., :D] += dk
    total[..., D:] += dv


def _gradient_shape(k: Tensor, v: Tensor) -> tuple[int, ...]:
    return (*k.shape[:3], k.shape[-1] + v.shape[-1])  # (B, Hkv, n, D + Dv)


class Ring(Transport):
    name = "ring"

    def fetch(
        self, group: Group, needs: list[list[bool]], k: Tensor, v: Tensor, tag: int
    ) -> Shards:
        """This rank's own shard first (k, v themselves), then step by step around the
        ring, each step's receive posted before the previous one is computed."""
        r, P, D = group.rank, group.size, k.shape[-1]
        yield r, k, v
        if P == 1:
            return
        kv = _pack(k, v)
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

    def keeps(self, s: int, r: int) -> bool:
        return s == r  # a rank holds a few shards at a time: its own piece only

    def fetch_again(
        self, group: Group, needs: list[list[bool]], k: Tensor, v: Tensor, kept: set[int]
    ) -> Shards:
        # every rank takes part in the whole round: its peers need its K/V again
        for s, k_s, v_s in self.fetch(group, needs, k, v, BACKWARD):
            if s not in kept:
                yield s, k_s, v_s

    def returns(
        self, group: Group, needs: list[list[bool]], k: Tensor, v: Tensor, dtype: torch.dtype
    ) -> Returns:
        return _RingReturns(group, needs, k.new_zeros(_gradient_shape(k, v), dtype=dtype))


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


class _RingReturns(Returns):
    """Our own piece's gradient summed here; others' sent to their owners, point to point
    (rank r+t computed our shard's gradient at its step t: received as it comes)."""

    def __init__(self, group: Group, needs: list[list[bool]], total: Tensor) -> None:
        self.group, self.total = group, total  # (B, Hkv, n, D + Dv)
        r, P = group.rank, group.size
        self.sends: list[Any] = []
        self.recvs: list[tuple[Any, Tensor]] = []
        for t in range(1, P):
            if needs[(r + t) % P][r]:
                buf = torch.empty_like(total)
                self.recvs.append((group.irecv(buf, (r + t) % P, GRADS + t), buf))

    def add(self, s: int, dk: Tensor, dv: Tensor) -> None:
        r, P = self.group.rank, self.group.size
        if s == r:
            _add(self.total, dk, dv)
        else:
            self.sends.append(self.group.isend(torch.cat([dk, dv], -1), s, GRADS + (r - s) % P))

    def finish(self) -> Tensor:
        for recv, buf in self.recvs:
            recv.wait()
            self.total += buf
        for send in self.sends:
            send.wait()
        return self.total


class AllGather(Transport):
    name = "allgather"

    def fetch(
        self, group: Group, needs: list[list[bool]], k: Tensor, v: Tensor, tag: int
    ) -> Shards:
        """This rank's own shard first, then every needed shard of one all-gather."""
        r, P, D = group.rank, group.size, k.shape[-1]
        yield r, k, v
        if P == 1:
            return
        shards = all_gather(_pack(k, v), group)
        yield from ((s, *_unpack(shards[s], D)) for s in range(P) if s != r and needs[r][s])

    def keeps(self, s: int, r: int) -> bool:
        return True  # it holds every shard anyway

    def fetch_again(
        self, group: Group, needs: list[list[bool]], k: Tensor, v: Tensor, kept: set[int]
    ) -> Shards:
        return iter(())  # every piece was kept

    def returns(
        self, group: Group, needs: list[list[bool]], k: Tensor, v: Tensor, dtype: torch.dtype
    ) -> Returns:
        parts = group.size if group.size > 1 else 1
        return _GatherReturns(group, k.new_zeros((parts, *_gradient_shape(k, v)), dtype=dtype))


class _GatherReturns(Returns):
    """Every owner's part summed here, then one reduce-scatter sums them where they belong."""

    def __init__(self, group: Group, total: Tensor) -> None:
        self.group, self.total = group, total  # (P|1, B, Hkv, n, D + Dv)

    def add(self, s: int, dk: Tensor, dv: Tensor) -> None:
        _add(self.total[s if self.total.shape[0] > 1 else 0], dk, dv)

    def finish(self) -> Tensor:
        if self.total.shape[0] == 1:
            return self.total[0]
        mine = torch.empty_like(self.total[0])
        dist.reduce_scatter(mine, list(self.total.unbind(0)), group=self.group.group)
        return mine


TRANSPORTS: dict[str, Transport] = {t.name: t for t in (Ring(), AllGather())}
