"""attnkit inside `torch.compile`: the kernel boundary as `torch.library` custom ops.

Tracing cannot follow attnkit's planning: it reads mask tensors and sizes as data
(tile plans, seen rows). So a compiled `attention` call becomes one opaque op,
`attnkit::attention_forward`, whose implementation validates, plans and runs eagerly,
exactly as an eager call does; its fake implementation gives the results' shapes and
dtypes from the inputs' alone, and its autograd formula is a second op,
`attnkit::attention_gradients`. The op's states are explicit: the log-sum-exp is asked
for by its arguments (`need_lse` or `requires_grad`), and whether the backend gave one
for the backward comes back as an output of its own (`lse_kept`). The mask crosses the
boundary as a string and its tensors (`masks.spec`), so masks that hold no tensors
compile with `fullgraph=True`, and masks that do (key_padding, document) too: their
tensors are op inputs.

The backward op takes the gradients from the forward's output and kept log-sum-exp in
one fused backward where it can (`gradients.fused_gradients`), else it reruns the
forward with autograd (one more forward pass). Calls the op cannot express run eagerly within the
compiled code (a graph break): dropout (a recomputed forward would draw another mask),
float masks that require grad (the op gives mask tensors no gradient) and masks built by
`Mask.from_mod` (a Python function cannot cross as a string).

The forward op is `attention_forward(q, k, v, mask_tensors, mask_spec, backend, scale,
softcap, need_lse, requires_grad) -> (out, lse, lse_kept)`; its fake implementation
checks static shapes as the eager call does and gives (B, H, L, Dv), (B, H, L) (lse in
the compute dtype; `(0,)` when neither `need_lse` nor `requires_grad` asks for one) and
a bool scalar. The backward op, `attention_gradients(dout, dlse, out, lse, lse_kept, q,
k, v, ...)`, takes the fused backward of the backend that ran the forward where it
serves (the one `auto` priced the call with: the native kernel's, one CPU flash backward
for calls whose kernel needs no mask, tiled's blockwise one), else another's, each exact
for any backend's forward from out and lse; without a kept lse, on GPU, with D != Dv,
softcap or a scale <= 0 it reruns the eager call with autograd in a worker thread (an
op's implementation runs with autograd's dispatch keys excluded). Both ops pass
`torch.library.opcheck`.

Maintainers: PyTorch's AOT cache keys a compiled graph by the forward, not by the
structure our Python autograd formula traces to; a change of the backward op's arguments
or of its outputs' layout needs a new op name (or users' caches serve the old call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from attnkit._compat import eager
from attnkit.call.dispatch import attention_call, prepared_call
from attnkit.call.execute import execute, run_backend
from attnkit.call.gradients import fused_gradients, serves
from attnkit.call.precision import compute_dtype
from attnkit.call.prepared import Prepared
from attnkit.call.threads import in_fresh_thread
from attnkit.contracts import _check_shapes, unit_last_stride
from attnkit.masks import Mask
from attnkit.masks.spec import decode, encodable, encode

R = TypeVar("R")

__all__ = ["attention_backward_op", "attention_op", "traced_attention"]


def traced_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None,
    *,
    scale: float | None,
    softcap: float | None,
    dropout_p: float,
    backend: str,
    need_lse: bool,
) -> tuple[Tensor, Tensor]:
    """What `attention_with_lse` does while dynamo traces: one `attnkit::attention` op."""
    if not _op_can_express(mask, scale, softcap, dropout_p, backend):
        result: tuple[Tensor, Tensor] = _run_eagerly(
            q, k, v, mask, scale, softcap, dropout_p, backend, need_lse
        )
        return result
    tensors: list[Tensor] = []
    spec = encode(mask, tensors)
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    scale = None if scale is None else float(scale)
    softcap = None if softcap is None else float(softcap)
    out, lse, _ = attention_op(
        q, k, v, tensors, spec, backend, scale, softcap, need_lse, requires_grad
    )
    return out, lse


def _is_number(x: object) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))


def _op_can_express(
    mask: object, scale: object, softcap: object, dropout_p: object, backend: object
) -> bool:
    if not (mask is None or isinstance(mask, (Mask, Tensor))):
        return False  # the eager call raises its TypeError
    if isinstance(mask, Tensor) and mask.requires_grad:
        return False
    if not encodable(mask):  # a from_mod function cannot cross as a string
        return False
    return (
        _is_number(scale)
        and _is_number(softcap)
        and isinstance(backend, str)
        and (dropout_p == 0 and _is_number(dropout_p))
    )


@eager
def run_eagerly(fn: Callable[..., R], *args: Any) -> R:
    """`fn(*args)` run eagerly inside `torch.compile`d code: a graph break around it."""
    return fn(*args)


@eager
def _run_eagerly(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Any,
    scale: Any,
    softcap: Any,
    dropout_p: Any,
    backend: Any,
    need_lse: bool,
) -> tuple[Tensor, Tensor]:
    out, lse = attention_call(
        q,
        k,
        v,
        mask,
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        backend=backend,
        need_lse=need_lse,
        check_bias=False,
    )  # a compiled call never reads a float mask's values (nor does `sdpa`)
    return out, _lse_or_empty(lse, q)


def _lse_or_empty(lse: Tensor | None, q: Tensor) -> Tensor:
    """The call's log-sum-exp, or (0,) where it was not asked for."""
    return q.new_empty(0, dtype=compute_dtype(q.dtype)) if lse is None else lse


