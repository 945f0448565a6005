"""attnkit inside `torch.compile`: the kernel boundary as `torch.library` custom ops.

Tracing cannot follow attnkit's planning: it reads mask tensors and sizes as data
(tile plans, seen rows). So a compiled `attention` call becomes one opaque op,
`attnkit::attention`, whose implementation validates, plans and runs eagerly, exactly
as an eager call does; its fake implementation gives the result's shape and dtype from
the inputs' alone, and its autograd formula is a second op,
`attnkit::attention_backward`. The mask crosses the boundary as a string and its
tensors (`masks.spec`), so masks that hold no tensors compile with `fullgraph=True`,
and masks that do (key_padding, document) too: their tensors are op inputs.

The backward op recomputes the forward with autograd (one more forward pass per
backward) and gives its gradients. Calls the op cannot express run eagerly within the
compiled code (a graph break): dropout (a recomputed forward would draw another mask),
float masks that require grad (the op gives mask tensors no gradient) and masks built by
`Mask.from_mod` (a Python function cannot cross as a string).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import torch
from torch import Tensor

from attnkit.backends import BACKENDS, Backend
from attnkit.bounded import Bounded
from attnkit.contracts import AttentionCall, _check_shapes, normalize_call, unit_last_stride
from attnkit.dispatch import run
from attnkit.gradients import fused_gradients, serves
from attnkit.masks import Mask
from attnkit.masks.spec import decode, encodable, encode
from attnkit.planner import backend_for_run
from attnkit.precision import HALF, compute_dtype, kernel_dtype
from attnkit.threads import in_fresh_thread

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
    out, lse = attention_op(
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


@torch.compiler.disable  # type: ignore[untyped-decorator]
def run_eagerly(fn: Callable[..., R], *args: Any) -> R:
    """`fn(*args)` run eagerly inside `torch.compile`d code: a graph break around it."""
    return fn(*args)


@torch.compiler.disable  # type: ignore[untyped-decorator]
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
    call = normalize_call(q, k, v, mask, scale=scale, softcap=softcap, dropout_p=dropout_p)
    out, lse = run(call, backend, need_lse=need_lse)
    return out, _lse_or_empty(lse, q)


class Lse(enum.Enum):
    """What the op's lse output holds. A custom op returns tensors only, so the state
    travels in the tensor itself; `_lse_output` writes it and `_lse_state` reads it, and
    nothing else looks at the tensor's shape or values for it."""

    NOT_ASKED = "neither need_lse nor requires_grad: shape (0,)"
    KEPT = "the call's log-sum-exp, (B, H, L)"
    NOT_KEPT = "the backend gave none: (B, H, L) of +inf; the backward reruns the call"


def _lse_output(state: Lse, lse: Tensor | None, q: Tensor) -> Tensor:
    """The op's lse tensor for `state` (`lse`: the backend's, where it is KEPT)."""
    work = compute_dtype(q.dtype)
    if state is Lse.NOT_ASKED:
        return q.new_empty(0, dtype=work)
    if state is Lse.NOT_KEPT:
        return q.new_full(q.shape[:3], torch.inf, dtype=work)  # no log-sum-exp is +inf
    assert lse is not None
    return lse


def _lse_state(lse: Tensor) -> Lse:
    """The state `_lse_output` wrote (a kept lse is never +inf: -inf is a row that sees
    nothing)."""
    if lse.numel() == 0:
        return Lse.NOT_ASKED
    return Lse.NOT_KEPT if bool(torch.isposinf(lse).any()) else Lse.KEPT


def _lse_or_empty(lse: Tensor | None, q: Tensor) -> Tensor:
    return _lse_output(Lse.NOT_ASKED if lse is None else Lse.KEPT, lse, q)


def _call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_tensors: list[Tensor],
    mask_spec: str,
    scale: float | None,
    softcap: float | None,
) -> AttentionCall:
    mask = decode(mask_spec, mask_tensors)
    return normalize_call(q, k, v, mask, scale=scale, softcap=softcap)


@torch.library.custom_op("attnkit::attention", mutates_args=())
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
) -> tuple[Tensor, Tensor]:
    """out (B, H, L, Dv) and lse (B, H, L); lse is empty when neither `need_lse` nor
    `requires_grad` asks for it.

    `requires_grad` says whether the traced inputs required grad: the backend is chosen
    as for that eager call (some serve no gradient), and the log-sum-exp is kept for the
    backward op (+inf where the backend could not give it: the backward then recomputes).
    """
    call = _call(q, k, v, mask_tensors, mask_spec, scale, softcap)
    if call.is_empty:
        out, lse = run(call, backend, need_lse=need_lse)
    else:
        chosen, keep = _op_plan(call, mask_tensors, mask_spec, backend, scale, need_lse,
                                requires_grad)  # fmt: skip
        with torch.no_grad():
            out, lse = chosen.run(call, need_lse=keep)
        if requires_grad and not keep:
            lse = _lse_output(Lse.NOT_KEPT, None, q)
    return _fresh(out, (q, k, v)), _fresh(_lse_or_empty(lse, q), (q, k, v))


