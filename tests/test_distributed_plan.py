"""Which strategy a context-parallel call takes and what it skips (`distributed.plan`)."""

from __future__ import annotations

import pytest

import attnkit as ak
from attnkit.distributed.layout import Layout
from attnkit.distributed.pieces import GlobalCall
from attnkit.distributed.plan import plan_context


def _global_call(mask, P=4, Hkv=2, layout="contiguous", L=64):
    return GlobalCall(mask, 1, 4, Hkv, 8, 8, Layout.of(layout, P, L), None, None)


def test_the_plan_skips_pairs_the_mask_never_connects_and_auto_takes_the_fewest_bytes():
    window = _global_call(ak.sliding_window(3))
    needs = window.needs()
    assert needs == [[r == s or r == s + 1 for s in range(4)] for r in range(4)]
    plan = plan_context(window, 1, "auto", kv_bytes=100, q_bytes=100, out_bytes=100)
    assert plan.strategy == "ring" and plan.bytes_sent["ring"] == 100 and plan.peers == [2]
    assert plan.bytes_sent["allgather"] == 300 and plan.skipped == 16 - 7
    assert plan.pairs[0] == 3 + 2 + 1 and plan.pairs[1] == 16 * 4 - 6  # keys of rank 0, 1
    assert plan.reasons["ring"] is None and "sends more" in plan.reasons["allgather"]
    everyone = _global_call(None, Hkv=4)  # no mask: every pair; ulysses sends the least here
    assert plan_context(everyone, 0, "auto", 100, 10, 10).strategy == "ulysses"
    # ulysses where it can serve, unless the ring sends less than half of its bytes
    assert (
        plan_context(_global_call(None, P=2, Hkv=4), 0, "auto", 100, 100, 100).strategy == "ulysses"
    )
    narrow = _global_call(ak.sliding_window(3), Hkv=4)  # the ring: 100 bytes from the busiest rank
    assert plan_context(narrow, 0, "auto", 100, 300, 300).strategy == "ring"  # ulysses 525
    assert plan_context(narrow, 0, "auto", 100, 50, 50).strategy == "ulysses"  # ulysses 150


def test_ulysses_refuses_heads_that_do_not_split_and_unknown_strategies_are_named():
    global_call = _global_call(ak.causal(), P=4, Hkv=2)
    plan = plan_context(global_call, 0, "auto", 100, 100, 100)
    assert plan.bytes_sent["ulysses"] is None and "Hkv=2" in plan.reasons["ulysses"]
    with pytest.raises(ValueError, match="Hkv=2 K/V heads do not split over P=4"):
        plan_context(global_call, 0, "ulysses", 100, 100, 100)
    with pytest.raises(ValueError, match="strategy must be 'auto' or one of"):
        plan_context(global_call, 0, "tree", 100, 100, 100)
