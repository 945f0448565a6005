"""The sdpa backend's lean path for calls that need no gradient (decoding against a
padded cache): the kernel runs on the inputs as given and only a non-finite output
brings the cleaning back; NaN and Inf in keys no query sees never reach the result."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.backends import sdpa as sdpa_module

B, H, HKV, D, S = 3, 8, 2, 16, 40


def _inputs(L, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, L, D, generator=g, dtype=torch.float64),
        torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64),
        torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64),
    )


def _cleanings(monkeypatch):
    count = [0]
    original = sdpa_module.zero_unseen

    def counting(*args):
        count[0] += 1
        return original(*args)

    monkeypatch.setattr(sdpa_module, "zero_unseen", counting)
    return count


@pytest.mark.parametrize("L", [1, 5])  # a decoding step, a chunk of prefill
@pytest.mark.parametrize("poison", [None, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_cache_slots_never_reach_the_output(L, poison, dtype, monkeypatch):
    q, k, v = _inputs(L)
    lengths = torch.tensor([S, 17, 0])  # a full row, a padded one, one with no key
    mask = ak.causal(align="bottom_right") & ak.key_padding(lengths)
    want = ak.attention(q, k, v, mask, backend="reference").to(dtype)
    padded = torch.arange(S)[None, None, :, None] >= lengths[:, None, None, None]
    if poison is not None:
        k, v = k.masked_fill(padded, poison), v.masked_fill(padded, poison)
    cleanings = _cleanings(monkeypatch)
    with torch.no_grad():
        got = ak.attention(*(t.to(dtype) for t in (q, k, v)), mask, backend="sdpa")
    assert torch.isfinite(got).all() and (got[2] == 0).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # a decoding step: cleaned only when it showed; a chunk (rows that see different keys)
    # has its keys and values checked first, their non-finite entries zeroed before SDPA
    assert cleanings[0] == (0 if poison is None or L > 1 else 1)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_call_that_needs_gradients_is_cleaned_first(poison, monkeypatch):
    q, k, v = _inputs(3)
    lengths = torch.tensor([S, 11, 2])
    mask = ak.causal(align="bottom_right") & ak.key_padding(lengths)
    padded = torch.arange(S)[None, None, :, None] >= lengths[:, None, None, None]
    clean = [t.clone().requires_grad_() for t in (q, k, v)]
    bad = [
        q.clone().requires_grad_(),
        k.masked_fill(padded, poison).requires_grad_(),
        v.masked_fill(padded, poison).requires_grad_(),
    ]
    cleanings = _cleanings(monkeypatch)
    out = ak.attention(*bad, mask, backend="sdpa")
    assert cleanings[0] == 1
    out.sum().backward()
    ak.attention(*clean, mask, backend="reference").sum().backward()
    for got, want in zip(bad, clean, strict=True):
        assert torch.isfinite(got.grad).all()
        torch.testing.assert_close(got.grad.masked_fill(got.grad.isnan(), 0), want.grad)


@pytest.mark.parametrize("native", [True, False])
def test_gqa_lse_and_flash_backward_with_and_without_the_ops_own_gqa(native, monkeypatch):
    """The log-sum-exp path and the flash backward give K/V with fewer heads to the CPU
    flash op where it groups them itself (`TorchFacts.flash_gqa`), else repeated: same
    result."""
    from attnkit.backends import BACKENDS
    from attnkit.contracts import normalize_call

    facts = BACKENDS["sdpa"].facts
    if native and not facts.flash_gqa:
        pytest.skip("this torch's CPU flash op has no GQA")
    monkeypatch.setattr(facts, "flash_gqa", native)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, h, 10, 8, generator=g) for h in (6, 2, 2))
    mask = ak.causal()
    out, lse = ak.attention_with_lse(q, k, v, mask, backend="sdpa")
    want_out, want_lse = ak.attention_with_lse(q, k, v, mask, backend="reference")
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    dout = torch.randn_like(out)
    call = normalize_call(q, k, v, mask, scale=None, softcap=None, dropout_p=0.0)
    grads = BACKENDS["sdpa"].backward(call, out, lse, dout, None)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ak.attention(*leaves, mask, backend="reference").backward(dout)
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad)
