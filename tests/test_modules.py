"""Modules: MultiHeadAttention against nn.MultiheadAttention, KV cache, RoPE, ALiBi."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.masks import structure

torch.manual_seed(0)


def torch_mha(E=32, H=4, bias=True, kdim=None, vdim=None):
    torch.manual_seed(1)
    return nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=True).eval()


@pytest.mark.parametrize("bias", [True, False])
def test_self_attention_equals_torch(bias):
    ref = torch_mha(bias=bias)
    ours = ak.MultiHeadAttention.from_torch(ref).eval()
    x = torch.randn(2, 7, 32)
    expected, _ = ref(x, x, x, need_weights=False)
    torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)


def test_cross_attention_with_kdim_vdim_equals_torch():
    ref = torch_mha(kdim=12, vdim=20)
    ours = ak.MultiHeadAttention.from_torch(ref).eval()
    x, key, value = torch.randn(2, 5, 32), torch.randn(2, 9, 12), torch.randn(2, 9, 20)
    expected, _ = ref(x, key, value, need_weights=False)
    torch.testing.assert_close(ours(x, key, value), expected, atol=1e-5, rtol=0)


def test_key_padding_and_causal_masks_convert_from_torch_conventions():
    ref = torch_mha()
    ours = ak.MultiHeadAttention.from_torch(ref).eval()
    x = torch.randn(2, 6, 32)
    ignore = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])  # torch: True = ignore
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)  # torch: True = not allowed
    expected, _ = ref(x, x, x, key_padding_mask=ignore, attn_mask=future, need_weights=False)
    mask = ak.from_key_padding_mask(ignore) & ak.causal()
    torch.testing.assert_close(ours(x, mask=mask), expected, atol=1e-5, rtol=0)


def test_to_torch_round_trip_and_state_dict():
    ours = ak.MultiHeadAttention(32, 4).eval()
    x = torch.randn(1, 5, 32)
    back = ours.to_torch().eval()
    torch.testing.assert_close(back(x, x, x, need_weights=False)[0], ours(x), atol=1e-5, rtol=0)
    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    buffer.seek(0)
    fresh = ak.MultiHeadAttention(32, 4).eval()
    fresh.load_state_dict(torch.load(buffer))
    torch.testing.assert_close(fresh(x), ours(x))
    with pytest.raises(ValueError, match="GQA"):
        ak.MultiHeadAttention(32, 4, num_kv_heads=2).to_torch()


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"embed_dim": 30, "num_heads": 4}, "embed_dim=30 is not divisible by num_heads=4"),
        ({"embed_dim": 32, "num_heads": 4, "num_kv_heads": 3}, "num_heads=4 is not divisible"),
        ({"embed_dim": 32, "num_heads": 4, "backend": "fast"}, "unknown backend"),
    ],
)
def test_bad_constructor_arguments_say_why(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ak.MultiHeadAttention(**kwargs)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_kv_cache_decoding_equals_full_forward(num_kv_heads):
    mha = ak.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, rope=True).eval()
    x = torch.randn(2, 11, 32)
    full = mha(x, mask=ak.causal())
    cache = ak.KVCache()
    steps = [mha(x[:, :5], mask=ak.causal(), cache=cache)]  # prefill
    for t in range(5, 11):  # then one token at a time
        steps.append(mha(x[:, t : t + 1], mask=ak.causal(align="bottom_right"), cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.length == 11


def test_alibi_slopes_follow_the_paper():
    torch.testing.assert_close(ak.alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)]))
    expected6 = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    torch.testing.assert_close(ak.alibi_slopes(6), torch.tensor(expected6))


def test_alibi_bias_as_an_additive_mask():
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8)
    bias = ak.alibi_bias(4, 5)
    assert bias.shape == (1, 4, 5, 5) and bias[0, 0, 3, 1] == -2 * 2.0**-2
    causal_bias = bias.masked_fill(~ak.causal().materialize(1, 4, 5, 5), -torch.inf)
    scores = q @ k.mT / 8**0.5 + causal_bias
    expected = torch.softmax(scores, -1) @ v
    torch.testing.assert_close(ak.attention(q, k, v, causal_bias), expected)


def test_alibi_mask_equals_the_dense_bias_and_runs_tiled_without_an_l_by_s_tensor(monkeypatch):
    """`causal() & alibi(H)` == the dense alibi_bias with -inf above the diagonal."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 200, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 200, 16, generator=g, dtype=torch.float64) for _ in range(2))
    dense = (
        ak.alibi_bias(4, 200)
        .double()
        .masked_fill(~ak.causal().materialize(1, 4, 200, 200), -torch.inf)
    )
    expected = ak.attention(q, k, v, dense, backend="reference")
    (expected_grad,) = torch.autograd.grad(expected.sum(), q)
    mask = ak.causal() & ak.alibi(4)
    assert ak.explain(q, k, v, mask, backend="tiled").backend == "tiled"  # no refusal
    for name in ("dense", "materialize"):
        monkeypatch.setattr(ak.Mask, name, lambda *a, **kw: pytest.fail("built L×S"))
    monkeypatch.setattr(structure, "dense_bias", lambda *a, **kw: pytest.fail("built L×S"))
    got = ak.attention(q, k, v, mask, backend="tiled")
    (grad,) = torch.autograd.grad(got.sum(), q)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(grad, expected_grad)


