"""Attention sinks: a per-head logit in every row's softmax denominator, with no value."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from helpers import assert_rule

BACKENDS = ["reference", "tiled", "auto"]  # sdpa's log-sum-exp carries no gradient


def sink_truth(q, k, v, visible, sinks, scale=None):
    """GPT-OSS's eager formula in float64: the sink as one more column of logits, its
    weight dropped after the softmax."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if visible is not None:
        s = s.masked_fill(~visible, -torch.inf)
    column = sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]  # (B, H, L, S)
    lse = torch.logsumexp(torch.cat([s, column], -1), -1)
    return p @ v, lse, p


def _inputs(dtype, L=37, S=37, H=4, Hkv=2, D=16):
    g = torch.Generator().manual_seed(L + S)
    q = torch.randn(2, H, L, D, generator=g).to(dtype)
    k, v = (torch.randn(2, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    sinks = (torch.randn(H, generator=g) * 2).to(dtype)
    return q, k, v, sinks


MASKS = {
    "none": lambda L, S: None,
    "causal": lambda L, S: ak.causal(),
    "empty rows": lambda L, S: ak.causal() & ak.key_padding(torch.tensor([S // 2, 0])),
    "sliding": lambda L, S: ak.sliding_window(5),
    "documents": lambda L, S: ak.document(torch.arange(S) // 9) & ak.causal(),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_match_the_concatenated_column_formula_with_gradients(backend, kind, dtype):
    q, k, v, sinks = _inputs(dtype)
    mask = MASKS[kind](q.shape[2], k.shape[2])
    visible = None if mask is None else mask.materialize(2, 4, q.shape[2], k.shape[2])
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    out, lse, _ = sink_truth(*leaves[:3], visible, leaves[3])
    dout = torch.randn_like(out)
    ((out * dout).sum() + lse.sum()).backward()
    truth = [out.detach(), lse.detach()] + [t.grad for t in leaves]

    got_leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    got_out, got_lse = ak.attention_with_lse(
        *got_leaves[:3], mask, sinks=got_leaves[3], backend=backend
    )
    ((got_out * dout.to(dtype)).sum() + got_lse.sum()).backward()
    got = [got_out, got_lse] + [t.grad for t in got_leaves]
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    for name, g, t in zip(names, got, truth, strict=True):
        assert torch.isfinite(g).all(), name
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(
            g.double(), t, atol=tol * max(1.0, float(t.abs().max())), rtol=tol, msg=name
        )
    if kind == "empty rows":  # batch row 1 sees nothing: out 0, lse = the sink
        assert got_out[1].abs().max() == 0
        torch.testing.assert_close(got_lse[1], sinks.float().view(-1, 1).expand(4, q.shape[2]))


def test_sinks_hold_the_rule_against_float64_in_float32():
    q, k, v, sinks = _inputs(torch.float32, L=97, S=97)
    mask = ak.causal()
    visible = mask.materialize(2, 4, 97, 97)
    truth = sink_truth(q, k, v, visible, sinks)[0]
    ref = sink_truth(q.float(), k.float(), v.float(), visible, sinks.float())[0]
    for backend in BACKENDS:
        got = ak.attention(q, k, v, mask, sinks=sinks, backend=backend)
        assert_rule(f"{backend} sinks", got, ref.float(), truth)


def test_attention_probs_with_sinks_leave_the_sink_its_share():
    q, k, v, sinks = _inputs(torch.float32, L=9, S=9)
    probs = ak.attention_probs(q, k, ak.causal(), sinks=sinks)
    _, _, p = sink_truth(q, k, v, ak.causal().materialize(2, 4, 9, 9), sinks)
    torch.testing.assert_close(probs.double(), p, atol=1e-6, rtol=1e-5)
    assert (probs.sum(-1) < 1).all()
    rows = ak.attention_probs(q, k, ak.causal(), sinks=sinks, rows=[3, 8])
    torch.testing.assert_close(rows, probs[:, :, [3, 8]])


def test_sinks_inside_torch_compile_match_eager():
    torch._dynamo.reset()
    q, k, v, sinks = _inputs(torch.float32, L=16, S=16)

    def fn(q, k, v, sinks):
        return ak.attention(q, k, v, ak.causal(), sinks=sinks).tanh()

    def grads(f):
        leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
        out = f(*leaves)
        out.square().sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    for got, want in zip(grads(torch.compile(fn, fullgraph=True)), grads(fn), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("sinks", "error", "match"),
    [
        (torch.zeros(3), ak.ShapeContractError, r"sinks has shape \(3,\) but q has H=4 heads"),
        (
            torch.zeros(4, dtype=torch.long),
            TypeError,
            r"sinks must be a float tensor of shape \(H,\)",
        ),
        ([0.0] * 4, TypeError, r"got list"),
        (torch.tensor([0.0, -torch.inf, 0.0, 0.0]), ValueError, r"sinks must be finite logits"),
    ],
)
def test_bad_sinks_say_what_is_expected(sinks, error, match):
    q, k, v, _ = _inputs(torch.float32, L=5, S=5)
    with pytest.raises(error, match=match):
        ak.attention(q, k, v, sinks=sinks)
    with pytest.raises(error, match=match):
        ak.explain(q, k, v, sinks=sinks)


def test_explain_with_sinks_plans_for_the_log_sum_exp():
    q, k, v, sinks = _inputs(torch.float32, L=64, S=64)
    q.requires_grad_()
    plan = ak.explain(q, k, v, ak.causal(), sinks=sinks)
    assert plan.backend != "sdpa" and "log-sum-exp" in str(plan.reasons["sdpa"])
