"""Dispatch: one attention call from its arguments to a result, normalize -> plan -> run.

The first call of a kind validates its arguments (`contracts.normalize_call`), chooses a
backend (`planner.backend_for_run`) and prepares what the kernel needs besides q, k, v
(`Backend.prepare`: SDPA's mask tensor and flags). That preparation is cached under a
key of everything those steps read (`_key`): the sizes, strides, dtypes and devices of
q, k, v, whether autograd records, the score options, the backend asked, the mask
object and the identity and version of each of its tensors (`masks.structure.state`: a tensor
changed in place is a new key) and the backends' own state (flex kernels turning warm).
A repeated call -- each layer of a decoding step, each step of a loop of fixed sizes --
costs that key, one lookup and the kernel; a prepared call is never served stale.

Prepared calls are held per mask (`permask.PerMask`: a mask of numbers alone by its
structure, others by their object, weakly: they go when the mask goes), at most
`PREPARED_PER_MASK` each, and never hold the mask or q, k, v themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnkit.backends import BACKENDS, Backend, Kernel, get_backend
from attnkit.bounded import Bounded
from attnkit.contracts import AttentionCall, Dims, normalize_call, normalize_inputs
from attnkit.masks import Mask
from attnkit.masks.base import as_mask
from attnkit.masks.tensor import given_tensor
from attnkit.permask import PerMask
from attnkit.planner import backend_for_run
from attnkit.precision import HALF, compute_dtype, kernel_dtype

__all__ = ["PREPARED_PER_MASK", "attention_call", "execute", "run"]

MaskArg = Mask | Tensor | None

PREPARED_PER_MASK = 16  # sizes remembered per mask object (a decoding loop needs one)
_PLAIN = (float, int, type(None))  # score options a key can hold (bool is refused later)
_FLEX = BACKENDS["flex"]  # the backend whose own state (warm kernels) a plan reads


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
    held = _held(mask)
    options = (scale, softcap, dropout_p, backend, need_lse, check_bias)
    plain = held is not None and type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
    lane = _lane_key(q, k, v, mask, held, options) if plain else None  # type: ignore[arg-type]
    if lane is not None and (kernel := _LANE.get(lane)) is not None:
        return kernel(q, k, v), None  # type: ignore[return-value]  # unchecked: never None
    key = None
    if plain:
        state = held.state(mask)  # type: ignore[union-attr]
        key = _key(q, k, v, q.shape, k.shape, v.shape, state, options)
    prepared = None if key is None else held.plans.get(key)  # type: ignore[union-attr]
    if prepared is None:
        call = normalize_call(
            q, k, v, mask, scale=scale, softcap=softcap, dropout_p=dropout_p,
            check_bias=check_bias,
        )  # fmt: skip
        # a kernel takes the inputs as given: only where normalizing changed none of them,
        # and never for a tensor given as the mask (the kernel would hold it, and with it
        # its own cache entry)
        as_given = call.q is q and call.k is k and call.v is v
        given_scale = 1.0 / math.sqrt(call.dims.D) if scale is None else float(scale)
        prepared = _prepare(
            call,
            backend,
            need_lse,
            given_scale,
            kernel_ok=as_given and not isinstance(mask, Tensor),
        )
        if key is not None:
            held.plans.put(key, prepared)  # type: ignore[union-attr]
        if lane is not None and _serves_any_length(prepared.kernel):
            _LANE.put(lane, prepared.kernel)  # type: ignore[arg-type]
    return prepared(q, k, v, mask)


# ------------------------------------------------------------------ the decoding lane

# A call where every query sees every key by the mask's structure alone (a decoding step:
# bottom-right causal at L = 1; no mask) runs one unmasked kernel whatever the number of
# keys S: kept under a key without S, it serves the next step of a growing cache (one more
# key, a new mask object each step) with no validation or planning but its own checks.
_LANE: Bounded[tuple[object, ...], Kernel] = Bounded(4 * PREPARED_PER_MASK)


def _lane_key(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: MaskArg,
    held: _Held,
    options: tuple[object, ...],
) -> tuple[object, ...] | None:
    """The lane's key, or None where the call is not one it serves: a mask holding
    tensors or a bias, one that hides a pair, no keys, or k and v of other lengths. What
    a cached key leaves out (S) is checked here: S >= 1, the same in k and v, and the
    mask's own check for it."""
    _, _, _, _, need_lse, _ = options  # scale, softcap, dropout_p, backend, ..., check_bias
    if need_lse or held.tensors or isinstance(mask, Tensor):  # need_lse: no kernel
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
            if not mask.sees_all(L, S):
                return None
            mask.check(q_shape[0], q_shape[1], L, S)
        except (ValueError, TypeError):  # the full path raises it, in its order
            return None
    k_rest = (k_shape[0], k_shape[1], k_shape[3])  # (B, Hkv, D): S left out
    v_rest = (v_shape[0], v_shape[1], v_shape[3])
    return _key(q, k, v, q_shape, k_rest, v_rest, (), options)


def _serves_any_length(kernel: Kernel | None) -> bool:
    """True for a kernel with nothing of S in it: no mask tensor, no `is_causal`."""
    return kernel is not None and kernel.serves_any_length


def run(call: AttentionCall, name: str, *, need_lse: bool) -> tuple[Tensor, Tensor | None]:
    """A validated call on backend `name` ("auto": the planner's choice), uncached."""
    return execute(call, _choose(call, name, need_lse), need_lse=need_lse)


def _choose(call: AttentionCall, name: str, need_lse: bool) -> Backend | None:
    """The backend for `call`, None for an empty one (an unknown name still raises)."""
    if call.is_empty:
        if name != "auto":
            get_backend(name)
        return None
    return backend_for_run(call, name, need_lse=need_lse)