def _prepared(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None,
    backend: str,
    scale: float | None,
    softcap: float | None,
    need_lse: bool,
    grad: bool,
) -> Prepared:
    """The op's prepared call (through `attention()`'s cache), planned as an eager call
    of inputs requiring grad (`grad`) or not would be: each op call of a compiled step
    plans once."""
    return prepared_call(
        q,
        k,
        v,
        mask,
        scale=scale,
        softcap=softcap,
        dropout_p=0.0,
        backend=backend,
        need_lse=need_lse,
        check_bias=False,
        grad=grad,
    )


@torch.library.custom_op("attnkit::attention_forward", mutates_args=())
def attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_tensors: list[Tensor],
    mask_spec: str,
    backend: str,
    scale: float | None,
    softcap: float | None,
    need_lse: bool,
    requires_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """out (B, H, L, Dv), lse (B, H, L) and lse_kept (a bool scalar); lse is (0,) when
    neither `need_lse` nor `requires_grad` asks for it.

    `requires_grad` says whether the traced inputs required grad: the backend is chosen
    as for that eager call (some serve no gradient), and the log-sum-exp is kept for the
    backward op where the backend can give it (`lse_kept`; else the backward recomputes
    and lse holds zeros).
    """
    mask = decode(mask_spec, mask_tensors)
    prepared = _prepared(q, k, v, mask, backend, scale, softcap, need_lse, requires_grad)
    call, chosen = prepared.call(q, k, v, mask), prepared.backend
    if chosen is None:  # nothing to compute
        out, lse = execute(call, None, need_lse=True)
        kept = True
    else:
        # keep the log-sum-exp for the backward op where it can use it (no second forward)
        kept = prepared.plan_values.get(
            "compiled.keep",
            lambda: (
                need_lse
                or (
                    requires_grad
                    and serves(call, scale)
                    and chosen.can_use(call, need_lse=True) is None
                )
            ),
        )
        with torch.no_grad():
            out, lse = run_backend(call, chosen, need_lse=kept)
        if requires_grad and not kept:
            lse = q.new_zeros(q.shape[:3], dtype=compute_dtype(q.dtype))
    lse_kept = torch.tensor(kept and requires_grad, device=q.device)
    return _fresh(out, (q, k, v)), _fresh(_lse_or_empty(lse, q), (q, k, v)), lse_kept


def _fresh(t: Tensor, inputs: tuple[Tensor, ...]) -> Tensor:
    """`t`, contiguous and sharing no storage with the op's inputs (ops may not alias)."""
    t = t.contiguous()
    storages = {x.untyped_storage().data_ptr() for x in inputs if x.numel()}
    return t.clone() if t.numel() and t.untyped_storage().data_ptr() in storages else t


