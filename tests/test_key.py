"""The key of a prepared call (`attnkit.call.key`): typed fields, built on the path every
call takes without the NamedTuple's Python-level constructor."""

from __future__ import annotations

import torch

from attnkit import runtime
from attnkit.call.key import FIELD_NAMES, INPUT_FIELDS, CallKey, Options, call_key, inputs_key


def test_a_key_holds_each_field_under_its_name():
    q, k = torch.randn(2, 8, 3, 16), torch.randn(2, 2, 5, 16)
    options = Options(None, 30.0, 0.0, "auto", need_lse=True, check_bias=False)
    key = call_key(q, k, k, q.shape, k.shape, k.shape, ("state",), options, grad=False)
    assert type(key) is CallKey and set(FIELD_NAMES) == set(CallKey._fields)
    assert key == CallKey(
        q_shape=q.shape,
        k_shape=k.shape,
        v_shape=k.shape,
        q_stride=q.stride(),
        k_stride=k.stride(),
        v_stride=k.stride(),
        q_dtype=q.dtype,
        k_dtype=k.dtype,
        v_dtype=k.dtype,
        q_device=q.device,
        k_device=k.device,
        v_device=k.device,
        half_kernels=None,
        grad=False,
        options=options,
        mask_state=("state",),
        registry=runtime.current().state(),
    )
    assert key.options.softcap == 30.0 and key.options.need_lse and not key.options.check_bias
    assert key[:INPUT_FIELDS] == inputs_key(q, k, k)


def test_options_that_are_not_plain_numbers_give_no_key():
    q = torch.randn(1, 1, 2, 4)
    tensor_scale = Options(torch.tensor(0.5), None, 0.0, "auto", False, True)
    assert call_key(q, q, q, q.shape, q.shape, q.shape, (), tensor_scale) is None
