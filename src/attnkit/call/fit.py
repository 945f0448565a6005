"""The fit of a prepared call: everything validation, planning and preparing read of a
call (sizes, strides, dtypes, devices, whether autograd records, the options, the state
of the mask's tensors, the registry's), so a run on inputs of the same fit needs none of
those steps again, and a mismatch names the field that changed (`FIT_FIELDS`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import runtime
from attnkit.call.precision import HALF, kernel_dtype

__all__ = ["FIT_FIELDS", "LENGTHS", "REGISTRY", "STRIDES", "fit", "inputs_kind"]

_PLAIN = (float, int, type(None))  # score options a key can hold (bool is refused later)

# what each place of a `fit` key holds, for the error that names what changed
FIT_FIELDS = (
    "q's shape",
    "k's shape",
    "v's shape",
    "q's strides",
    "k's strides",
    "v's strides",
    "q's dtype",
    "k's dtype",
    "v's dtype",
    "q's device",
    "k's device",
    "v's device",
    "the dtype half inputs compute in",
    "whether autograd records (grad mode, requires_grad)",
    "scale",
    "softcap",
    "dropout_p",
    "backend",
    "need_lse",
    "check_bias",
    "the mask's tensors (identity and version: changed in place?)",
    "the backends registered and their state",
)
STRIDES = range(3, 6)  # other strides: the same call without the prepared kernel
LENGTHS = {1, 2}  # k's and v's shapes: a decoding step's cache grows
REGISTRY = len(FIT_FIELDS) - 1  # a backend turning warm: the plan is still exact


def fit(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    state: tuple[object, ...],
    options: tuple[object, ...],
    grad: bool | None = None,
) -> tuple[object, ...] | None:
    """Everything validation, planning and preparing read (of plain tensors q, k, v;
    the sizes as given: a decoding step's key may leave S out; `state`: `mask_state`;
    `options`: scale, softcap, dropout_p, backend, need_lse, check_bias; `grad`: planned
    as if autograd records, None: whether it does). None where a call is not cached (an
    option that is not a plain number: the full path checks it)."""
    scale, softcap, dropout_p, backend = options[:4]
    if not (type(scale) in _PLAIN and type(softcap) in _PLAIN and type(dropout_p) in _PLAIN):
        return None
    if type(backend) is not str:
        return None
    if grad is None:
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    device = q.device
    return (
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
        kernel_dtype(q.dtype, device) if q.dtype in HALF else None,
        grad,
        *options,
        state,
        runtime.current().state(),
    )


def inputs_kind(q: Tensor, k: Tensor, v: Tensor) -> tuple[object, ...]:
    """What a fit holds of plain q, k, v themselves (its first twelve fields): shapes,
    strides, dtypes, devices."""
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
