"""The production call: lse, probs, empty rows, poisoned inputs, softcap, dropout, explain."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak

BACKENDS = ["reference", "sdpa", "tiled"]


def qkv(B=2, H=4, Hkv=2, L=6, S=6, D=8, Dv=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, L, D, generator=g, dtype=dtype),
        torch.randn(B, Hkv, S, D, generator=g, dtype=dtype),
        torch.randn(B, Hkv, S, Dv, generator=g, dtype=dtype),
    )


def naive_scores(q, k, scale=None):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    return q @ k.mT * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_is_the_log_sum_exp_of_visible_scores(backend):
    q, k, v = qkv()
    mask = ak.causal() & ak.key_padding(torch.tensor([6, 4]))
    out, lse = ak.attention_with_lse(q, k, v, mask, backend=backend)
    scores = naive_scores(q, k).masked_fill(~mask.materialize(2, 4, 6, 6), -torch.inf)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    torch.testing.assert_close(out, ak.attention(q, k, v, mask, backend="reference"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_rows_give_zero_output_minus_inf_lse_and_zero_gradients(backend, dtype):
    q, k, v = (t.requires_grad_() for t in qkv(dtype=dtype))
    mask = ak.key_padding(torch.tensor([4, 0]))  # batch row 1 sees nothing
    out = ak.attention(q, k, v, mask, backend=backend)
    with torch.no_grad():  # sdpa's log-sum-exp has no gradient, so it serves lse only here
        lse = ak.attention_with_lse(q, k, v, mask, backend=backend)[1]
    assert (out[1] == 0).all() and torch.isinf(lse[1]).all() and (lse[1] < 0).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[0]).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
        assert (t.grad[1] == 0).all()
    assert (k.grad[0, :, 4:] == 0).all() and (v.grad[0, :, 4:] == 0).all()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize(
    ("mask_kind", "backend"),
    [
        (kind, backend)
        for kind in ("padding", "causal_decode", "bias", "left_padding_causal")
        for backend in BACKENDS
        if not (kind == "bias" and backend == "tiled")  # tiled takes no additive bias
    ],
)
def test_keys_no_query_sees_never_change_results(backend, poison, mask_kind):
    q, k, v = qkv(L=5, S=6)
    if mask_kind == "padding":
        mask, hidden_keys, empty_rows = ak.key_padding(torch.tensor([4, 6])), (0, 4), None
    elif mask_kind == "causal_decode":
        mask, hidden_keys, empty_rows = ak.causal(align="top_left"), (slice(None), 5), None
    elif mask_kind == "bias":
        mask = torch.zeros(2, 1, 5, 6).index_fill(-1, torch.tensor([0, 2]), -torch.inf)
        hidden_keys, empty_rows = (slice(None), 2), None
    else:
        valid = torch.arange(6) >= 2  # first two keys are padding: query 0 of ... sees none
        mask = ak.causal(align="bottom_right") & ak.key_padding(valid[None].expand(2, 6))
        hidden_keys, empty_rows = (slice(None), 0), (slice(None), slice(None), 0)
    clean = [t.clone().requires_grad_() for t in (q, k, v)]
    dirty = [t.clone() for t in (q, k, v)]
    b, j = hidden_keys
    dirty[1][b, :, j] = poison
    dirty[2][b, :, j] = poison
    if empty_rows is not None:
        dirty[0][empty_rows] = poison
    dirty = [t.requires_grad_() for t in dirty]
    outs = []
    for tensors in (clean, dirty):
        out = ak.attention(*tensors, mask, backend=backend)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out)
    assert torch.isfinite(outs[1]).all()
    torch.testing.assert_close(outs[1], outs[0])
    for c, d in zip(clean, dirty, strict=True):
        assert torch.isfinite(d.grad).all()
        torch.testing.assert_close(d.grad, c.grad)


def test_attention_probs_rows_equal_the_full_weights():
    q, k, _ = qkv(L=9, S=9)
    mask = ak.sliding_window(2) & ak.key_padding(torch.tensor([9, 5]))
    full = ak.attention_probs(q, k, mask)
    scores = naive_scores(q, k).masked_fill(~mask.materialize(2, 4, 9, 9), -torch.inf)
    torch.testing.assert_close(full, torch.softmax(scores, -1).nan_to_num(0.0))
    rows = [0, 4, 8]
    part = ak.attention_probs(q, k, mask, rows=rows)
    assert part.shape == (2, 4, 3, 9)
    torch.testing.assert_close(part, full[:, :, rows])
    torch.testing.assert_close(ak.attention_probs(q, k, mask, rows=slice(2, 5)), full[:, :, 2:5])


def test_attention_probs_with_bias_and_softcap():
    q, k, _ = qkv(L=4, S=5)
    bias = torch.randn(1, 4, 4, 5)
    got = ak.attention_probs(q, k, bias, softcap=2.0, rows=[1, 3])
    s = naive_scores(q, k)
    expected = torch.softmax(2.0 * torch.tanh(s / 2.0) + bias, -1)[:, :, [1, 3]]
    torch.testing.assert_close(got, expected)


def test_attention_probs_rows_out_of_range():
    q, k, _ = qkv()
    with pytest.raises(ak.ShapeContractError, match="outside the L=6"):
        ak.attention_probs(q, k, rows=[6])


def test_softcap_is_applied_before_the_mask_and_auto_avoids_sdpa():
    q, k, v = qkv()
    got = ak.attention(q, k, v, ak.causal(), softcap=1.5)
    s = naive_scores(q, k)
    s = (1.5 * torch.tanh(s / 1.5)).masked_fill(~ak.build_causal_mask(6), -torch.inf)
    torch.testing.assert_close(got, torch.softmax(s, -1) @ v.repeat_interleave(2, 1))
    plan = ak.explain(q, k, v, ak.causal(), softcap=1.5)
    assert plan.backend in ("native", "reference") and "softcap" in plan.reasons["sdpa"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_scale(backend):
    q, k, v = qkv()
    torch.testing.assert_close(
        ak.attention(q, k, v, scale=0.5, backend=backend),
        ak.attention(q * 0.5 * math.sqrt(8), k, v, backend="reference"),
    )


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_dropout_is_unbiased_and_random(backend):
    q, k, v = qkv(B=1, H=2, Hkv=2, L=3, S=4)
    torch.manual_seed(0)
    runs = torch.stack([ak.attention(q, k, v, dropout_p=0.3, backend=backend) for _ in range(400)])
    assert not torch.equal(runs[0], runs[1])
    torch.testing.assert_close(runs.mean(0), ak.attention(q, k, v), atol=0.15, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_lse_gradient_is_exact(backend):
    q, k, v = (t.double().requires_grad_() for t in qkv(L=70, S=70))
    mask = ak.sliding_window(20) & ak.key_padding(torch.tensor([70, 50]))
    out, lse = ak.attention_with_lse(q, k, v, mask, backend=backend)
    weight = torch.linspace(-1, 1, lse.numel(), dtype=torch.float64).view_as(lse)
    grads = torch.autograd.grad((out.sum() + (lse * weight).sum()), (q, k, v))
    scores = naive_scores(q, k).masked_fill(~mask.materialize(2, 4, 70, 70), -torch.inf)
    expected_lse = torch.logsumexp(scores, -1)
    expected_out = torch.softmax(scores, -1) @ v.repeat_interleave(2, 1)
    expected = torch.autograd.grad((expected_out.sum() + (expected_lse * weight).sum()), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_sdpa_lse_has_no_gradient_so_auto_picks_another_backend():
    q, k, v = (t.requires_grad_() for t in qkv())
    plan = ak.explain(q, k, v, ak.causal(), need_lse=True)
    assert plan.backend != "sdpa" and "no gradient" in plan.reasons["sdpa"]
    with torch.no_grad():
        assert ak.explain(q, k, v, ak.causal(), need_lse=True).backend == "sdpa"


def test_sdpa_needs_no_dropout_for_lse_so_auto_falls_back():
    q, k, v = qkv()
    plan = ak.explain(q, k, v, dropout_p=0.1, need_lse=True)
    assert plan.backend == "reference" and "dropout" in plan.reasons["sdpa"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_keeps_dtype_and_lse_is_float32(dtype):
    q, k, v = qkv(dtype=dtype)
    for backend in BACKENDS:
        out, lse = ak.attention_with_lse(q, k, v, ak.causal(), backend=backend)
        assert out.dtype == dtype and lse.dtype == torch.float32


def test_explain_counts_allowed_pairs_and_gives_reasons():
    q, k, v = qkv(B=2, H=4, Hkv=2, L=6, S=6, D=8, Dv=16)
    plan = ak.explain(q, k, v, ak.causal())
    assert plan.backend == "sdpa"
    assert plan.flops == 2 * 2 * 4 * (6 * 7 // 2) * (8 + 16)
    assert plan.density == pytest.approx(21 / 36)
    assert plan.reasons["sdpa"] is None and "sdpa" in plan.reasons["reference"]
    assert plan.peak_bytes == 0  # is_causal: no mask tensor at all
    text = str(plan)
    assert "backend 'sdpa'" in text and "causal()" in text and "GFLOP" in text
    forced = ak.explain(q, k, v, ak.causal(), backend="reference")
    assert forced.backend == "reference" and forced.shapes["scores"] == (2, 4, 6, 6)
    assert forced.peak_bytes >= 2 * 4 * 6 * 6 * 4
