"""The planner: which backend serves a call, what `explain` reports."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak


def test_explain_counts_every_query_of_a_mask_broadcast_over_queries():
    x = torch.randn(1, 1, 8, 16)
    plan = ak.explain(x, x, x, torch.ones(1, 8, dtype=torch.bool))
    assert plan.flops == 2 * 8 * 8 * 32 and plan.density == 1.0
    valid = torch.tensor([[True, False, True, True, False, True, True, True]])  # not one run
    plan = ak.explain(x, x, x, ak.key_padding(valid))
    assert plan.flops == 2 * 8 * 6 * 32 and plan.density == pytest.approx(6 / 8)
