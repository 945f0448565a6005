"""attnkit.prepare: a prepared call is a value that runs new q, k, v of its kind exactly,
refuses inputs it was not prepared for with an error naming what changed, and explains
itself as `attnkit.explain` does."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import attnkit as ak
from attnkit.call import dispatch
from helpers import EXACT_BACKENDS


def _qkv(B=2, H=4, Hkv=2, L=6, S=9, D=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(B, h, n, D, generator=g).to(dtype) for h, n in ((H, L), (Hkv, S), (Hkv, S))
    )


def _masks():
    return [
        None,
        ak.causal(align="bottom_right"),
        ak.sliding_window(2, align="bottom_right") & ak.key_padding(torch.tensor([9, 4])),
        torch.rand(6, 9, generator=torch.Generator().manual_seed(1)) > 0.4,
        ak.Mask.from_mod(lambda b, h, i, j: (i + j) % 3 != 0, "stripes"),
    ]


@pytest.mark.parametrize("backend", ["auto", *EXACT_BACKENDS])
@pytest.mark.parametrize("mask", _masks(), ids=["none", "causal", "window&pad", "bool", "mod"])
def test_a_prepared_call_runs_new_inputs_as_attention_does(backend, mask):
    q, k, v = _qkv()
    step = ak.prepare(q, k, v, mask, backend=backend)
    for seed in range(3):
        q2, k2, v2 = _qkv(seed=seed)
        want = ak.attention(q2, k2, v2, mask, backend=backend)
        assert torch.equal(step(q2, k2, v2), want)
        torch.testing.assert_close(want, ak.attention(q2, k2, v2, mask, backend="reference"))


def test_with_lse_sinks_and_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv())
    mask = ak.causal(align="bottom_right")
    sinks = torch.linspace(-1.0, 1.0, 4)
    step = ak.prepare(q, k, v, mask, sinks=sinks, need_lse=True)
    out, lse = step.with_lse(q, k, v)
    want, want_lse = ak.attention_with_lse(q, k, v, mask, sinks=sinks)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    (out.sum() + lse.sum()).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (want.sum() + want_lse.sum()).backward()
    for got, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(got, t.grad)
    with pytest.raises(ValueError, match="need_lse=True"):
        ak.prepare(q, k, v, mask).with_lse(q, k, v)


def test_inputs_that_do_not_fit_raise_an_error_naming_what_changed():
    q, k, v = _qkv()
    lengths = torch.tensor([9, 4])
    mask = ak.causal(align="bottom_right") & ak.key_padding(lengths)
    step = ak.prepare(q, k, v, mask)
    q5, k5, v5 = _qkv(L=5)
    with pytest.raises(ak.PreparedMismatchError, match="q's shape"):
        step(q5, k5, v5)
    with pytest.raises(ak.PreparedMismatchError, match="q's dtype"):
        step(q.double(), k.double(), v.double())
    with pytest.raises(ak.PreparedMismatchError, match="whether autograd records"):
        step(q.clone().requires_grad_(), k, v)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        step(q.tolist(), k, v)  # type: ignore[arg-type]
    lengths[1] = 2  # the mask's tensor changed in place
    with pytest.raises(ak.PreparedMismatchError, match="changed in place"):
        step(q, k, v)
    assert isinstance(ak.PreparedMismatchError("x"), ValueError)
    again = ak.prepare(q, k, v, mask)  # prepared again: the new mask, exactly
    torch.testing.assert_close(again(q, k, v), ak.attention(q, k, v, mask, backend="reference"))


def test_other_strides_fit_and_stay_exact():
    q, k, v = _qkv()
    step = ak.prepare(q, k, v, ak.sliding_window(2, align="bottom_right"))
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, other strides
    ks = torch.stack([k, k], -1).flatten(-2)[..., ::2]  # last dim of stride 2
    want = ak.attention(q, k, v, ak.sliding_window(2, align="bottom_right"), backend="reference")
    torch.testing.assert_close(step(qt, ks, v), want)


def test_a_call_prepared_from_shapes_runs_tensors_of_them():
    shapes = (2, 4, 6, 8), (2, 2, 9, 8), (2, 2, 9, 8)
    step = ak.prepare(*shapes, ak.causal(align="bottom_right"), dtype=torch.float64)
    q, k, v = _qkv(dtype=torch.float64)
    want = ak.attention(q, k, v, ak.causal(align="bottom_right"), backend="reference")
    torch.testing.assert_close(step(q, k, v), want)
    grad = ak.prepare(*shapes, requires_grad=True)
    qg = q.float().requires_grad_()
    grad(qg, k.float(), v.float()).sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    with pytest.raises(TypeError, match="given as shapes"):
        ak.prepare(q, k, v, dtype=torch.float32)
    with pytest.raises(ak.ShapeContractError, match="4 dims"):
        ak.prepare((2, 4, 6), (2, 2, 9, 8), (2, 2, 9, 8))
    with pytest.raises(ak.ShapeContractError, match="sizes"):
        ak.prepare((2, 4, 6, -1), (2, 2, 9, 8), (2, 2, 9, 8))


@pytest.mark.parametrize("backend", ["auto", "tiled", "blockwise"])
def test_explain_of_a_prepared_call_is_explain_of_its_arguments(backend):
    q, k, v = _qkv(L=64, S=64)
    mask = ak.causal() & ak.sliding_window(7)
    plan = ak.prepare(q, k, v, mask, backend=backend).explain()
    want = ak.explain(q, k, v, mask, backend=backend)
    assert plan.backend == want.backend and plan.reasons == want.reasons
    assert plan.flops == want.flops and plan.shapes == want.shapes
    assert backend == "auto" or plan.backend == backend


def test_packed_documents_keep_each_documents_bits():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g) for _ in range(3))
    ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]])
    mask = ak.document(ids) & ak.causal()
    step = ak.prepare(q, k, v, mask)
    assert torch.equal(step(q, k, v), ak.attention(q, k, v, mask))
    assert "packed documents" in str(step.explain())


def test_a_prepared_call_runs_inside_torch_compile():
    q, k, v = _qkv()
    mask = ak.causal(align="bottom_right")
    step = ak.prepare(q, k, v, mask)
    compiled = torch.compile(lambda q, k, v: step(q, k, v), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), ak.attention(q, k, v, mask))


def test_the_cache_holds_no_mask_a_prepared_call_holds_its_own():
    q, k, v = _qkv()
    mask = ak.key_padding(torch.tensor([9, 4]))
    step = ak.prepare(q, k, v, mask)
    alive = weakref.ref(mask)
    del mask
    gc.collect()
    assert alive() is not None  # the user's prepared call keeps it
    del step
    gc.collect()
    assert alive() is None  # attention()'s cache does not
    dispatch.clear()
