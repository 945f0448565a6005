"""Dispatch: one attention call from its arguments to a result, through the runtime's
cache of prepared calls (`attnkit.runtime`: `Runtime.calls`).

The first call of a kind is prepared (`prepared.prepare_call`: validated, planned, the
backend's kernel made) and kept under its key (`prepared.key`); a repeated call -- each
layer of a decoding step, each step of a loop of fixed sizes -- costs that key, one
lookup and the kernel, and a prepared call is never served stale (the key holds the
identity and version of the mask's tensors).

Prepared calls are calls per mask (`by_mask.ByMask`: a mask by its object or, built
anew, by its value with its tensors' identity; held weakly: they go when the mask or
its tensors go), at most `runtime.PREPARED_PER_MASK` each, and never hold the mask or q, k, v
themselves.

A decoding step (`attnkit.call.steps`: few queries, a mask that sees every key but key
padding) is planned once per bucket of S, the power of two at or above it: its plan is
kept under a key without the mask or S (`_step_key`, beside the calls without a mask)
and serves the next steps of a growing cache (one more key, a new mask object each
step: transformers builds one per forward) with no validation or planning but its own
checks. A *dense* step (every key seen: bottom-right causal at L = 1; no mask) runs its
plan's unmasked kernel whatever the mask; a *padded* step makes its call from the mask
it is given and runs it on its plan's backend (`Prepared.at_length`), where that backend
can serve it. The backend of a step is chosen by a rule that reads S only by its
bucket (`Backend.takes_step`), so a plan made afresh chooses the backend that served it.

Bounds: `runtime.PREPARED_PER_MASK` fits per mask, four times that for calls without a mask, and
`by_mask.STRUCTURES_KEPT` masks found by value. The step key checks only what it
leaves out: S >= 1, the same S in k and v, and the mask's own check. The compiled op and
the context-parallel pieces' backward take their calls from this cache too (the op's
implementation plans as if autograd recorded: `grad=`). The planner computes only the
reasons a call needs; `explain` asks for all of them.

`StepCalls` prepares a step once: the first layer's prepared call is run by every later
layer whose inputs are of the same kind, with no key (the transformers bridge keeps one
on the mask object a forward shares, a paged `Step` one per prefilling sequence).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit import runtime
from attnkit.call.by_mask import ByMask, MaskTensors
from attnkit.call.key import CallKey, Options, call_key, inputs_key, named_tuple
from attnkit.call.planner import step_order
from attnkit.call.prepared import Prepared, prepare_call
from attnkit.call.steps import StepKind, bucket, step_kind
from attnkit.contracts import normalize_call
from attnkit.masks import Mask
from attnkit.runtime import MaskCalls

__all__ = ["StepCalls", "attention_call", "clear", "prepared_call"]

MaskArg = Mask | Tensor | None


def attention_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: MaskArg,
    *,
    scale: float | None,
    softcap: float | None,
    dropout_p: float,
    backend: str,
    need_lse: bool,
    check_bias: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """`attention_with_lse` without sinks, eagerly: the prepared call if one is cached.
    `check_bias`: a float mask's values are checked at its first call (not by `sdpa`)."""
    options = named_tuple(Options, (scale, softcap, dropout_p, backend, need_lse, check_bias))
    return _lookup(q, k, v, mask, options, None, True).run(q, k, v, mask)


class StepCalls:
    """The calls of one step of a model: prepared by its first layer, run by the others.

    Every layer of a forward attends with the same mask and inputs of the same kind; a
    place (a forward's mask, a sequence of a paged step) keeps the prepared call of its
    first call and runs it for later inputs of the same sizes, strides, dtypes, devices,
    grad mode and options -- no key, no lookup (a tensor of the mask changed in place is
    prepared again). The caller keeps the object for one step and names places whose
    mask is the same for the step (the first call's is run)."""

    def __init__(self) -> None:
        # place -> (inputs' kind, the prepared call, its mask, the mask's tensors, their state)
        self._calls: dict[
            object, tuple[tuple[object, ...], Prepared, MaskArg, MaskTensors, tuple[object, ...]]
        ] = {}

    def run(
        self,
        place: object,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: MaskArg,
        *,
        scale: float | None,
        softcap: float | None,
        dropout_p: float,
        backend: str = "auto",
    ) -> Tensor:
        """`attention(q, k, v, mask, ...)` through the place's prepared call."""
        options = named_tuple(Options, (scale, softcap, dropout_p, backend, False, True))
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        kind = (inputs_key(q, k, v), grad, options)
        entry = self._calls.get(place)
        if (
            entry is None
            or entry[0] != kind
            or type(q) is not Tensor
            or (entry[3].has_tensors and entry[3].state() != entry[4])  # changed in place
        ):
            tensors = MaskTensors(mask)
            entry = (
                kind,
                _lookup(q, k, v, mask, options, None, True),
                mask,
                tensors,
                tensors.state(),
            )
            self._calls[place] = entry
        return entry[1].run(q, k, v, entry[2])[0]


def prepared_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: MaskArg,
    *,
    scale: float | None,
    softcap: float | None,
    dropout_p: float,
    backend: str,
    need_lse: bool,
    check_bias: bool = True,
    grad: bool | None = None,
) -> Prepared:
    """The prepared call of these arguments: cached, or validated, planned and kept.
    `grad`: planned as if autograd records (None: whether it does; the compiled op's
    implementation runs with autograd below it)."""
    options = named_tuple(Options, (scale, softcap, dropout_p, backend, need_lse, check_bias))
    return _lookup(q, k, v, mask, options, grad, False)


