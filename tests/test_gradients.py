"""attnkit.call.gradients: a call's dq, dk, dv from its output and log-sum-exp, by the first
backend whose fused backward serves it, equal to autograd's through the reference."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import runtime
from attnkit.call.gradients import fused_gradients, serves
from attnkit.contracts import normalize_call


def _qkv(L=24, S=24, D=16, Dv=16, H=4, Hkv=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(2, H, L, D, generator=g, dtype=dtype),
        torch.randn(2, Hkv, S, D, generator=g, dtype=dtype),
        torch.randn(2, Hkv, S, Dv, generator=g, dtype=dtype),
    )


MASKS = {
    "none": None,
    "causal": ak.causal(),
    "window": ak.causal() & ak.sliding_window(5),
    "padding": ak.causal() & ak.key_padding(torch.tensor([24, 9])),
    "documents": ak.document(torch.tensor([0] * 10 + [1] * 14)),
}


@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
def test_fused_gradients_equal_autograds(mask, with_lse):
    q, k, v = _qkv()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ak.attention_with_lse(*leaves, mask, backend="reference")
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g, dtype=out.dtype)
    dlse = torch.randn(lse.shape, generator=g, dtype=lse.dtype) if with_lse else None
    outputs = [out, lse] if with_lse else [out]
    grads = [dout, torch.where(torch.isfinite(lse), dlse, 0)] if with_lse else [dout]
    want = torch.autograd.grad(outputs, leaves, grads)
    call = normalize_call(q, k, v, mask, table=runtime.current().costs.table())
    assert serves(call, None)
    got = fused_gradients(call, out.detach(), lse.detach(), dout, dlse)
    assert got is not None
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_calls_no_fused_backward_takes_are_refused():
    q, k, v = _qkv()
    assert not serves(normalize_call(q, k, v, None, softcap=5.0), None)  # softcap
    assert not serves(normalize_call(q, k, v, None), -1.0)  # a sign folded into q
    qe, ke, ve = _qkv(L=0)
    assert not serves(normalize_call(qe, ke, ve, None), None)  # nothing to compute
    q2, k2, v2 = _qkv(Dv=8)
    assert not serves(normalize_call(q2, k2, v2, None), None)  # D != Dv
