"""The context-parallel calls: `shard`, `unshard`, `attention`, `attention_with_lse`,
`explain` (re-exported by `attnkit.distributed`, whose docstring shows them at work)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit._compat import apply
from attnkit.contracts import normalize_call
from attnkit.distributed.agree import agree
from attnkit.distributed.comm import Group, group_of
from attnkit.distributed.layout import Layout
from attnkit.distributed.pieces import GlobalCall
from attnkit.distributed.plan import ContextPlan, plan_context
from attnkit.distributed.strategies import run_strategy
from attnkit.errors import ShapeContractError
from attnkit.masks import Mask, as_mask

__all__ = ["attention", "attention_with_lse", "explain", "shard", "unshard"]


def shard(x: Tensor, layout: str = "zigzag", group: Any = None, *, dim: int = 2) -> Tensor:
    """This rank's rows of the full `x` along `dim`, the sequence: what it passes to
    `attention` (and `unshard` undoes).

    Under "zigzag" with P = 2 and L = 8, rank 0 holds rows 0, 1, 6, 7 and rank 1 rows
    2 .. 5; under "contiguous", rows 0 .. 3 and 4 .. 7.

    Args:
        x: the full tensor, the same on every rank, e.g. q (B, H, L, D).
        layout: "zigzag" (rank r holds chunks r and 2P-1-r of 2P: balanced causal work)
            or "contiguous" (rank r holds rows r·L/P .. (r+1)·L/P - 1) (default "zigzag").
        group: the process group (default None: the default group); P = its size.
        dim: the sequence dim (default 2, L of (B, H, L, D); 1 for (B, L) tokens).

    Returns:
        x's rows of this rank: x's shape with L/P at `dim`.

    Raises:
        RuntimeError: no initialized process group.
        ValueError: an unknown layout.
        ShapeContractError: L that does not split into P (zigzag: 2P) chunks, naming
            the padding.

    Examples:
        >>> import torch.distributed as dist, attnkit.distributed as akd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> x = torch.arange(8.0).view(1, 1, 8, 1)  # (B, H, L, D): row i holds i
        >>> akd.shard(x).flatten().tolist()  # a world of 1: rank 0 holds every row
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
        >>> torch.equal(akd.unshard(akd.shard(x, "contiguous"), "contiguous"), x)
        True
        >>> dist.destroy_process_group()
    """
    g = group_of(group)
    lay = Layout.of(layout, g.size, x.shape[dim])
    return torch.cat([x.narrow(dim, a, b - a) for a, b in lay.chunks(g.rank)], dim)


def unshard(x_local: Tensor, layout: str = "zigzag", group: Any = None, *, dim: int = 2) -> Tensor:
    """The full tensor on every rank from each rank's rows along `dim` (`shard` undone).

    Differentiable as a replica: every rank holds the same full tensor, so the gradient
    of this rank's rows is the gradient of the full tensor at them.

    Args:
        x_local: this rank's rows, e.g. an output (B, H, L/P, Dv).
        layout: the layout `x_local` was sharded in (default "zigzag").
        group: the process group (default None: the default group); P = its size.
        dim: the sequence dim (default 2).

    Returns:
        The full tensor, L = P · L/P rows at `dim` in global order, on every rank.

    Raises:
        RuntimeError: no initialized process group.
        ValueError: an unknown layout.

    Examples:
        >>> import torch.distributed as dist, attnkit.distributed as akd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> x = torch.randn(2, 3, 8, 4, requires_grad=True)  # (B, H, L, D)
        >>> full = akd.unshard(akd.shard(x))
        >>> torch.equal(full, x)
        True
        >>> full.sum().backward()  # gradients flow back to the rows
        >>> bool((x.grad == 1).all())
        True
        >>> dist.destroy_process_group()
    """
    g = group_of(group)
    out: Tensor = apply(_Unshard, x_local, g, layout, dim)
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

    Every rank calls it with its rows and the same global mask; the ranks agree on the
    problem first (one small collective), then exchange only the keys some query sees.

    Args:
        q: (B, H, L/P, D) this rank's query rows (`shard` of the full q) in `layout`.
        k: (B, Hkv, L/P, D) its key rows, q's dtype; H % Hkv == 0.
        v: (B, Hkv, L/P, Dv) its value rows.
        mask: the global mask over global positions (a `Mask` or a bool tensor over
            (B, H, L, L)), the same on every rank; its tensors (document ids, lengths)
            are the global ones (default None: every key visible).
        group: the process group (default None: the default group); P = its size.
        layout: "zigzag" (rank r holds chunks r and 2P-1-r of 2P: balanced causal work)
            or "contiguous" (rank r holds rows r·L/P .. (r+1)·L/P - 1) (default "zigzag").
        strategy: "ring", "allgather", "ulysses" (Hkv % P == 0) or "auto" (default:
            `explain` says which and why).
        scale: multiplies q·kᵀ (default None: 1/√D).
        softcap: if set, scores become `c·tanh(s/c)` (default None).

    Returns:
        (B, H, L/P, Dv): this rank's rows of the output, in q's dtype.

    Raises:
        RuntimeError: no initialized process group.
        RanksDisagreeError: ranks passing different masks, shapes or options (on
            every rank, naming them).
        ShapeContractError: shapes that do not fit, or an L/P that does not split.
        ValueError: an unknown layout or strategy, or one that cannot serve the call.

    Examples:
        >>> import torch.distributed as dist, attnkit.distributed as akd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))  # full (B, H, L, D)
        >>> out = akd.attention(akd.shard(q), akd.shard(k), akd.shard(v), ak.causal())
        >>> out.shape  # this rank's rows: L/P = 8 in a world of 1
        torch.Size([1, 2, 8, 4])
        >>> torch.allclose(akd.unshard(out), ak.attention(q, k, v, ak.causal()), atol=1e-6)
        True
        >>> dist.destroy_process_group()
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
    """`attention` and the log-sum-exp of this rank's rows.

    Args:
        q: (B, H, L/P, D) this rank's query rows.
        k: (B, Hkv, L/P, D) its key rows.
        v: (B, Hkv, L/P, Dv) its value rows.
        mask: the global mask, as in `attention`.
        group: as in `attention`.
        layout: as in `attention`.
        strategy: as in `attention`.
        scale: as in `attention`.
        softcap: as in `attention`.

    Returns:
        `(out, lse)`: out (B, H, L/P, Dv) in q's dtype, and lse (B, H, L/P) float32
        (float64 for float64), as `attnkit.attention_with_lse` gives it (-inf where a
        row sees nothing).

    Raises:
        RuntimeError: no initialized process group.
        RanksDisagreeError: ranks passing different problems.
        ShapeContractError: shapes that do not fit.
        ValueError: an unknown layout or strategy, or one that cannot serve the call.

    Examples:
        >>> import torch.distributed as dist, attnkit.distributed as akd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> q = torch.randn(1, 2, 8, 4)  # (B, H, L, D), self-attention
        >>> out, lse = akd.attention_with_lse(q, q, q, ak.causal())
        >>> lse.shape  # (B, H, L/P)
        torch.Size([1, 2, 8])
        >>> torch.allclose(lse, ak.attention_with_lse(q, q, q, ak.causal())[1], atol=1e-6)
        True
        >>> dist.destroy_process_group()
    """
    g = group_of(group)
    global_call, plan = agreed(q, k, v, mask, g, layout, strategy, scale, softcap)
    return run_strategy(plan.strategy, global_call, g, plan.needs, q, k, v)


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
) -> tuple[GlobalCall, ContextPlan]:
    """The problem and plan of a call once every rank has validated its own and all pass
    the same (`agree`: one small collective, before any traffic)."""

    def validate() -> tuple[GlobalCall, ContextPlan]:
        global_call = _global_call(q, k, v, mask, g, layout, scale, softcap)
        return global_call, _plan(global_call, g, strategy, q, k, v, detail=False)

    return agree(
        g,
        validate,
        shards={"q": q, "k": k, "v": v},
        shared={
            "mask": mask,
            "layout": layout,
            "strategy": strategy,
            "scale": scale,
            "softcap": softcap,
        },
    )


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
    """What `attention` would do on this rank, computed without running it: the
    strategy, the bytes each strategy would send, which (rank, shard) pairs are skipped
    and the work against each shard. `print` it for a table.

    Args:
        q: (B, H, L/P, D) this rank's query rows.
        k: (B, Hkv, L/P, D) its key rows.
        v: (B, Hkv, L/P, Dv) its value rows.
        mask: the global mask, as in `attention`.
        group: as in `attention`.
        layout: as in `attention`.
        strategy: as in `attention`.
        scale: as in `attention`.
        softcap: as in `attention`.

    Returns:
        A `ContextPlan` of this rank.

    Raises:
        RuntimeError: no initialized process group.
        ShapeContractError: shapes that do not fit.
        ValueError: an unknown layout or strategy, or one that cannot serve the call.

    Examples:
        >>> import torch.distributed as dist, attnkit.distributed as akd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> q = torch.randn(1, 2, 8, 4)  # (B, H, L/P, D)
        >>> plan = akd.explain(q, q, q, ak.causal(), strategy="ring")
        >>> plan.strategy, plan.world_size, plan.needs  # r's queries see s's keys: needs[r][s]
        ('ring', 1, [[True]])
        >>> plan.pairs  # query-key pairs against each shard: 1 + 2 + ... + 8
        [36]
        >>> dist.destroy_process_group()
    """
    g = group_of(group)
    return _plan(_global_call(q, k, v, mask, g, layout, scale, softcap), g, strategy, q, k, v)


def _plan(
    global_call: GlobalCall,
    g: Group,
    strategy: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    detail: bool = True,
) -> ContextPlan:
    kv_bytes = (
        k.numel() * k.element_size() * (global_call.D + global_call.Dv) // max(1, global_call.D)
    )
    out_bytes = q.numel() // max(1, global_call.D) * (global_call.Dv * q.element_size() + 4)
    q_bytes = q.numel() * q.element_size()
    return plan_context(global_call, g.rank, strategy, kv_bytes, q_bytes, out_bytes, detail=detail)


def _global_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None,
    g: Group,
    layout: str,
    scale: float | None,
    softcap: float | None,
) -> GlobalCall:
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
    return GlobalCall(the_mask, d.B, d.H, d.Hkv, d.D, d.Dv, lay, scale, softcap)