def _lookup(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: MaskArg,
    options: Options,
    grad: bool | None,
    any_length_ok: bool,
) -> Prepared:
    """`prepared_call`; `any_length_ok`: a decoding step may be served by the plan of a
    step of its bucket (then only `run` it: a dense step's sizes are another's). A step
    planned here serves the later steps of its bucket either way."""
    plain = type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
    step_mask = mask if isinstance(mask, Mask) else None
    steps = plain and grad is None and (mask is None or step_mask is not None)
    # the steps' plans, kept beside the calls without a mask
    by_mask = runtime.current().calls  # the prepared calls, by mask
    step_plans = by_mask.of(None).plans
    kind: StepKind = "dense"
    step = _step_key(q, k, v, step_mask, options, kind) if steps else None
    step_plan: Prepared | None = None
    if step is not None and any_length_ok:
        step_plan = step_plans.get(step)
    if step_plan is not None:  # a dense step: the kernel of its bucket
        return step_plan
    calls = _calls_of(by_mask, mask) if plain else None
    plans = None if calls is None else calls.plans
    key = None
    if calls is not None:
        key = call_key(q, k, v, q.shape, k.shape, v.shape, calls.state(), options, grad)
    prepared: Prepared | None = None if plans is None or key is None else plans.get(key)
    if prepared is None and steps and step is None:  # a padded step: its bucket's backend
        kind = "padded"
        step = _step_key(q, k, v, step_mask, options, kind)
        step_plan = step_plans.get(step) if step is not None and any_length_ok else None
        if step_plan is not None:
            prepared = step_plan.at_length(q, k, v, step_mask)
        if prepared is not None:
            if plans is not None and key is not None:
                plans.put(key, prepared)
            return prepared
    if prepared is None:
        prepared = _prepared(q, k, v, mask, options, key, grad)
        if plans is not None and key is not None:
            plans.put(key, prepared)
    if step is not None and _serves_steps(prepared, kind, q, k, v, mask):
        step_plans.put(step, prepared)  # the steps of its bucket, any mask
    return prepared


def _serves_steps(
    prepared: Prepared, kind: StepKind, q: Tensor, k: Tensor, v: Tensor, mask: MaskArg
) -> bool:
    """Whether a step's plan serves the later steps of its bucket: a dense step's kernel
    that takes any S; a padded step's backend where the rule put it first (a backend
    the rule would take but this mask's tensors refused is no answer for the next)."""
    if kind == "dense":
        return prepared.kernel is not None and prepared.kernel.serves_any_length
    if prepared.backend is None:
        return False
    order = step_order(prepared.call(q, k, v, mask)) if prepared.asked == "auto" else []
    return prepared.asked != "auto" or (bool(order) and order[0] is prepared.backend)


def _prepared(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: MaskArg,
    options: Options,
    key: CallKey | None,
    grad: bool | None,
) -> Prepared:
    """Validate, plan and prepare a call that is not cached."""
    scale, softcap, dropout_p, backend, need_lse, check_bias = options
    call = normalize_call(
        q,
        k,
        v,
        mask,
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        check_bias=check_bias,
        table=runtime.current().costs.table(),
    )
    # a kernel takes the inputs as given: only where normalizing changed none of them,
    # and never for a tensor given as the mask (the kernel would hold it, and with it
    # its own cache entry)
    as_given = call.q is q and call.k is k and call.v is v
    given_scale = 1.0 / math.sqrt(call.dims.D) if scale is None else float(scale)
    return prepare_call(
        call,
        backend,
        bool(need_lse),
        given_scale,
        key=key,
        grad=grad,
        kernel_ok=as_given and not isinstance(mask, Tensor),
    )


def _step_key(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None,
    options: Options,
    kind: StepKind,
) -> CallKey | None:
    """The key of a decoding step of `kind` (`steps.step_kind`: every key seen, or key
    padding alone), or None where the call is not one: a bias, no keys, k and v of other
    lengths, the log-sum-exp asked. The key holds no mask (a dense step runs the same
    unmasked kernel under any mask that sees every key; a padded step makes its call
    from the mask it is given) and S only by its bucket; what it leaves out is checked
    here: S >= 1, the same in k and v, and the mask's own check."""
    if options.need_lse:  # no kernel
        return None
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        return None
    L, S = q_shape[2], k_shape[2]
    if S < 1 or v_shape[2] != S:
        return None
    if mask is not None:
        if mask.has_bias:
            return None
        try:
            dense = mask.sees_all(L, S)  # else a padded step, or none
            if dense != (kind == "dense") or (not dense and step_kind(mask, L, S) != kind):
                return None
            mask.check(q_shape[0], q_shape[1], L, S)
        except (ValueError, TypeError):  # the full path raises it, in its order
            return None
    elif kind != "dense":
        return None
    k_rest = (k_shape[0], k_shape[1], k_shape[3])  # (B, Hkv, D): S left out
    v_rest = (v_shape[0], v_shape[1], v_shape[3])
    return call_key(q, k, v, q_shape, k_rest, v_rest, (kind, bucket(S)), options)


# ------------------------------------------------------------------ the cache


def _calls_of(by_mask: ByMask[MaskCalls], mask: MaskArg) -> MaskCalls | None:
    """The prepared calls of `mask` among the runtime's; None for a mask argument of
    another type."""
    if mask is None or isinstance(mask, Mask) or type(mask) is Tensor:
        return by_mask.of(mask)
    return None


def clear() -> None:
    """Forget every prepared call (tests; after changing a backend by hand)."""
    runtime.current().clear()
