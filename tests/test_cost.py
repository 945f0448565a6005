"""attnkit.cost: one table of factors per kind of CPU, chosen once and never measured by
a call; tiled's short blocks cost more per pair."""

from __future__ import annotations

import pytest

from attnkit import cost
from attnkit._compat import CPU_KINDS


def test_every_cpu_kind_has_a_table_that_names_its_source():
    for kind in CPU_KINDS:
        table = cost.built_in(kind)
        assert kind in table.source
        near = cost.NEAREST.get(kind, kind)
        assert table.factors() == cost.TABLES[near].factors()
        assert all(value > 0 for value in table.factors().values())
    assert cost.built_in("avx2") is cost.BUILT_IN
    with pytest.raises(ValueError, match="unknown CPU kind"):
        cost.built_in("pentium")


def test_use_sets_the_table_and_none_decides_again():
    mine = cost.CostTable(sdpa_masked=9.0, source="mine")
    before = cost.table()
    try:
        cost.use(mine)
        assert cost.table() is mine and "mine" in cost.table().summary()
        cost.use(None)
        assert cost.table() == before  # chosen again the same way (the tests pin avx2)
    finally:
        cost.use(before)


def test_short_blocks_cost_more_per_pair_and_256_rows_cost_the_base():
    table = cost.table()
    assert cost.tiled_pair(256) == pytest.approx(table.tiled_pair)
    assert cost.tiled_pair(1024) == pytest.approx(table.tiled_pair)  # capped at 256 rows
    costs = [cost.tiled_pair(rows) for rows in (1, 16, 64, 128, 256)]
    assert costs == sorted(costs, reverse=True)
    assert cost.tiled_pair(0) == cost.tiled_pair(1)  # no block has fewer than a row
