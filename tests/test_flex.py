"""The flex backend: FlexAttention with a Mask as mask_mod; auto uses it only once warm."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit._compat import flex_attention_module

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
