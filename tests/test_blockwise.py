"""The `blockwise` backend: the reference's math in row blocks, without an L×S tensor."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
import attnkit.backends.blockwise as blockwise
from fuzz_cases import RandomDraw, draw_case
from fuzz_check import run_case
from helpers import small_qkv

MASKS = {
    "none": lambda L: None,
    "causal": lambda L: ak.causal(),
    "sliding": lambda L: ak.sliding_window(20),
    "documents": lambda L: ak.document(torch.arange(L) // 70) & ak.causal(),
    "empty rows": lambda L: ak.causal() & ak.key_padding(torch.tensor([100, 0])),
    "per head": lambda L: ak.Mask.from_mod(lambda b, h, i, j: j <= i + 3 * h),
    "alibi": lambda L: ak.causal() & ak.alibi(4),
}


def _run(backend, q, k, v, mask, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = ak.attention_with_lse(*leaves, mask, backend=backend, **kwargs)
    loss = (out * out).sum() + lse.masked_fill(~torch.isfinite(lse), 0).sum()
    loss.backward()
    return [out, lse] + [t.grad for t in leaves]


@pytest.mark.parametrize("kind", list(MASKS))
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_many_blocks_equal_the_reference_in_float64(kind, softcap, monkeypatch):
    L = 300
    monkeypatch.setattr(blockwise, "BLOCK_BYTES", 4 * 2 * 4 * L * 37)  # blocks of 37 rows
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, L, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, L, 16, generator=g, dtype=torch.float64) for _ in range(2))
    mask = MASKS[kind](L)
    got = _run("blockwise", q, k, v, mask, softcap=softcap)
    want = _run("reference", q, k, v, mask, softcap=softcap)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=name)


def test_unseen_keys_holding_nan_never_leak(monkeypatch):
    monkeypatch.setattr(blockwise, "BLOCK_BYTES", 4 * 2 * 4 * 200 * 50)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 200, 16, generator=g)
    k, v = (torch.randn(2, 2, 200, 16, generator=g) for _ in range(2))
    k[0, :, 150:], v[0, :, 150:] = float("nan"), float("inf")  # keys row 0 never sees
    mask = ak.causal() & ak.key_padding(torch.tensor([150, 200]))
    out, _lse, dq, dk, dv = _run("blockwise", q, k, v, mask, softcap=3.0)
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))


def test_auto_trains_softcap_natively_or_blockwise_in_a_fraction_of_the_memory():
    """In training, softcap runs on the native kernel where it is built, else on
    blockwise (ATTNKIT_NATIVE=off), in a quarter of the reference's memory."""
    from attnkit.native import unavailable

    q, k = torch.randn(1, 8, 4096, 64, requires_grad=True), torch.randn(1, 8, 4096, 64)
    plan = ak.explain(q, k, k, ak.causal(), softcap=30.0)
    assert plan.backend == ("native" if unavailable() is None else "blockwise"), plan
    blockwise = ak.explain(q, k, k, ak.causal(), softcap=30.0, backend="blockwise")
    reference = ak.explain(q, k, k, ak.causal(), softcap=30.0, backend="reference")
    assert blockwise.peak_bytes * 4 <= reference.peak_bytes
    assert "softcap" in str(plan.reasons["sdpa"]) and "softcap" in str(plan.reasons["tiled"])


def test_alibi_in_a_mask_that_needs_its_seen_rows_runs_on_blockwise_and_auto():
    # fuzz seed 12 case 590: `seen` evaluated the mask for one head and alibi refused it
    q, k, v = small_qkv(H=3, Hkv=3, L=70, S=70, D=4, Dv=3)
    mask = ak.alibi(3) & (ak.causal(offset=5) | ak.key_padding(torch.tensor([50])))
    want = ak.attention(q, k, v, mask, softcap=5.0, backend="reference")
    for backend in ("blockwise", "auto"):
        got = ak.attention(q, k, v, mask, softcap=5.0, backend=backend)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_blockwise_at_extreme_logits_keeps_the_rule_with_the_score_rounding_slack():
    """Fuzz seed 16 case 2467 (|logit| ~ 1000, float32, key padding): blockwise's matmuls
    over key ranges round the scores otherwise than the reference, 1.3x the strict bound;
    like the fused kernels, it is held to the rule plus eps·max|s|."""
    outcomes = run_case(draw_case(RandomDraw(16, 2467)))
    blockwise = [o for o in outcomes if o.backend == "blockwise"]
    assert blockwise and all(o.status == "ok" for o in blockwise), blockwise
