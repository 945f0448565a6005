"""The few `torch.distributed` operations context parallelism needs, with their autograd.

Everything goes through `torch.distributed` (gloo on CPU, nccl on GPU): point-to-point
`isend`/`irecv` for the ring, `all_gather` and `reduce_scatter` for the gathered
strategy, `all_to_all_single` for Ulysses. Ranks are group ranks; `peer` turns one into
the global rank the point-to-point calls take.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit._compat import apply

__all__ = ["Group", "all_gather", "all_to_all_heads", "group_of"]


class Group:
    """A process group with its size and this process's rank in it."""

    def __init__(self, group: Any = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "attnkit.distributed needs an initialized process group: call "
                "torch.distributed.init_process_group('gloo') (CPU) or ('nccl') (GPU) first."
            )
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def peer(self, rank: int) -> int:
        """The global rank of group rank `rank`."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def isend(self, tensor: Tensor, rank: int, tag: int) -> Any:
        return dist.isend(tensor.contiguous(), self.peer(rank), group=self.group, tag=tag)

    def irecv(self, tensor: Tensor, rank: int, tag: int) -> Any:
        return dist.irecv(tensor, self.peer(rank), group=self.group, tag=tag)


def group_of(group: Any) -> Group:
    return group if isinstance(group, Group) else Group(group)


def all_gather(x: Tensor, group: Group) -> list[Tensor]:
    """Every rank's `x` (all the same shape), rank order; no autograd."""
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.group)
    return parts


class _AllToAllHeads(torch.autograd.Function):
    """(B, Hx, n, E) sequence-sharded -> (B, Hx/P, P·n, E) head-sharded, or back.

    Forward: rank r sends head group j to rank j and receives group r from every rank,
    pieces in rank order along dim 2. The backward is the opposite exchange.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group, to_heads: bool) -> Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _exchange(x, group, to_heads)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _exchange(grad, ctx.group, not ctx.to_heads), None, None


def _exchange(x: Tensor, group: Group, to_heads: bool) -> Tensor:
    P = group.size
    B, Hx, n, E = x.shape
    if to_heads:  # (B, Hx, n, E) -> pieces by destination head group
        send = x.reshape(B, P, Hx // P, n, E).transpose(0, 1).contiguous()  # (P, B, Hx/P, n, E)
    else:  # (B, Hx, P·n, E) -> pieces by destination sequence shard
        send = x.reshape(B, Hx, P, n // P, E).permute(2, 0, 1, 3, 4).contiguous()
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=group.group)  # got[j]: from rank j
    if to_heads:
        return got.permute(1, 2, 0, 3, 4).reshape(B, Hx // P, P * n, E)
    return got.transpose(0, 1).reshape(B, P * Hx, n // P, E)


def all_to_all_heads(x: Tensor, group: Group, *, to_heads: bool) -> Tensor:
    out: Tensor = apply(_AllToAllHeads, x, group, to_heads)
    return out
