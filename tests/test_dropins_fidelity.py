"""`sdpa` as torch's SDPA has it at the edges, and torch's `CausalBias` wherever attnkit
takes a mask: each case from a reproducer of what PyTorch's own SDPA tests found."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attnkit as ak

BIASES = [(causal_upper_left, "top_left"), (causal_lower_right, "bottom_right")]


def _qkv(B=2, H=4, L=5, S=7, D=8, Dv=8, dtype=torch.float64, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, L, D), (B, H, S, D), (B, H, S, Dv))
    return tuple(torch.randn(*s, generator=g, dtype=dtype).requires_grad_(grad) for s in shapes)


def _grads(out, inputs):
    return torch.autograd.grad(out.sum(), inputs)


# ------------------------------------------------------------------ CausalBias


@pytest.mark.parametrize(("make", "align"), BIASES, ids=["upper_left", "lower_right"])
@pytest.mark.parametrize(("L", "S"), [(5, 7), (6, 6), (1, 9)])
def test_causal_bias_is_the_causal_mask_it_stands_for(make, align, L, S):
    q, k, v = _qkv(L=L, S=S)
    bias = make(L, S)
    want = ak.attention(q, k, v, ak.causal(align=align), backend="reference")
    wanted = _grads(want, (q, k, v))
    for got in (
        ak.attention(q, k, v, bias),
        ak.sdpa(q, k, v, bias),
        ak.attention_with_lse(q, k, v, bias)[0],
    ):
        torch.testing.assert_close(got, want)
        for a, b in zip(_grads(got, (q, k, v)), wanted, strict=True):
            torch.testing.assert_close(a, b)
    assert ak.explain(q, k, v, bias).backend == ak.explain(q, k, v, ak.causal(align=align)).backend


@pytest.mark.parametrize(("make", "align"), BIASES, ids=["upper_left", "lower_right"])
def test_causal_bias_equals_torchs_own_sdpa_with_it(make, align):
    q, k, v = _qkv(L=5, S=7, dtype=torch.float32)
    torch.testing.assert_close(
        ak.sdpa(q, k, v, make(5, 7)), F.scaled_dot_product_attention(q, k, v, make(5, 7))
    )


def test_causal_bias_with_is_causal_raises_torchs_value_error():
    q, k, v = _qkv(L=5, S=5)
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        ak.sdpa(q, k, v, causal_upper_left(5, 5), is_causal=True)


def test_causal_bias_of_other_sizes_is_refused_naming_both():
    q, k, v = _qkv(L=5, S=7)
    with pytest.raises(ak.ShapeContractError, match=r"L=5 queries and S=6 keys.*L=5 and S=7"):
        ak.attention(q, k, v, causal_lower_right(5, 6))


@pytest.mark.parametrize(("make", "align"), BIASES, ids=["upper_left", "lower_right"])
def test_causal_bias_compiles_fullgraph_with_backward(make, align):
    torch._dynamo.reset()
    q, k, v = _qkv(L=5, S=7, dtype=torch.float32)
    compiled = torch.compile(lambda q, k, v, m: ak.sdpa(q, k, v, m), fullgraph=True)
    got = compiled(q, k, v, make(5, 7))
    want = ak.attention(q, k, v, ak.causal(align=align))
    torch.testing.assert_close(got, want)
    for a, b in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b)


def test_causal_bias_reaches_the_modules():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(16, 4).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    torch.testing.assert_close(mha(x, mask=causal_upper_left(6, 6)), mha(x, mask=ak.causal()))


# ------------------------------------------------------------------ SDPA's edge cases


@pytest.mark.parametrize("dims", [(1, 2, 2), (2, 1, 2), (2, 2, 1)])
def test_inputs_of_fewer_than_two_dims_are_refused_naming_the_dims(dims):
    shapes = {1: (4,), 2: (1, 4)}
    q, k, v = (torch.randn(*shapes[n]) for n in dims)
    with pytest.raises(RuntimeError, match=rf"at least 2 dimensional.*query.dim: {dims[0]}"):
        ak.sdpa(q, k, v)


def test_two_dim_inputs_run_as_torchs():
    q, k, v = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 6)
    torch.testing.assert_close(ak.sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("enable_gqa", [False, True])
def test_zero_query_heads_give_the_empty_output(enable_gqa):
    q = torch.randn(2, 0, 5, 8)
    k = v = torch.randn(2, 2 if enable_gqa else 0, 6, 8)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)
    got = ak.sdpa(q, k, v, enable_gqa=enable_gqa)
    assert got.shape == want.shape == (2, 0, 5, 8)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_head_dim_zero_averages_the_values_as_torch_does(causal, mask):
    q, k, v = _qkv(L=5, S=5, D=0, Dv=3)
    attn_mask = {
        None: None,
        "bool": torch.rand(5, 5, generator=torch.Generator().manual_seed(1)) < 0.7,
        "float": torch.randn(5, 5, dtype=torch.float64),
    }[mask]
    if causal and attn_mask is not None:
        return  # refused by both
    got = ak.sdpa(q, k, v, attn_mask, is_causal=causal)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=causal)
    keep = ~want.isnan()  # torch's empty rows are NaN on some paths: ours are 0
    torch.testing.assert_close(got[keep], want[keep])
    for a, b in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v)), strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b.nan_to_num(0.0))


def test_head_dim_zero_in_attention_too():
    q, k, v = _qkv(L=4, S=6, D=0, Dv=2)
    visible = ak.causal(align="bottom_right")
    got = ak.attention(q, k, v, visible)
    rows = visible.materialize(1, 1, 4, 6)[0, 0].to(v.dtype)  # (L, S)
    want = (rows / rows.sum(-1, keepdim=True)) @ v  # each row: the mean of its values
    torch.testing.assert_close(got, want)


def test_a_dtype_mismatch_is_both_type_error_and_runtime_error():
    q, k, v = _qkv(grad=False, dtype=torch.float32)
    for call in (lambda: ak.sdpa(q, k.double(), v), lambda: ak.attention(q, k, v.half())):
        for kind in (TypeError, RuntimeError, ak.DtypeMismatchError):
            with pytest.raises(kind, match="dtype mismatch"):
                call()


def test_fewer_key_heads_without_enable_gqa_names_enable_gqa():
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match=r"enable_gqa=True"):
        ak.sdpa(q, k, v)
    with pytest.raises(RuntimeError):  # torch refuses it too
        F.scaled_dot_product_attention(q, k, v)


def test_sdpa_keeps_torchs_float_masks_that_attention_refuses():
    q, k, v = _qkv(L=5, S=5, grad=False, dtype=torch.float32)
    keep_as_float = torch.tril(torch.ones(5, 5))
    torch.testing.assert_close(
        ak.sdpa(q, k, v, keep_as_float), F.scaled_dot_product_attention(q, k, v, keep_as_float)
    )
    with pytest.raises(ak.MaskError, match=r"\.bool\(\).*from_additive_mask"):
        ak.attention(q, k, v, keep_as_float)
    torch.testing.assert_close(  # what was meant
        ak.attention(q, k, v, keep_as_float.bool()), ak.attention(q, k, v, ak.causal())
    )


def test_additive_masks_of_minus_inf_and_dtype_min_still_pass():
    q, k, v = _qkv(L=5, S=5, grad=False, dtype=torch.float32)
    hidden = ~torch.tril(torch.ones(5, 5, dtype=torch.bool))
    for fill in (float("-inf"), torch.finfo(torch.float32).min):
        bias = torch.zeros(5, 5).masked_fill(hidden, fill)
        torch.testing.assert_close(ak.attention(q, k, v, bias), ak.attention(q, k, v, ak.causal()))


@pytest.mark.parametrize("dims", [(None, None), (None, 4), (2, None)])
def test_to_block_mask_takes_none_for_batch_and_heads_as_flex_does(dims):
    pytest.importorskip("torch.nn.attention.flex_attention")
    padding = ak.key_padding(torch.tensor([100, 256]))
    block = padding.to_block_mask(*dims, 256, 256, block_size=128)
    full = padding.to_block_mask(2, dims[1] or 1, 256, 256, block_size=128)
    assert block.kv_num_blocks.shape[0] == 2  # the mask's own batch: exact per row
    torch.testing.assert_close(block.kv_num_blocks[:, :1], full.kv_num_blocks[:, :1])


def test_routing_torchs_sdpa_to_attnkit_does_not_make_attnkit_call_itself(monkeypatch):
    q, k, v = _qkv(L=6, S=6, dtype=torch.float32)
    mask = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(2)) > 0.3
    want = [
        F.scaled_dot_product_attention(q, k, v, mask),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
    ]
    monkeypatch.setattr(F, "scaled_dot_product_attention", ak.sdpa)  # how people swap it in
    got = [
        F.scaled_dot_product_attention(q, k, v, mask),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
    ]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
        _grads(a, (q, k, v))
