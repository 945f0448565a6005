"""The flex backend: FlexAttention with a Mask as mask_mod; auto uses it only once warm."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit._compat import flex_attention_module
from helpers import small_qkv

pytestmark = pytest.mark.skipif(flex_attention_module() is None, reason="no FlexAttention")


def test_flex_is_exact_and_auto_takes_it_only_once_compiled():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 200, 32, generator=g)
    k, v = torch.randn(2, 2, 200, 32, generator=g), torch.randn(2, 2, 200, 32, generator=g)
    mask = ak.sliding_window(40) & ak.key_padding(torch.tensor([200, 0]))  # row 1 empty
    cold = ak.explain(q, k, v, mask)
    assert cold.backend != "flex" and "compile" in cold.reasons["flex"]
    out = ak.attention(q, k, v, mask, backend="flex")
    torch.testing.assert_close(out, ak.attention(q, k, v, mask, backend="reference"))
    assert (out[1] == 0).all()
    warm = ak.explain(q, k, v, mask)
    assert "compile" not in (warm.reasons["flex"] or "")


def test_flex_refuses_gradients_and_lse_on_cpu():
    q = torch.randn(1, 2, 64, 16, requires_grad=True)
    plan = ak.explain(q, q, q, ak.causal())
    assert "no backward on CPU" in plan.reasons["flex"]
    with torch.no_grad():
        lse_plan = ak.explain(q, q, q, ak.causal(), need_lse=True)
    assert "log-sum-exp" in lse_plan.reasons["flex"]


@pytest.mark.skipif(flex_attention_module() is None, reason="no FlexAttention")
def test_flex_with_poisoned_unseen_keys_an_expanded_head_dependent_mask_and_float64():
    g = torch.Generator().manual_seed(0)
    q, k, v = small_qkv(H=4, Hkv=2, L=30, S=30)
    per_head = torch.rand(1, 4, 1, 30, generator=g) < 0.6
    per_head[:, :, :, 25:] = False  # keys 25.. are seen by no head
    mask = per_head.expand(1, 4, 30, 30)  # an expanded view, different for each head
    k[:, :, 25:], v[:, :, 25:] = float("nan"), float("inf")
    with torch.no_grad():
        got = ak.attention(q, k, v, mask, backend="flex")
        want = ak.attention(q, k, v, mask, backend="reference")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want)
    x = torch.randn(1, 1, 30, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32, float16 and bfloat16"):
        ak.attention(x, x, x, ak.causal(), backend="flex")


@pytest.mark.skipif(flex_attention_module() is None, reason="no FlexAttention")
def test_flex_never_returns_a_wrong_result_for_small_ragged_shapes():
    """PyTorch 2.13's compiled CPU flex misreads some shapes (L=16, S=8 gave NaN here): a
    new kernel is checked against the reference on its first call and refused if wrong."""
    q, k, v = small_qkv(B=2, L=16, S=8)
    mask = ak.causal(align="top_left") & ak.key_padding(torch.tensor([8, 5]))
    with torch.no_grad():
        want = ak.attention(q, k, v, mask, backend="reference")
        try:
            got = ak.attention(q, k, v, mask, backend="flex")
        except ValueError as refusal:
            assert "gave wrong results for this shape" in str(refusal)
            assert "wrong results" in (ak.explain(q, k, v, mask).reasons["flex"] or "")
            return
    torch.testing.assert_close(got, want)


def test_flex_on_lengths_broadcast_over_the_batch_answers_exactly():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 20, 32, generator=g)[..., :16]  # a slice of a wider buffer
    k, v = torch.randn(3, 1, 14, 16, generator=g), torch.randn(3, 1, 14, 16, generator=g)
    mask = ~(ak.causal(align="bottom_right") & ak.key_padding(torch.tensor([13])))
    want = ak.attention(q, k, v, mask, backend="reference")
    torch.testing.assert_close(ak.attention(q, k, v, mask, backend="flex"), want)
    torch.testing.assert_close(ak.attention(q, k, v, mask), want)


def test_a_compiler_failure_on_flex_is_a_typed_refusal_and_auto_still_answers(monkeypatch):
    from attnkit.backends import BACKENDS

    flex = BACKENDS["flex"]
    q, k, v = small_qkv(H=2, Hkv=2, L=9, S=9)
    mask = ak.sliding_window(2) & ak.key_padding(torch.tensor([7]))

    def broken(*args, **kwargs):
        raise RuntimeError("LoweringException: AssertionError: all the buffers ...")

    monkeypatch.setattr(flex, "_compiled", broken)
    with pytest.raises(ValueError, match=r"torch\.compile failed to build its kernel"):
        ak.attention(q, k, v, mask, backend="flex")
    assert "torch.compile failed" in ak.explain(q, k, v, mask).reasons["flex"]
    torch.testing.assert_close(
        ak.attention(q, k, v, mask), ak.attention(q, k, v, mask, backend="reference")
    )


def test_a_mask_that_has_run_on_flex_still_compiles_with_fullgraph():
    mask = ak.sliding_window(15)
    q = k = v = torch.randn(1, 2, 128, 32, generator=torch.Generator().manual_seed(0))
    before = dict(vars(mask))
    eager = ak.attention(q, k, v, mask, backend="flex")
    assert vars(mask) == before  # masks are values: flex keeps its block masks itself
    compiled = torch.compile(lambda q, k, v: ak.attention(q, k, v, mask), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), eager)
    inside = torch.compile(lambda q, k, v: ak.attention(q, k, v, mask, backend="flex"))
    torch.testing.assert_close(inside(q, k, v), eager)
