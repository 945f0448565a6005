"""`ContextParallel`: run a model's `MultiHeadAttention` modules over a sharded sequence.

    cp = akd.ContextParallel(layout="zigzag")
    akd.parallelize(model, cp)                  # every MultiHeadAttention in it
    logits_local = model(akd.shard(tokens, cp.layout, dim=1))

Each rank feeds its rows of the sequence (`shard(..., dim=1)` of (B, L) tokens); the
modules rotate q and k by the rows' global positions (RoPE) and attend over the whole
sequence with `attnkit.distributed.attention`. Everything outside attention works per
token, so it needs no change; sum the parameter gradients over the group after the
backward pass (each rank's loss is its rows' share of the global loss).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit.distributed.api import attention
from attnkit.distributed.comm import group_of
from attnkit.distributed.layout import Layout
from attnkit.kv.attender import Attender
from attnkit.masks import Mask

__all__ = ["ContextParallel", "parallelize"]


class ContextParallel(Attender):
    """Where a module's rows lie (group, layout) and how to attend (strategy): what
    `parallelize` sets as each `MultiHeadAttention`'s `context`.

    A module under it takes this rank's rows of one sequence (self-attention, no cache,
    no dropout), rotates q and k (RoPE) by the rows' global positions and attends over
    the whole sequence with `attnkit.distributed.attention`.

    Args:
        group: the process group (default None: the default group), read when called.
        layout: "zigzag" or "contiguous", as the input was `shard`ed (default "zigzag").
        strategy: "ring", "allgather", "ulysses" or "auto" (default "auto").

    Examples:
        >>> import attnkit.distributed as akd
        >>> cp = akd.ContextParallel(layout="contiguous", strategy="ring")
        >>> cp  # no process group is needed until a module runs under it
        ContextParallel(layout='contiguous', strategy='ring')
    """

    def __init__(self, group: Any = None, layout: str = "zigzag", strategy: str = "auto") -> None:
        self.group, self.layout, self.strategy = group, layout, strategy

    def positions(self, rows: int, device: torch.device | None = None) -> Tensor:
        """Global positions of this rank's `rows` local rows: (rows,)."""
        g = group_of(self.group)
        global_rows = Layout.of(self.layout, g.size, rows * g.size).positions(g.rank)
        return global_rows if device is None else global_rows.to(device)

    # a module's attender (`attnkit.kv.attender`): this rank's rows of one sequence
    def check(
        self, query: Tensor, key: Tensor | None, value: Tensor | None, dropout_p: float
    ) -> None:
        if key is not None or value is not None:
            raise ValueError(
                "context parallelism shards one sequence for self-attention: call the module "
                "with the query rows only (no key, value or cache), or set .context = None."
            )
        if dropout_p > 0:
            raise ValueError(
                f"context-parallel attention has no dropout; build the module with dropout=0 "
                f"(it has {dropout_p}) or call .eval()."
            )

    def attend_heads(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Mask | Tensor | None,
        *,
        dropout_p: float,
        backend: str,
    ) -> Tensor:
        """This rank's rows (B, H, L/P, hd) against the whole sequence: (B, H, L/P, Dv)."""
        return attention(
            q, k, v, mask, group=self.group, layout=self.layout, strategy=self.strategy
        )

    def __repr__(self) -> str:
        return f"ContextParallel(layout={self.layout!r}, strategy={self.strategy!r})"


def parallelize(model: nn.Module, context: ContextParallel | None = None) -> nn.Module:
    """Put every `MultiHeadAttention` in `model` under context parallelism: each rank
    then feeds its rows of the sequence (`shard(tokens, cp.layout, dim=1)`).

    Everything outside attention works per token and needs no change; sum the parameter
    gradients over the group after the backward pass. Set a module's `.context = None`
    to undo.

    Args:
        model: any module; its `MultiHeadAttention` submodules (itself included) are set.
        context: the `ContextParallel` to use (default None: `ContextParallel()`).

    Returns:
        `model`, changed in place.

    Examples:
        >>> import attnkit.distributed as akd
        >>> model = torch.nn.Sequential(ak.MultiHeadAttention(16, 4, rope=True))
        >>> cp = akd.ContextParallel(layout="zigzag")
        >>> akd.parallelize(model, cp) is model
        True
        >>> model[0].context is cp  # its calls now go through akd.attention
        True
    """
    from attnkit.modules import MultiHeadAttention

    context = ContextParallel() if context is None else context
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.context = context
    return model
