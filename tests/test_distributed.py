"""attnkit.distributed: 2, 3 and 4 gloo processes (odd sizes catch ring bugs) against one
process, in float64 (against the reference, 1e-10) and float32 (against attnkit, 1e-5).

Each test starts one process group and runs many checks in it (tests/cp_cases.py: every
mask and layout, the strategies, softcap, GQA/MQA, NaN in unseen keys, the traffic, the
layouts); the slow variant runs every strategy on every mask in both dtypes.
"""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
import attnkit.distributed as akd
import cp_cases
from attnkit.distributed.layout import Layout
from attnkit.distributed.pieces import Problem
from attnkit.distributed.plan import plan_context
from cp_harness import spawn

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_context_parallel_equals_one_process(P):
    spawn(cp_cases.suite, P, False)


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 3, 4])
def test_context_parallel_full_matrix(P):
    spawn(cp_cases.suite, P, True)


# ------------------------------------------------ in one process: layouts, plans, errors


def test_zigzag_gives_rank_r_chunks_r_and_2p_minus_1_minus_r():
    lay = Layout.of("zigzag", 3, 12)
    assert [lay.chunks(r) for r in range(3)] == [
        [(0, 2), (10, 12)], [(2, 4), (8, 10)], [(4, 6), (6, 8)]
    ]  # fmt: skip
    assert sorted(lay.order().tolist()) == list(range(12))
    assert Layout.of("contiguous", 3, 12).positions(1).tolist() == [4, 5, 6, 7]


def test_a_length_that_does_not_split_names_the_padding():
    with pytest.raises(ak.ShapeContractError, match=r"pad it by 2 position\(s\) to L=12"):
        Layout.of("zigzag", 3, 10)
    with pytest.raises(ValueError, match="layout must be one of"):
        Layout.of("striped", 2, 8)


def _problem(mask, P=4, Hkv=2, layout="contiguous", L=64):
    return Problem(mask, 1, 4, Hkv, 8, 8, Layout.of(layout, P, L), None, None)


def test_the_plan_skips_pairs_the_mask_never_connects_and_auto_takes_the_fewest_bytes():
    window = _problem(ak.sliding_window(3))
    needs = window.needs()
    assert needs == [[r == s or r == s + 1 for s in range(4)] for r in range(4)]
    plan = plan_context(window, 1, "auto", kv_bytes=100, q_bytes=100, out_bytes=100)
    assert plan.strategy == "ring" and plan.bytes_sent["ring"] == 100 and plan.peers == [2]
    assert plan.bytes_sent["allgather"] == 300 and plan.skipped == 16 - 7
    assert plan.pairs[0] == 3 + 2 + 1 and plan.pairs[1] == 16 * 4 - 6  # keys of rank 0, 1
    assert plan.reasons["ring"] is None and "sends more" in plan.reasons["allgather"]
    everyone = _problem(None, Hkv=4)  # no mask: every pair; ulysses sends the least here
    assert plan_context(everyone, 0, "auto", 100, 10, 10).strategy == "ulysses"
    # ulysses where it can serve, unless the ring sends less than half of its bytes
    assert plan_context(_problem(None, P=2, Hkv=4), 0, "auto", 100, 100, 100).strategy == "ulysses"
    narrow = _problem(ak.sliding_window(3), Hkv=4)  # the ring: 100 bytes from the busiest rank
    assert plan_context(narrow, 0, "auto", 100, 300, 300).strategy == "ring"  # ulysses 525
    assert plan_context(narrow, 0, "auto", 100, 50, 50).strategy == "ulysses"  # ulysses 150


def test_ulysses_refuses_heads_that_do_not_split_and_unknown_strategies_are_named():
    problem = _problem(ak.causal(), P=4, Hkv=2)
    plan = plan_context(problem, 0, "auto", 100, 100, 100)
    assert plan.bytes_sent["ulysses"] is None and "Hkv=2" in plan.reasons["ulysses"]
    with pytest.raises(ValueError, match="Hkv=2 K/V heads do not split over P=4"):
        plan_context(problem, 0, "ulysses", 100, 100, 100)
    with pytest.raises(ValueError, match="strategy must be 'auto' or one of"):
        plan_context(problem, 0, "tree", 100, 100, 100)


def test_without_a_process_group_the_error_says_how_to_start_one():
    if torch.distributed.is_initialized():
        pytest.skip("a process group exists in this process")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        akd.attention(q, q, q, ak.causal())


def test_the_agreement_fingerprint_sees_any_one_value_and_ignores_layout():
    from attnkit.distributed.agree import describe

    ids = torch.arange(48).view(2, 24) // 5
    base = describe(ak.document(ids), contents=True)
    assert describe(ak.document(ids.t().contiguous().t()), contents=True) == base
    for where in [(0, 0), (1, 23), (1, 7)]:
        changed = ids.clone()
        changed[where] += 1
        assert describe(ak.document(changed), contents=True) != base, where
    x = torch.randn(3, 5)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.bool):
        y = x.to(dtype)
        z = y.clone()
        z[2, 4] = ~z[2, 4] if dtype == torch.bool else -z[2, 4]
        assert describe(y, contents=True) != describe(z, contents=True), dtype
        assert describe(y) == describe(z)  # without contents: shape, dtype, device only
