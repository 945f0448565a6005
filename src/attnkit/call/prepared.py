"""A prepared call: an attention call with everything but q, k, v decided, as a value.

Preparing validates the arguments (`contracts.normalize_call`), chooses the backend
(`planner.backend_for_run`) and lets it prepare its kernel (`Backend.prepare`: SDPA's
mask tensor and flags); what the backends derive from the mask and sizes on the first
run (the rows and keys seen, a tile plan, a block mask) joins its `PlanValues`
(`call.plan_values`). A `Prepared` holds neither q, k, v nor, inside `attention()`'s
cache, the mask: its `key` (`call.key.CallKey`) is the key of everything those steps
read (sizes, strides, dtypes, devices, whether autograd records, the options, the state
of the mask's tensors), and a run on inputs of that key needs no step again.

`attnkit.prepare(...)` hands one out, held with its mask (`with_mask`): calling it checks
that the inputs fit (a `PreparedMismatchError` names what changed, an in-place change of
the mask's tensors included) and runs it; `explain()` gives its `Plan`.

The key holds, besides sizes, strides, dtypes, devices and grad mode: scale, softcap,
dropout, the backend asked, `need_lse`, the identity, version and size of each tensor of
the mask (a tensor changed in place is a new key; a tensor given as the mask: its own),
the kernel dtype of half inputs, and the registry's state (the backends registered and
their `version`: flex's kernels turning warm). The `PlanValues` of a prepared call is
shared by every `AttentionCall` it builds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from attnkit.backends import Backend, Kernel, get_backend
from attnkit.call.by_mask import MaskTensors, mask_state
from attnkit.call.execute import execute
from attnkit.call.key import (
    FIELD_NAMES,
    INPUT_FIELDS,
    LENGTHS,
    STRIDES,
    CallKey,
    call_key,
    inputs_key,
)
from attnkit.call.planner import Plan, backend_for_run, plan_call
from attnkit.call.steps import step_kind, step_padding
from attnkit.call.visibility import all_finite, may_leak
from attnkit.contracts import AttentionCall, Dims, normalize_inputs
from attnkit.errors import PreparedMismatchError
from attnkit.masks import Mask
from attnkit.masks.base import as_mask
from attnkit.softmax import add_sinks

__all__ = ["Prepared", "mask_state", "prepare_call"]

MaskArg = Mask | Tensor | None
Runner = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor | None]]
# a call run per document: (the row's plan, q, k, v, verbose) -> the plan of what runs
Explained = Callable[[Plan, Tensor, Tensor, Tensor, bool], Plan]


class Prepared:
    """A validated, planned call with q, k, v left out, from `attnkit.prepare`.

    `prepared(q, k, v)` checks that the inputs fit (sizes, dtypes, devices, grad mode,
    the mask's tensors unchanged) and returns the output (B, H, L, Dv), as `attention`;
    `with_lse(q, k, v)` adds the log-sum-exp (B, H, L); `explain()` gives the `Plan`.
    `run(q, k, v, mask)` is `attention_with_lse` without sinks, unchecked (the cache of
    `attention` calls it).

    Args:
        key: the key of what preparing read (sizes, strides, dtypes, devices, grad, the
            options, the mask's tensors' state), or None for a call that is not kept.
        call: the validated `AttentionCall`.
        backend: the chosen backend, or None for an empty call.
        asked: keyword-only, the backend asked for (`"auto"`: the planner's choice).
        need_lse: keyword-only, the log-sum-exp is wanted.
        scale: keyword-only, the scale as given or its default 1/√D.
        kernel: keyword-only, the backend's own prepared call, or None.

    Examples:
        >>> q = torch.randn(1, 2, 8, 16)
        >>> run = ak.prepare(q, q, q, ak.causal(), need_lse=True)
        >>> q2 = torch.randn(1, 2, 8, 16)  # new inputs of the prepared kind
        >>> out, lse = run.with_lse(q2, q2, q2)
        >>> out.shape, lse.shape, torch.allclose(out, ak.attention(q2, q2, q2, ak.causal()))
        (torch.Size([1, 2, 8, 16]), torch.Size([1, 2, 8]), True)
    """

    def __init__(
        self,
        key: CallKey | None,
        call: AttentionCall,
        backend: Backend | None,
        *,
        asked: str,
        need_lse: bool,
        scale: float,
        kernel: Kernel | None,
    ) -> None:
        self.key = key
        self.backend = backend  # None: nothing to compute
        self.asked = asked  # the backend asked for ("auto": the planner's choice)
        self.need_lse = need_lse
        self.dims: Dims = call.dims
        self.scale = scale  # as given or its default (normalize_inputs folds its sign into q)
        self.softcap, self.dropout_p = call.softcap, call.dropout_p
        self.kernel = kernel  # the backend's own prepared call, for inputs as given
        self.plan_values = call.plan_values  # what the backends derive on the first run
        self.table = call.table  # the cost table it was planned with
        # the kernel may multiply hidden weights by values: K and V checked before it runs
        leaks = None if backend is None or backend.values_exact else may_leak(call)
        self.checks_values = leaks is not None
        self._seen_by_all = leaks or (0, 0)
        # set by `with_mask` (attnkit.prepare): the mask, sinks, and how calls run per document run
        self._mask: tuple[MaskArg] | None = None
        self._tensors = MaskTensors(None)
        self._sinks: Tensor | None = None
        self._runner: Runner | None = None
        self._per_document = False
        self._direct: Kernel | None = None  # the kernel `__call__` runs where inputs fit
        self._explained: Explained | None = None

    # ------------------------------------------------------------- the cache's runs

    def run(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskArg) -> tuple[Tensor, Tensor | None]:
        """Attention over inputs of this call's `key` (unchecked) and its mask."""
        finite = not self.checks_values or all_finite(k, v, self._seen_by_all)
        if self.kernel is not None and finite:
            out = self.kernel(q, k, v)
            if out is not None:
                return out, None
        call = self.call(q, k, v, mask)
        return execute(call, self.backend, need_lse=self.need_lse, finite=finite)

    def at_length(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask | None) -> Prepared | None:
        """The plan of a decoding step of this one's bucket (`attnkit.call.steps`: another S, a
        mask of the same kind, checked by the caller): this backend, its call made anew;
        None where the backend cannot serve it (the full path plans it)."""
        q, k, v, scale = normalize_inputs(q, k, v, self.scale)
        dims = replace(self.dims, S=k.shape[2])
        if mask is not None:  # what it sees: its key paddings (the rest sees every key)
            mask = step_padding(mask, dims.L, dims.S) or mask
        call = AttentionCall(
            q, k, v, mask, None, scale, self.softcap, self.dropout_p, dims, table=self.table
        )
        assert self.backend is not None  # a step is never empty
        if self.backend.can_use(call, need_lse=self.need_lse) is not None:
            return None
        asked, need_lse = self.asked, self.need_lse
        return Prepared(
            None, call, self.backend, asked=asked, need_lse=need_lse, scale=self.scale, kernel=None
        )

    def call(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskArg) -> AttentionCall:
        """The `AttentionCall` of new inputs: what `normalize_call` would give (unchecked:
        the key guarantees they pass), with this call's derived values."""
        q, k, v, scale = normalize_inputs(q, k, v, self.scale)
        visibility = None if mask is None or _is_bias(mask) else as_mask(mask)
        bias = mask if isinstance(mask, Tensor) and _is_bias(mask) else None
        return AttentionCall(
            q,
            k,
            v,
            visibility,
            bias,
            scale,
            self.softcap,
            self.dropout_p,
            self.dims,
            self.plan_values,
            table=self.table,
        )

    # ------------------------------------------------------------- attnkit.prepare's

    def with_mask(
        self,
        mask: MaskArg,
        *,
        key: CallKey,
        sinks: Tensor | None,
        runner: Runner,
        per_document: bool,
        explained: Explained | None = None,
    ) -> Prepared:
        """This call for a user to hold: its mask (and sinks) kept, `key` checked at
        every call. `runner` runs the call as `attention` would (under `torch.compile`,
        and always where `per_document`: packed documents run a call each)."""
        user_call = Prepared.__new__(Prepared)
        user_call.__dict__.update(self.__dict__)
        user_call.key, user_call._mask, user_call._sinks = key, (mask,), sinks
        user_call._tensors = MaskTensors(mask)
        user_call._runner, user_call._per_document = runner, per_document
        user_call._direct = None if per_document or sinks is not None else user_call.kernel
        user_call._explained = explained
        return user_call

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """`attention` of the prepared call on q, k, v of the prepared kind.

        Args:
            q: (B, H, L, D) queries of the prepared size, dtype, device and grad mode.
            k: (B, Hkv, S, D) keys, likewise.
            v: (B, Hkv, S, Dv) values, likewise; the values may differ call to call.

        Returns:
            (B, H, L, Dv) output, as `attention`.

        Raises:
            PreparedMismatchError: inputs that do not fit, or a mask tensor changed.
        """
        kernel = self._direct
        if (
            kernel is not None
            and not torch.compiler.is_compiling()
            and self._fits(q, k, v)
            and (not self.checks_values or all_finite(k, v, self._seen_by_all))
        ):
            out = kernel(q, k, v)  # the prepared kernel itself: nothing else to do
            if out is not None:
                return out
        return self._checked(q, k, v)[0]

    def with_lse(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """`attention_with_lse` of the prepared call (`need_lse=True`) on q, k, v, as calling it.

        Returns:
            out (B, H, L, Dv) and lse (B, H, L), as `attention_with_lse`.

        Raises:
            ValueError: a call prepared without `need_lse=True`.
            PreparedMismatchError: inputs that do not fit, as calling it.
        """
        if not self.need_lse:
            raise ValueError(
                "this call was prepared without its log-sum-exp (the backend may give none); "
                "prepare it with attnkit.prepare(..., need_lse=True)."
            )
        out, lse = self._checked(q, k, v)
        assert lse is not None
        return out, lse

    def explain(self, *, verbose: bool = False) -> Plan:
        """What this call runs and why: the `Plan` of `attnkit.explain` for its arguments
        (`verbose`: with the cost model's figures)."""
        mask = self._bound_mask()
        f = self.key
        assert f is not None
        shapes, strides = (f.q_shape, f.k_shape, f.v_shape), (f.q_stride, f.k_stride, f.v_stride)
        dtypes, devices = (f.q_dtype, f.k_dtype, f.v_dtype), (f.q_device, f.k_device, f.v_device)
        with torch.set_grad_enabled(f.grad):
            q, k, v = (
                torch.empty_strided(s, st, dtype=t, device=d, requires_grad=f.grad)
                for s, st, t, d in zip(shapes, strides, dtypes, devices, strict=True)
            )
            plan = plan_call(
                self.call(q, k, v, mask), self.asked, need_lse=self.need_lse, verbose=verbose
            )
            if self._explained is not None:  # what runs: another plan than the row's
                plan = self._explained(plan, q, k, v, verbose)
        return plan

    def _bound_mask(self) -> MaskArg:
        if self._mask is None:
            raise TypeError("a prepared call of attention()'s cache: use attnkit.prepare(...)")
        return self._mask[0]

    def _checked(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor | None]:
        mask = self._bound_mask()
        assert self._runner is not None and self.key is not None
        if torch.compiler.is_compiling():  # one traced op, as attention() under compile
            return self._with_sinks(*self._runner(q, k, v))
        if not self._per_document and self._fits(q, k, v):
            return self._with_sinks(*self.run(q, k, v, mask))
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        now = call_key(q, k, v, q.shape, k.shape, v.shape, self._tensors.state(), self.key.options)
        assert now is not None  # the options are the prepared call's own
        was = self.key._asdict()
        changed = [name for name, value in now._asdict().items() if value != was[name]]
        wrong = [name for name in changed if name not in STRIDES and name != "registry"]
        if wrong and set(wrong) <= LENGTHS and self._grows(k.shape, v.shape):
            return self._with_sinks(*self._runner(q, k, v))  # a step's cache grew
        if wrong:
            name = wrong[0]
            raise PreparedMismatchError(
                f"this call was prepared for {FIELD_NAMES[name]} {was[name]}, got "
                f"{getattr(now, name)}; "
                "prepare it again with attnkit.prepare(...) for the new inputs (or call "
                "attnkit.attention, which prepares as it goes)."
            )
        if self._per_document:
            return self._with_sinks(*self._runner(q, k, v))
        out, lse = execute(self.call(q, k, v, mask), self.backend, need_lse=self.need_lse)
        return self._with_sinks(out, lse)  # other strides: the kernel takes none as given

    def _grows(self, k_shape: tuple[int, ...], v_shape: tuple[int, ...]) -> bool:
        """k and v of this decoding step's sizes but S (`attnkit.call.steps`: the cache grew)."""
        assert self.key is not None
        k_was, v_was = self.key.k_shape, self.key.v_shape
        if len(k_shape) != 4 or len(v_shape) != 4 or k_shape[2] != v_shape[2]:
            return False
        mask = self._bound_mask()
        return (
            (k_shape[:2], k_shape[3], v_shape[:2], v_shape[3])
            == (k_was[:2], k_was[3], v_was[:2], v_was[3])
            and not isinstance(mask, Tensor)
            and step_kind(mask, self.dims.L, self.dims.S) is not None
        )

    def _fits(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """The key of plain tensors (what `call_key` would build, but the options, the prepared
        call's own, and the backends' state, which changes no result): the inputs' fields
        compared at once, then grad mode and the mask's tensors (if it holds any)."""
        f = self.key
        assert f is not None
        return (
            type(q) is Tensor
            and type(k) is Tensor
            and type(v) is Tensor
            and inputs_key(q, k, v) == f[:INPUT_FIELDS]
            and f.grad
            == (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and (not self._tensors.has_tensors or self._tensors.state() == f.mask_state)
        )

    def _with_sinks(self, out: Tensor, lse: Tensor | None) -> tuple[Tensor, Tensor | None]:
        if self._sinks is None:
            return out, lse
        assert lse is not None
        return add_sinks(out, lse, self._sinks)

    def __repr__(self) -> str:
        d = self.dims
        name = "none" if self.backend is None else self.backend.name
        return (
            f"Prepared(backend={name!r}, q=(B={d.B}, H={d.H}, L={d.L}, D={d.D}), "
            f"k/v=(Hkv={d.Hkv}, S={d.S}, Dv={d.Dv}))"
        )


def _is_bias(mask: Mask | Tensor) -> bool:
    return isinstance(mask, Tensor) and mask.is_floating_point()


def prepare_call(
    call: AttentionCall,
    name: str,
    need_lse: bool,
    scale: float,
    *,
    key: CallKey | None,
    kernel_ok: bool,
    grad: bool | None = None,
) -> Prepared:
    """Plan a validated `call` once (`scale`: as given, before its sign is folded into
    q; `grad`: plan as if autograd records); keep the backend's prepared kernel where
    `kernel_ok` (inputs as given)."""
    planned = call if grad is None else replace(call, grad=grad)
    chosen = _choose(planned, name, need_lse)
    kernel = None
    if chosen is not None and kernel_ok:
        kernel = chosen.prepare(planned, need_lse=need_lse)
    return Prepared(key, call, chosen, asked=name, need_lse=need_lse, scale=scale, kernel=kernel)


def _choose(call: AttentionCall, name: str, need_lse: bool) -> Backend | None:
    """The backend for `call`, None for an empty one (an unknown name still raises)."""
    if call.is_empty:
        if name != "auto":
            get_backend(name)  # an unknown name still raises
        return None
    return backend_for_run(call, name, need_lse=need_lse)
