"""The key of a prepared call (`CallKey`): everything validation, planning and preparing
read of a call (sizes, strides, dtypes, devices, whether autograd records, the
`Options`, the state of the mask's tensors, the registry's), so a run on inputs of the
same key needs none of those steps again, and a mismatch names the field that changed
(`FIELD_NAMES`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnkit import runtime
from attnkit.call.precision import HALF

__all__ = [
    "FIELD_NAMES",
    "INPUT_FIELDS",
    "LENGTHS",
    "STRIDES",
    "CallKey",
    "Options",
    "call_key",
    "inputs_key",
    "named_tuple",
]

_PLAIN = (float, int, type(None))  # score options a key can hold (bool is refused later)
# Builds a NamedTuple from its fields in order, as `tuple` does: its generated __new__ is a
# Python call (0.4-0.9 µs), too dear for the path every call takes
named_tuple = tuple.__new__


class Options(NamedTuple):
    """What a call asks besides its tensors and mask, as `attention` takes it."""

    scale: float | None
    softcap: float | None
    dropout_p: float
    backend: str
    need_lse: bool
    check_bias: bool  # a float mask's values are checked (not by `sdpa`)


class CallKey(NamedTuple):
    """What a prepared call was made for: a call with an equal key runs its plan."""

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]  # a decoding step's key leaves S out
    v_shape: tuple[int, ...]
    q_stride: tuple[int, ...]
    k_stride: tuple[int, ...]
    v_stride: tuple[int, ...]
    q_dtype: torch.dtype
    k_dtype: torch.dtype
    v_dtype: torch.dtype
    q_device: torch.device
    k_device: torch.device
    v_device: torch.device
    half_kernels: tuple[torch.dtype, bool] | None  # what half inputs compute in, AMX's tiles
    grad: bool  # autograd records
    options: Options
    mask_state: tuple[object, ...]  # its tensors' identity and version (`mask_state`)
    registry: tuple[int, int, int]  # the backends registered, their state, the cost table


INPUT_FIELDS = 12  # the first fields: what `inputs_key` gives of q, k, v themselves
# what each field holds, for the error that names what changed
FIELD_NAMES = {
    **{f"{t}_shape": f"{t}'s shape" for t in "qkv"},
    **{f"{t}_stride": f"{t}'s strides" for t in "qkv"},
    **{f"{t}_dtype": f"{t}'s dtype" for t in "qkv"},
    **{f"{t}_device": f"{t}'s device" for t in "qkv"},
    "half_kernels": "what half inputs compute in",
    "grad": "whether autograd records (grad mode, requires_grad)",
    "options": "the options (scale, softcap, dropout_p, backend, need_lse, check_bias)",
    "mask_state": "the mask's tensors (identity and version: changed in place?)",
    "registry": "the backends registered and their state",
}
STRIDES = {"q_stride", "k_stride", "v_stride"}  # others: the same call without its kernel
LENGTHS = {"k_shape", "v_shape"}  # a decoding step's cache grows


def call_key(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    state: tuple[object, ...],
    options: Options,
    grad: bool | None = None,
) -> CallKey | None:
    """The key of a call of plain tensors q, k, v (the sizes as given: a decoding step's
    key may leave S out; `state`: `mask_state`; `grad`: planned as if autograd records,
    None: whether it does). None where a call is not cached (an option that is not a
    plain number: the full path checks it)."""
    if not (
        type(options.scale) in _PLAIN
        and type(options.softcap) in _PLAIN
        and type(options.dropout_p) in _PLAIN
        and type(options.backend) is str
    ):
        return None
    if grad is None:
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    device, rt = q.device, runtime.current()
    return named_tuple(
        CallKey,
        (
            q_shape,
            k_shape,
            v_shape,
            q.stride(),
            k.stride(),
            v.stride(),
            q.dtype,
            k.dtype,
            v.dtype,
            device,
            k.device,
            v.device,
            rt.half.plan_key(q.dtype, device) if q.dtype in HALF else None,
            grad,
            options,
            state,
            rt.state(),
        ),
    )


def inputs_key(q: Tensor, k: Tensor, v: Tensor) -> tuple[object, ...]:
    """What a key holds of plain q, k, v themselves (its first `INPUT_FIELDS` fields):
    shapes, strides, dtypes, devices."""
    return (
        q.shape,
        k.shape,
        v.shape,
        q.stride(),
        k.stride(),
        v.stride(),
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        k.device,
        v.device,
    )
