"""attnkit.call.cost: one table per kind of CPU, chosen once and never measured by a call;
each backend owns its factors (built in per kind) and the table only says which kind's
and what was measured here; tiled's short blocks cost more per pair."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import runtime
from attnkit._compat import CPU_KINDS
from attnkit.backends import BACKENDS, get_backend
from attnkit.backends.tilecost import pair_cost
from attnkit.call import cost, precision
from attnkit.contracts import AttentionCall, normalize_call


def test_every_cpu_kind_has_a_table_that_names_its_source():
    for kind in CPU_KINDS:
        table = cost.built_in(kind)
        assert kind in table.source and table.kind == kind and not table.measured
        near = cost.NEAREST.get(kind, kind)
        for backend in BACKENDS.values():
            mine = table.of(backend.name, backend.cost_factors)
            own = backend.cost_factors.kinds.get(kind, {})  # a nearest-priced kind's own
            assert mine == {**cost.TABLES[near].of(backend.name, backend.cost_factors), **own}
            assert mine.keys() == backend.cost_factors.default.keys()
            assert all(value > 0 for value in mine.values())
    assert cost.built_in("avx2") is cost.BUILT_IN
    with pytest.raises(ValueError, match="unknown CPU kind"):
        cost.built_in("pentium")


def test_a_kinds_factors_are_its_own_over_the_defaults():
    factors = cost.Factors({"pair": 1.0, "call": 10.0}, {"amx": {"pair": 2.0}})
    assert factors.built_in("avx2") == {"pair": 1.0, "call": 10.0}
    assert factors.built_in("amx") == {"pair": 2.0, "call": 10.0}
    assert factors.built_in("avx512") == factors.built_in("amx")  # the nearest measured
    assert factors.built_in("other") == factors.built_in("avx2")
    mixed = cost.Factors(
        {"pair": 1.0, "call": 10.0}, {"amx": {"pair": 2.0, "call": 5.0}, "avx512": {"pair": 3.0}}
    )
    assert mixed.built_in("avx512") == {"pair": 3.0, "call": 5.0}  # its own over the nearest's


def test_measured_factors_override_the_built_in_ones_by_backend_name():
    sdpa = get_backend("sdpa")
    table = cost.CostTable("amx", "a test", measured={"sdpa": {"masked": 9.0}})
    assert table.of("sdpa", sdpa.cost_factors) == {
        **sdpa.cost_factors.built_in("amx"),
        "masked": 9.0,
    }
    tiled = get_backend("tiled")  # not measured: built in for the table's kind
    assert table.of("tiled", tiled.cost_factors) == tiled.cost_factors.built_in("amx")


def test_use_sets_the_table_and_none_decides_again():
    from attnkit.call.planner import cost_summary

    mine = cost.CostTable("avx2", "mine", measured={"sdpa": {"masked": 9.0}})
    before = runtime.current().costs.table()
    try:
        runtime.current().costs.use(mine)
        assert (
            runtime.current().costs.table() is mine
            and get_backend("sdpa").factors(runtime.current().costs.table())["masked"] == 9.0
        )
        assert "mine" in cost_summary() and "masked 9" in cost_summary()
        runtime.current().costs.use(None)
        assert (
            runtime.current().costs.table() == before
        )  # chosen again the same way (the tests pin avx2)
    finally:
        runtime.current().costs.use(before)


def test_a_timed_factor_scales_its_default_and_is_never_free():
    assert cost.rescaled(2.0, predicted=100.0, spent=150.0) == 3.0
    assert cost.rescaled(2.0, predicted=100.0, spent=-5.0) == pytest.approx(0.1)


def test_short_blocks_cost_more_per_pair_and_256_rows_cost_the_base():
    priced = get_backend("tiled").factors(runtime.current().costs.table())
    assert pair_cost(256, priced) == pytest.approx(priced["pair"])
    assert pair_cost(1024, priced) == pytest.approx(priced["pair"])  # capped at 256 rows
    costs = [pair_cost(rows, priced) for rows in (1, 16, 64, 128, 256)]
    assert costs == sorted(costs, reverse=True)
    assert pair_cost(0, priced) == pair_cost(1, priced)  # no block has fewer than a row


def _call(dtype: torch.dtype, grad: bool, mask: ak.Mask | None) -> AttentionCall:
    q, k, v = (torch.randn(1, 2, 64, 16, dtype=dtype, requires_grad=grad) for _ in range(3))
    return normalize_call(q, k, v, mask, table=runtime.current().costs.table())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_call_autograd_records_is_priced_at_its_forward_and_backward(dtype):
    """Every backend that can serve a training call declares what its backward adds."""
    trained, plain = _call(dtype, True, ak.causal()), _call(dtype, False, ak.causal())
    for backend in BACKENDS.values():
        assert backend.training_factor(plain) == 1.0
        factor = backend.training_factor(trained)
        assert factor > 1.0, backend.name
    with torch.no_grad():  # nothing records: the forward alone
        assert all(b.training_factor(trained) == 1.0 for b in BACKENDS.values())


def test_sdpa_prices_half_training_as_half_only_where_its_kernel_computes_half():
    call = _call(torch.bfloat16, True, None)
    sdpa = get_backend("sdpa")
    half = runtime.current().half.kernel_dtype(torch.bfloat16, call.q.device) in precision.HALF
    expected = sdpa.factors(runtime.current().costs.table())[
        "backward_half" if half else "backward"
    ]
    assert sdpa.training_factor(call) == expected


def test_explain_says_a_training_call_was_priced_forward_and_backward():
    q, k, v = (torch.randn(1, 2, 256, 16, requires_grad=True) for _ in range(3))
    plan = ak.explain(q, k, v, ak.sliding_window(31))
    priced = [r for r in plan.reasons.values() if r and r.startswith("slower here")]
    assert priced and all(r.endswith("(forward+backward)") for r in priced)
    with torch.no_grad():
        plain = ak.explain(q, k, v, ak.sliding_window(31))
    assert not any(r and "backward" in r for r in plain.reasons.values())
