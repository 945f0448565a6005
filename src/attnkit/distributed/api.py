"""The context-parallel calls: `shard`, `unshard`, `attention`, `attention_with_lse`,
`explain` (re-exported by `attnkit.distributed`, whose docstring shows them at work)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.contracts import normalize_call
from attnkit.distributed.agree import agree
from attnkit.distributed.comm import Group, group_of
from attnkit.distributed.layout import Layout
from attnkit.distributed.pieces import Problem
from attnkit.distributed.plan import ContextPlan, plan_context
from attnkit.distributed.strategies import run_strategy
from attnkit.errors import ShapeContractError
from attnkit.masks import Mask, as_mask

__all__ = ["attention", "attention_with_lse", "explain", "shard", "unshard"]


def shard(x: Tensor, layout: str = "zigzag", group: Any = None, *, dim: int = 2) -> Tensor:
    """This rank's rows of the full `x` along `dim` (the sequence: 2 for (B, H, L, D))."""
    g = group_of(group)
    lay = Layout.of(layout, g.size, x.shape[dim])
    return torch.cat([x.narrow(dim, a, b - a) for a, b in lay.chunks(g.rank)], dim)


def unshard(x_local: Tensor, layout: str = "zigzag", group: Any = None, *, dim: int = 2) -> Tensor:
    """The full tensor on every rank from each rank's rows along `dim` (`shard` undone).

    Differentiable as a replica: every rank holds the same full tensor, so the gradient
    of this rank's rows is the gradient of the full tensor at them.
    """
    g = group_of(group)
    out: Tensor = _Unshard.apply(x_local, g, layout, dim)  # type: ignore[no-untyped-call]
    return out


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, g: Group, layout: str, dim: int) -> Tensor:
        ctx.g, ctx.layout, ctx.dim = g, layout, dim
        lay = Layout.of(layout, g.size, x.shape[dim] * g.size)
        parts = [torch.empty_like(x) for _ in range(g.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=g.group)
        order = lay.order().to(x.device)
        return torch.cat(parts, dim).index_select(dim, torch.argsort(order))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return shard(grad, ctx.layout, ctx.g, dim=ctx.dim), None, None, None


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    group: Any = None,
    layout: str = "zigzag",
    strategy: str = "auto",
    scale: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Exact self-attention of this rank's rows over the whole sequence.

    Args:
        q: (B, H, L/P, D), k: (B, Hkv, L/P, D), v: (B, Hkv, L/P, Dv): this rank's rows
            (`shard` of the full tensors) in `layout`.
        mask: the global mask (a `Mask` or a bool tensor over (B, H, L, L)), the same on
            every rank; its tensors (document ids, lengths) are the global ones.
        group: the process group (None: the default one); P = its size.
        layout: "zigzag" (balances causal work) or "contiguous".
        strategy: "ring", "allgather", "ulysses" or "auto" (`explain` says which and why).
        scale: as `attnkit.attention`.
        softcap: as `attnkit.attention`.
    Returns:
        (B, H, L/P, Dv): this rank's rows of the output, in q's dtype.
    """
    return attention_with_lse(
        q, k, v, mask, group=group, layout=layout, strategy=strategy, scale=scale, softcap=softcap
    )[0]


def attention_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    group: Any = None,
    layout: str = "zigzag",
    strategy: str = "auto",
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """`attention` and the log-sum-exp of this rank's rows, (B, H, L/P), as
    `attnkit.attention_with_lse` gives it (`-inf` where a row sees nothing)."""
    g = group_of(group)
    problem, plan = agreed(q, k, v, mask, g, layout, strategy, scale, softcap)
    return run_strategy(plan.strategy, problem, g, plan.needs, q, k, v)


def agreed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None,
    g: Group,
    layout: str,
    strategy: str,
    scale: float | None,
    softcap: float | None,
) -> tuple[Problem, ContextPlan]:
    """The problem and plan of a call once every rank has validated its own and all pass
    the same (`agree`: one small collective, before any traffic)."""

    def validate() -> tuple[Problem, ContextPlan]:
        problem = _problem(q, k, v, mask, g, layout, scale, softcap)
        return problem, _plan(problem, g, strategy, q, k, v, detail=False)

    return agree(
        g,
        validate,
        shards={"q": q, "k": k, "v": v},
        shared={"mask": mask, "layout": layout, "strategy": strategy, "scale": scale,
                "softcap": softcap},
    )  # fmt: skip


def explain(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    group: Any = None,
    layout: str = "zigzag",
    strategy: str = "auto",
    scale: float | None = None,
    softcap: float | None = None,
) -> ContextPlan:
    """The strategy `attention` would take on this rank, the bytes each strategy would
    send, which (rank, shard) pairs are skipped and the work against each shard."""
    g = group_of(group)
    return _plan(_problem(q, k, v, mask, g, layout, scale, softcap), g, strategy, q, k, v)


def _plan(
    problem: Problem,
    g: Group,
    strategy: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    detail: bool = True,
) -> ContextPlan:
    kv_bytes = k.numel() * k.element_size() * (problem.D + problem.Dv) // max(1, problem.D)
    out_bytes = q.numel() // max(1, problem.D) * (problem.Dv * q.element_size() + 4)
    q_bytes = q.numel() * q.element_size()
    return plan_context(problem, g.rank, strategy, kv_bytes, q_bytes, out_bytes, detail=detail)


def _problem(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None,
    g: Group,
    layout: str,
    scale: float | None,
    softcap: float | None,
) -> Problem:
    call = normalize_call(q, k, v, None, scale=scale, softcap=softcap)  # shapes, dtypes, GQA
    d = call.dims
    if d.S != d.L:
        raise ShapeContractError(
            f"context parallelism is self-attention: every rank holds the same rows of q "
            f"and k, but q has L/P={d.L} rows and k has {d.S}; shard q, k and v alike."
        )
    lay = Layout.of(layout, g.size, d.L * g.size, what="sequence (P × local rows)")
    the_mask = None if mask is None else as_mask(mask)
    if the_mask is not None:
        the_mask.check(d.B, d.H, lay.L, lay.L)
    return Problem(the_mask, d.B, d.H, d.Hkv, d.D, d.Dv, lay, scale, softcap)
