"""Running a planned call on its backend: what every run of `Prepared`, the compiled op and
the context-parallel pieces share.

Two promises of DESIGN §2 are kept here, for every backend alike: a non-finite key or
value reaches only the rows that see its key (`run_backend`: where a backend's kernel
multiplies hidden weights by values, one cheap check of K and V, and
`visibility.run_masking_values` where it finds one), and a call whose rows see no key
is all zeros, still joined to q, k, v with zero gradients (`execute`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnkit._compat import apply
from attnkit.backends import Backend
from attnkit.call.precision import compute_dtype
from attnkit.call.visibility import all_finite, may_leak, run_masking_values
from attnkit.contracts import AttentionCall

__all__ = ["execute", "run_backend"]


def execute(
    call: AttentionCall, backend: Backend | None, *, need_lse: bool, finite: bool | None = None
) -> tuple[Tensor, Tensor | None]:
    """Run `backend` on `call` (None: an empty call, all zeros) and join a result that no
    input reaches (no query sees a key) to q, k, v with zero gradients. `finite`: what
    the check of K and V already found (`run_backend`)."""
    if backend is None:
        d = call.dims
        out = call.q.new_zeros(d.B, d.H, d.L, d.Dv)
        lse: Tensor | None = call.q.new_full(
            (d.B, d.H, d.L), -math.inf, dtype=compute_dtype(call.q.dtype)
        )
    else:
        out, lse = run_backend(call, backend, need_lse=need_lse, finite=finite)
    if out.requires_grad or not torch.is_grad_enabled():
        return out, lse
    if not any(t.requires_grad for t in (call.q, call.k, call.v)):
        return out, lse
    joined: tuple[Tensor, Tensor | None] = apply(_Constant, out, lse, call.q, call.k, call.v)
    return joined


def run_backend(
    call: AttentionCall, backend: Backend, *, need_lse: bool, finite: bool | None = None
) -> tuple[Tensor, Tensor | None]:
    """`backend.run(call)`, a non-finite key or value reaching only the rows that see it:
    where the backend's kernel would let it reach others, and the one cheap check finds
    one (`finite`: its answer where a caller has it), through
    `visibility.run_masking_values`."""
    if finite is None:
        leaks = None if backend.values_exact else may_leak(call)
        finite = leaks is None or all_finite(call.k, call.v, leaks)
    if finite:
        return backend.run(call, need_lse=need_lse)
    return run_masking_values(call, lambda masked: backend.run(masked, need_lse=need_lse))


class _Constant(torch.autograd.Function):
    """A result that does not depend on q, k, v, joined to them with zero gradients."""

    @staticmethod
    def forward(
        ctx: Any, out: Tensor, lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in (q, k, v)]
        return out.clone(), None if lse is None else lse.clone()

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        zeros = [torch.zeros(s, dtype=t, device=d) for s, t, d in ctx.inputs]
        return (None, None, *zeros)