def _op_plan(
    call: AttentionCall,
    mask_tensors: list[Tensor],
    mask_spec: str,
    backend: str,
    scale: float | None,
    need_lse: bool,
    requires_grad: bool,
) -> tuple[Backend, bool]:
    """The backend an eager call of inputs requiring grad (or not) would take, and whether
    to keep the log-sum-exp for the backward op (where it can use it: no second forward).
    Kept per (mask spec, its tensors' identity, version and size, sizes, dtype, device,
    options, flex's state): each op call of a compiled step plans once."""
    q, k, v = call.q, call.k, call.v
    key = (
        mask_spec, tuple((t.data_ptr(), t._version, t.shape) for t in mask_tensors),
        q.shape, k.shape, v.shape, q.dtype, q.device, backend, scale, call.softcap,
        need_lse, requires_grad, BACKENDS["flex"].version,
        kernel_dtype(q.dtype, q.device) if q.dtype in HALF else None,
    )  # fmt: skip
    found = _OP_PLANS.get(key)
    if found is None:
        wanted = replace(call, q=q.detach().requires_grad_()) if requires_grad else call
        chosen = backend_for_run(wanted, backend, need_lse=need_lse)
        keep = need_lse or (
            requires_grad and serves(call, scale) and chosen.can_use(call, need_lse=True) is None
        )
        found = _OP_PLANS.put(key, (chosen, keep))
    return found


OP_PLANS_KEPT = 64
_OP_PLANS: Bounded[tuple[object, ...], tuple[Backend, bool]] = Bounded(OP_PLANS_KEPT)


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
) -> tuple[Tensor, Tensor]:
    sizes = (*q.shape, *k.shape, *v.shape)
    if all(isinstance(n, int) for n in sizes):  # symbolic sizes: checked when it runs
        _check_shapes(q.shape, k.shape, v.shape, minimum=0)  # the eager call's errors
    B, H, L, _ = q.shape
    lse_shape = (B, H, L) if need_lse or requires_grad else (0,)
    return q.new_empty(B, H, L, v.shape[-1]), q.new_empty(lse_shape, dtype=compute_dtype(q.dtype))


@torch.library.custom_op("attnkit::attention_backward", mutates_args=())
def attention_backward_op(
    dout: Tensor,
    dlse: Tensor,
    out: Tensor,
    lse: Tensor,
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
    """dq, dk, dv of `attnkit::attention`: blockwise from the forward's `out` and `lse`
    (tiled's backward) where it can, else the eager call rerun with autograd."""
    call = _call(q, k, v, mask_tensors, mask_spec, scale, softcap)
    lse_grad = dlse if need_lse and dlse.numel() else None
    grads = None
    if _lse_state(lse) is Lse.KEPT and serves(call, scale):
        grads = fused_gradients(call, out, lse, dout, lse_grad)
    if grads is None:  # no lse kept, or a call the fused backward cannot take

        def recompute() -> tuple[Tensor | None, ...]:
            lq, lk, lv = leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            with torch.enable_grad():
                call = _call(lq, lk, lv, mask_tensors, mask_spec, scale, softcap)
                out, lse = run(call, backend, need_lse=need_lse)
                outputs, grads = [out], [dout]
                if need_lse and lse is not None and dlse.numel():
                    outputs.append(lse)
                    grads.append(dlse)
                return torch.autograd.grad(outputs, leaves, grads, allow_unused=True)

        found = in_fresh_thread(recompute)  # it enables autograd there
        dq, dk, dv = (
            torch.zeros_like(x) if g is None else g for g, x in zip(found, (q, k, v), strict=True)
        )
        grads = dq, dk, dv
    return _fresh(grads[0], (q, k, v)), _fresh(grads[1], (q, k, v)), _fresh(grads[2], (q, k, v))


@attention_backward_op.register_fake
def _attention_backward_fake(
    dout: Tensor,
    dlse: Tensor,
    out: Tensor,
    lse: Tensor,
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
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *mask_tensors)
    ctx.args = (mask_spec, backend, scale, softcap, need_lse)


def _backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse, *mask_tensors = ctx.saved_tensors
    dout = torch.zeros_like(q[..., :1]).expand(*q.shape[:-1], v.shape[-1]) if dout is None else dout
    dlse = q.new_zeros(0, dtype=compute_dtype(q.dtype)) if dlse is None else dlse
    dq, dk, dv = attention_backward_op(
        unit_last_stride(dout), dlse, out, lse, q, k, v, mask_tensors, *ctx.args
    )
    no_grads = [None] * len(mask_tensors)  # the structure of the inputs: a list there
    return dq, dk, dv, no_grads, None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)