@attention_op.register_fake
def _attention_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_tensors: list[Tensor],
    mask_spec: str,
    backend: str,
    scale: float | None,
    softcap: float | None,
    need_lse: bool,
    requires_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    sizes = (*q.shape, *k.shape, *v.shape)
    if all(isinstance(n, int) for n in sizes):  # symbolic sizes: checked when it runs
        _check_shapes(q.shape, k.shape, v.shape, minimum=0)  # the eager call's errors
    B, H, L, _ = q.shape
    lse_shape = (B, H, L) if need_lse or requires_grad else (0,)
    return (
        q.new_empty(B, H, L, v.shape[-1]),
        q.new_empty(lse_shape, dtype=compute_dtype(q.dtype)),
        q.new_empty((), dtype=torch.bool),
    )


@torch.library.custom_op("attnkit::attention_gradients", mutates_args=())
def attention_backward_op(
    dout: Tensor,
    dlse: Tensor,
    out: Tensor,
    lse: Tensor,
    lse_kept: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_tensors: list[Tensor],
    mask_spec: str,
    backend: str,
    scale: float | None,
    softcap: float | None,
    need_lse: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of `attnkit::attention_forward`: from the forward's `out` and `lse`
    (one fused backward) where it kept one and a fused backward takes the call, else
    the eager call rerun with autograd."""
    mask = decode(mask_spec, mask_tensors)
    prepared = _prepared(q, k, v, mask, backend, scale, softcap, need_lse, True)
    call = prepared.call(q, k, v, mask)
    lse_grad = dlse if need_lse and dlse.numel() else None
    grads = None
    if bool(lse_kept) and serves(call, scale):  # the forward's backend first
        grads = fused_gradients(call, out, lse, dout, lse_grad, prepared.backend)
    if grads is None:  # no lse kept, or a call the fused backward cannot take

        def recompute() -> tuple[Tensor | None, ...]:
            lq, lk, lv = leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            with torch.enable_grad():
                out, lse = attention_call(
                    lq,
                    lk,
                    lv,
                    mask,
                    scale=scale,
                    softcap=softcap,
                    dropout_p=0.0,
                    backend=backend,
                    need_lse=need_lse,
                    check_bias=False,
                )
                outputs, grads = [out], [dout]
                if need_lse and lse is not None and dlse.numel():
                    outputs.append(lse)
                    grads.append(dlse)
                return torch.autograd.grad(outputs, leaves, grads, allow_unused=True)

        recomputed = in_fresh_thread(recompute)  # it enables autograd there
        dq, dk, dv = (
            torch.zeros_like(x) if g is None else g
            for g, x in zip(recomputed, (q, k, v), strict=True)
        )
        grads = dq, dk, dv
    return _fresh(grads[0], (q, k, v)), _fresh(grads[1], (q, k, v)), _fresh(grads[2], (q, k, v))


@attention_backward_op.register_fake
def _attention_backward_fake(
    dout: Tensor,
    dlse: Tensor,
    out: Tensor,
    lse: Tensor,
    lse_kept: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_tensors: list[Tensor],
    mask_spec: str,
    backend: str,
    scale: float | None,
    softcap: float | None,
    need_lse: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    # contiguous, as the implementation returns them (whatever the inputs' strides)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, mask_tensors, mask_spec, backend, scale, softcap, need_lse, _ = inputs
    out, lse, lse_kept = output
    ctx.save_for_backward(q, k, v, out, lse, lse_kept, *mask_tensors)
    ctx.args = (mask_spec, backend, scale, softcap, need_lse)


def _backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None, _: Any) -> tuple[Any, ...]:
    q, k, v, out, lse, lse_kept, *mask_tensors = ctx.saved_tensors
    dout = torch.zeros_like(q[..., :1]).expand(*q.shape[:-1], v.shape[-1]) if dout is None else dout
    dlse = q.new_zeros(0, dtype=compute_dtype(q.dtype)) if dlse is None else dlse
    dq, dk, dv = attention_backward_op(
        unit_last_stride(dout), dlse, out, lse, lse_kept, q, k, v, mask_tensors, *ctx.args
    )
    no_grads = [None] * len(mask_tensors)  # the structure of the inputs: a list there
    return dq, dk, dv, no_grads, None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)
