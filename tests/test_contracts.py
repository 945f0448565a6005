"""Every contract error is raised at the boundary and names the dimension and the fix."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from helpers import EXACT_BACKENDS, out_and_grads, small_qkv


def qkv(B=2, H=4, Hkv=4, L=5, S=5, D=8, Dv=8):
    return torch.randn(B, H, L, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, Dv)


def test_errors_are_value_errors():
    assert issubclass(ak.ShapeContractError, ValueError)
    assert issubclass(ak.MaskError, ValueError)


@pytest.mark.parametrize(
    ("shapes", "pattern"),
    [
        (dict(D=8), None),
        ({"q": (2, 4, 5, 8), "k": (2, 4, 5, 16)}, r"head dim mismatch: q has D=8 but k has D=16"),
        ({"k": (2, 4, 5, 8), "v": (2, 4, 6, 8)}, r"K/V length mismatch: k has S=5 .* v has S=6"),
        ({"q": (2, 6, 5, 8), "k": (2, 4, 5, 8)}, r"H=6 .* not divisible by Hkv=4"),
        ({"q": (3, 4, 5, 8)}, r"batch mismatch: q has B=3, k has B=2"),
        ({"q": (4, 5, 8)}, r"q must have 4 dims .* split_heads"),
        ({"k": (2, 4, 5, 8), "v": (2, 2, 5, 8)}, r"k has Hkv=4 heads but v has 2"),
    ],
)
def test_shape_errors_name_the_dimension(shapes, pattern):
    q_shape = shapes.get("q", (2, 4, 5, 8))
    k_shape = shapes.get("k", (2, 4, 5, 8))
    v_shape = shapes.get("v", k_shape)
    if pattern is None:
        assert ak.attention_contract_ok(q_shape, k_shape, v_shape, "self")
        return
    assert not ak.attention_contract_ok(q_shape, k_shape, v_shape, "cross")
    with pytest.raises(ak.ShapeContractError, match=pattern):
        ak.check_attention_contract(q_shape, k_shape, v_shape, "cross")
    tensors = [torch.randn(s) for s in (q_shape, k_shape, v_shape)]
    with pytest.raises(ak.ShapeContractError, match=pattern):
        ak.attention(*tensors)


def test_self_mode_needs_equal_lengths_but_cross_does_not():
    q, k, v = (2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8)
    assert ak.attention_contract_ok(q, k, v, "cross")
    with pytest.raises(ak.ShapeContractError, match=r"L=5 .* S=7 .* mode='cross'"):
        ak.check_attention_contract(q, k, v, "self")


def test_gqa_is_accepted_and_dv_may_differ():
    dims = ak.check_attention_contract((2, 8, 5, 16), (2, 2, 5, 16), (2, 2, 5, 32), "self")
    assert (dims.H, dims.Hkv, dims.groups, dims.Dv) == (8, 2, 4, 32)


def test_unknown_mode():
    with pytest.raises(ValueError, match="self"):
        ak.check_attention_contract((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1), "both")


def test_mask_not_broadcastable_names_the_dim():
    q, k, v = qkv()
    with pytest.raises(ak.ShapeContractError, match="its L dim is 3, expected 1 or 5"):
        ak.attention(q, k, v, torch.ones(2, 1, 3, 5, dtype=torch.bool))
    with pytest.raises(ak.ShapeContractError, match=r"bias|mask of shape"):
        ak.attention(q, k, v, torch.zeros(7, 5))


def test_bad_lengths_negative_and_beyond_s():
    q, k, v = qkv()
    with pytest.raises(ak.MaskError, match="lengths must be >= 0"):
        ak.attention(q, k, v, ak.key_padding(torch.tensor([-1, 3])))
    with pytest.raises(ak.MaskError, match="exceed S=5"):
        ak.attention(q, k, v, ak.key_padding(torch.tensor([6, 3])))


def test_negative_window():
    with pytest.raises(ak.MaskError, match="left=-3"):
        ak.sliding_window(-3)


def test_causal_with_l_ne_s_and_no_alignment():
    q, k, v = qkv(L=2, S=5)
    with pytest.raises(
        ak.ShapeContractError,
        match=r"L=2 queries and S=5 keys.*align='top_left'.*align='bottom_right'",
    ):
        ak.attention(q, k, v, ak.causal())
    with pytest.raises(ak.ShapeContractError, match="sliding_window"):
        ak.attention(q, k, v, ak.sliding_window(2))


def test_device_mismatch_names_the_argument():
    q, k, v = qkv()
    with pytest.raises(ak.ShapeContractError, match="device mismatch: k is on meta"):
        ak.attention(q, k.to("meta"), v)
    with pytest.raises(ak.ShapeContractError, match="device mismatch: mask"):
        ak.attention(q, k, v, torch.ones(5, 5, dtype=torch.bool, device="meta"))


def test_dtype_errors_are_type_errors():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"dtype mismatch: q is torch.float32, k is torch.float16"):
        ak.attention(q, k.half(), v)
    with pytest.raises(TypeError, match="floating point"):
        ak.attention(q.long(), k, v)
    with pytest.raises(TypeError, match=r"torch.Tensor"):
        ak.attention(q.tolist(), k, v)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"softcap": 0.0}, "softcap must be > 0"),
        ({"dropout_p": 1.0}, r"dropout_p must lie in \[0, 1\)"),
        ({"scale": float("nan")}, "scale must be a finite"),
        ({"backend": "flash3"}, r"unknown backend 'flash3'; choose one of \('auto'"),
    ],
)
def test_bad_options(kwargs, pattern):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=pattern):
        ak.attention(q, k, v, **kwargs)


def test_a_backend_that_cannot_serve_says_why():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"'sdpa' cannot serve this call: .* no softcap"):
        ak.attention(q, k, v, softcap=30.0, backend="sdpa")


def _last_dim_strided(t):
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _every_other(t):  # x[..., ::2] of a wider tensor holding the same values
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


@pytest.mark.parametrize("layout", [_last_dim_strided, _every_other], ids=["vT", "step2"])
@pytest.mark.parametrize("backend", EXACT_BACKENDS)
def test_inputs_whose_last_dim_is_not_contiguous(backend, layout):
    q, k, v = small_qkv(Hkv=2, L=70, S=70)  # MHA, and a mask that hides no key: no copy on
    mask = ak.causal()  # the way (GQA's repeat, zeroing hidden keys) hides the strides
    want = out_and_grads(q, k, v, mask, "reference", lse=backend != "sdpa")
    got = out_and_grads(layout(q), layout(k), layout(v), mask, backend, lse=backend != "sdpa")
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w)
    with torch.no_grad():  # attention_with_lse on sdpa/auto ran the flash op on strides
        out, lse = ak.attention_with_lse(q, k, layout(v), mask, backend=backend)
        want_lse = ak.attention_with_lse(q, k, v, mask, backend="reference")[1]
    torch.testing.assert_close(out, want[0])
    torch.testing.assert_close(lse, want_lse)


def test_a_gradient_whose_last_dim_is_not_contiguous_reaches_the_tiled_backward():
    q, k, v = small_qkv(Hkv=2, L=40, S=40)
    w = torch.randn(1, 2, 8, 40)  # the loss reads out transposed: its gradient is w.mT

    def grads_through_transpose(backend):
        q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
        out = ak.attention(q_, k_, v_, ak.causal(), backend=backend)
        return torch.autograd.grad((out.transpose(-1, -2) * w).sum(), (q_, k_, v_))

    for want, got in zip(
        grads_through_transpose("reference"), grads_through_transpose("tiled"), strict=True
    ):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("L", [5, 100])
@pytest.mark.parametrize("scale", [0.0, -0.5])
@pytest.mark.parametrize("backend", EXACT_BACKENDS)
def test_zero_and_negative_scales_are_exact_with_a_causal_mask(backend, scale, L):
    q, k, v = small_qkv(L=L, S=L)
    want = out_and_grads(q.double(), k.double(), v.double(), ak.causal(), "reference", scale=scale)
    got = out_and_grads(q, k, v, ak.causal(), backend, scale=scale)
    for w, g in zip(want, got, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w.float(), atol=1e-5, rtol=1e-4)
    if scale == 0.0:  # every score is 0: each row averages the values it sees
        expected = v.cumsum(2) / torch.arange(1, L + 1).view(1, 1, L, 1)
        torch.testing.assert_close(got[0], expected.expand_as(got[0]), atol=1e-5, rtol=1e-5)