def test_alibi_rows_decode_and_modules():
    q, k = torch.randn(1, 4, 9, 8), torch.randn(1, 4, 9, 8)
    mask = ak.causal() & ak.alibi(4)
    full = ak.attention_probs(q, k, mask)
    torch.testing.assert_close(ak.attention_probs(q, k, mask, rows=[2, 7]), full[:, :, [2, 7]])
    # decode: one query at the end of 9 keys sees the distances 8, 7, ..., 0
    last = ak.attention_probs(q[:, :, -1:], k, ak.alibi(4, align="bottom_right"))
    scores = q[:, :, -1:] @ k.mT / 8**0.5 + ak.alibi_bias(4, 1, 9, align="bottom_right")
    torch.testing.assert_close(last, torch.softmax(scores, -1))
    mha = ak.MultiHeadAttention(16, 4, backend="tiled")
    x = torch.randn(2, 9, 16)
    out = mha(x, mask=mask)
    mha.backend = "reference"
    torch.testing.assert_close(out, mha(x, mask=mask))


@pytest.mark.parametrize(
    ("make", "error", "words"),
    [
        (
            lambda: ak.attention(*(torch.randn(1, 2, 4, 8),) * 3, ak.alibi(4)),
            ak.ShapeContractError,
            "alibi\\(2\\)",
        ),
        (
            lambda: ak.attention(
                torch.randn(1, 4, 2, 8), *(torch.randn(1, 4, 5, 8),) * 2, ak.alibi(4)
            ),
            ak.ShapeContractError,
            "bottom_right",
        ),
        (lambda: ak.causal() | ak.alibi(4), ak.MaskError, "by `&` only"),
        (lambda: ~ak.alibi(4), ak.MaskError, "negate masks only"),
    ],
    ids=["heads", "alignment", "or", "not"],
)
def test_alibi_misuse_says_what_to_do(make, error, words):
    with pytest.raises(error, match=words):
        make()


def test_every_backend_gives_the_same_module_outputs_and_gradients():
    x = torch.randn(2, 70, 32)
    mask = ak.causal() & ak.key_padding(torch.tensor([70, 50]))
    results = {}
    for backend in ("reference", "sdpa", "tiled"):
        torch.manual_seed(3)
        mha = ak.MultiHeadAttention(32, 4, num_kv_heads=2, rope=True, backend=backend)
        out = mha(x, mask=mask)
        out.sum().backward()
        results[backend] = (out, [p.grad for p in mha.parameters()])
    for backend in ("sdpa", "tiled"):
        torch.testing.assert_close(results[backend][0], results["reference"][0])
        for g, r in zip(results[backend][1], results["reference"][1], strict=True):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_dropout_only_in_training():
    mha = ak.MultiHeadAttention(32, 4, dropout=0.5)
    x = torch.randn(1, 6, 32)
    mha.eval()
    torch.testing.assert_close(mha(x), mha(x))
    mha.train()
    assert not torch.equal(mha(x), mha(x))