def execute(
    call: AttentionCall, backend: Backend | None, *, need_lse: bool
) -> tuple[Tensor, Tensor | None]:
    """Run `backend` on `call` (None: an empty call, all zeros) and join a result that no
    input reaches (no query sees a key) to q, k, v with zero gradients."""
    if backend is None:
        d = call.dims
        out = call.q.new_zeros(d.B, d.H, d.L, d.Dv)
        lse: Tensor | None = call.q.new_full(
            (d.B, d.H, d.L), -torch.inf, dtype=compute_dtype(call.q.dtype)
        )
    else:
        out, lse = backend.run(call, need_lse=need_lse)
    if out.requires_grad or not torch.is_grad_enabled():
        return out, lse
    if not any(t.requires_grad for t in (call.q, call.k, call.v)):
        return out, lse
    joined: tuple[Tensor, Tensor | None] = _Constant.apply(  # type: ignore[no-untyped-call]
        out, lse, call.q, call.k, call.v
    )
    return joined


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


# ------------------------------------------------------------------ prepared calls


@dataclass(frozen=True)
class _Prepared:
    """A validated, planned call with q, k, v and the mask left out: `__call__` rebuilds
    the `AttentionCall` around new ones (what `normalize_call` would give, unchecked:
    the key guarantees they pass) or runs the backend's prepared kernel directly."""

    backend: Backend | None  # None: nothing to compute
    need_lse: bool
    dims: Dims
    scale: float  # as given or its default (normalize_inputs folds its sign into q)
    softcap: float | None
    dropout_p: float
    kernel: Kernel | None  # the backend's own prepared call, for inputs as given

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, mask: MaskArg
    ) -> tuple[Tensor, Tensor | None]:
        if self.kernel is not None:
            out = self.kernel(q, k, v)
            if out is not None:
                return out, None
        return execute(self.call(q, k, v, mask), self.backend, need_lse=self.need_lse)

    def call(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskArg) -> AttentionCall:
        q, k, v, scale = normalize_inputs(q, k, v, self.scale)
        visibility = None if mask is None or _is_bias(mask) else as_mask(mask)
        bias = mask if isinstance(mask, Tensor) and _is_bias(mask) else None
        return AttentionCall(
            q, k, v, visibility, bias, scale, self.softcap, self.dropout_p, self.dims
        )


def _is_bias(mask: Mask | Tensor) -> bool:
    return isinstance(mask, Tensor) and mask.is_floating_point()


def _prepare(
    call: AttentionCall, name: str, need_lse: bool, scale: float, *, kernel_ok: bool
) -> _Prepared:
    """Plan `call` once (`scale`: as given, before its sign is folded into q); keep the
    backend's prepared kernel where `kernel_ok`."""
    chosen = _choose(call, name, need_lse)
    kernel = chosen.prepare(call, need_lse=need_lse) if chosen is not None and kernel_ok else None
    return _Prepared(chosen, need_lse, call.dims, scale, call.softcap, call.dropout_p, kernel)


# ------------------------------------------------------------------ the cache


class _Held:
    """The prepared calls of one mask (or of calls without a mask), and the tensors
    whose identity and version every key carries."""

    def __init__(self, mask: MaskArg) -> None:
        self.by_tensor = isinstance(mask, Tensor)  # a tensor given as the mask
        self.tensors = mask.tensors() if isinstance(mask, Mask) else ()  # (they die with it)
        limit = 4 * PREPARED_PER_MASK if mask is None else PREPARED_PER_MASK
        self.plans: Bounded[tuple[object, ...], _Prepared] = Bounded(limit)

    def state(self, mask: MaskArg) -> tuple[object, ...]:
        """The identity, version and size of each tensor the mask holds or is."""
        if self.by_tensor:  # the tensor itself, or a `Mask` made from it
            given = mask if isinstance(mask, Tensor) else given_tensor(mask)  # type: ignore[arg-type]
            assert given is not None
            return (given.data_ptr(), given._version, given.shape, given.stride(),
                    given.dtype, given.device)  # fmt: skip
        return tuple((t.data_ptr(), t._version, t.shape) for t in self.tensors)


# prepared calls by mask: a mask of numbers alone by its structure (a mask built anew
# each step shares the calls of an equal one), others by their object
_HELD: PerMask[_Held] = PerMask(_Held)


def _held(mask: MaskArg) -> _Held | None:
    """The prepared calls of `mask`; None for a mask argument of another type."""
    if mask is None or isinstance(mask, Mask) or type(mask) is Tensor:
        return _HELD.of(mask)
    return None


def _key(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    mask_state: tuple[object, ...],
    options: tuple[object, ...],
) -> tuple[object, ...] | None:
    """Everything validation, planning and preparing read (of plain tensors q, k, v;
    the sizes as given: the lane leaves S out; `options`: scale, softcap, dropout_p,
    backend, need_lse, check_bias); None where a call is not cached (an option that is
    not a plain number: the full path checks it)."""
    scale, softcap, dropout_p, backend = options[:4]
    if not (type(scale) in _PLAIN and type(softcap) in _PLAIN and type(dropout_p) in _PLAIN):
        return None
    if type(backend) is not str:
        return None
    device = q.device
    return (
        q_shape, k_shape, v_shape, q.stride(), k.stride(), v.stride(),
        q.dtype, k.dtype, v.dtype, device, k.device, v.device,
        kernel_dtype(q.dtype, device) if q.dtype in HALF else None,
        torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
        *options, mask_state,
        _FLEX.version,
    )  # fmt: skip


def clear() -> None:
    """Forget every prepared call (tests; after changing a backend by hand)."""
    _HELD.clear()
    _LANE.clear()
