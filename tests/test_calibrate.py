"""attnkit.calibrate: the cost table measured on this CPU, kept per machine, off on demand."""

from __future__ import annotations

import json
import math

import pytest
import torch

import attnkit as ak
from attnkit import calibrate, cost


@pytest.fixture
def fresh_table(monkeypatch):
    """`cost.table()` decides again under the test's environment, and forgets after."""
    cost.use(None)
    yield monkeypatch
    cost.use(None)


def test_a_measured_table_is_kept_and_read_back(fresh_table, tmp_path):
    path = tmp_path / "cost.json"
    fresh_table.setenv("ATTNKIT_CALIBRATION", str(path))
    fresh_table.setattr(calibrate, "QUIET_SHARE", 0.0)  # kept whatever else runs beside
    measured = cost.table()
    assert "measured on this CPU" in measured.source
    factors = measured.factors()
    assert factors.keys() == cost.BUILT_IN.factors().keys()
    assert all(math.isfinite(x) and x > 0 for x in factors.values())
    assert factors["sdpa_dense"] == 1.0  # the unit
    kept = json.loads(path.read_text())
    assert kept["machine"] == calibrate.machine_key() and kept["factors"] == factors

    def no_second_measurement():
        raise AssertionError("measured again: the kept table was not read")

    fresh_table.setattr(calibrate, "measure", no_second_measurement)
    cost.use(None)
    again = cost.table()
    assert again.factors() == factors and str(path) in again.source
    q = torch.randn(1, 2, 64, 16)
    assert str(path) in str(ak.explain(q, q, q, ak.causal()))  # explain says where from


def test_a_table_of_another_machine_or_a_broken_file_is_measured_again(fresh_table, tmp_path):
    path = tmp_path / "cost.json"
    fresh_table.setenv("ATTNKIT_CALIBRATION", str(path))
    fake = cost.CostTable(tiled_pair=9.0, source="measured here (a test)")
    fresh_table.setattr(calibrate, "measure", lambda: fake)
    for content in ("not json", json.dumps({"machine": {"cpu": "elsewhere"}, "factors": {}})):
        path.write_text(content)
        cost.use(None)
        assert cost.table() is fake
    assert json.loads(path.read_text())["factors"]["tiled_pair"] == 9.0


def test_off_gives_the_built_in_table_and_a_table_decides_auto(fresh_table):
    fresh_table.setenv("ATTNKIT_CALIBRATION", "off")
    assert cost.table() is cost.BUILT_IN
    q = torch.randn(1, 2, 512, 16)
    mask = ak.sliding_window(16) & ak.causal()
    assert ak.explain(q, q, q, mask).backend == "tiled"
    cost.use(cost.CostTable(tiled_pair=50.0, tiled_causal=50.0, source="a test"))
    plan = ak.explain(q, q, q, mask)
    assert plan.backend == "sdpa" and "a test" in str(plan)


def test_a_failed_calibration_prices_with_the_built_in_table(fresh_table, tmp_path):
    fresh_table.setenv("ATTNKIT_CALIBRATION", str(tmp_path / "cost.json"))

    def failing():
        raise RuntimeError("no timer here")

    fresh_table.setattr(calibrate, "measure", failing)
    found = cost.table()
    assert found.factors() == cost.BUILT_IN.factors() and "no timer here" in found.source
    q = torch.randn(1, 2, 64, 16)
    torch.testing.assert_close(
        ak.attention(q, q, q, ak.causal()), ak.attention(q, q, q, ak.causal(), backend="reference")
    )
    assert not (tmp_path / "cost.json").exists()


def test_the_measured_cost_of_short_blocks_picks_the_tile_height(fresh_table):
    """A CPU where short blocks run badly (a large `tiled_short`) gets taller tiles."""
    from attnkit.backends.tileplan import best_plan

    mask = ak.sliding_window(255) & ak.causal()
    heights = {}
    for short in (0.01, 0.5):
        cost.use(cost.CostTable(tiled_short=short, source="a test"))
        heights[short] = best_plan(mask, 1, 8, 8, 4096, 4096).tile
    assert heights[0.01] < heights[0.5]


def test_the_short_block_exponent_is_measured_in_bounds():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 512, 64, generator=g) for _ in range(3))
    assert 0.01 <= calibrate._short_blocks((q, k, v)) <= 0.5


def test_a_table_measured_on_a_busy_cpu_serves_its_process_but_is_not_kept(fresh_table, tmp_path):
    path = tmp_path / "cost.json"
    fresh_table.setenv("ATTNKIT_CALIBRATION", str(path))
    calls = []

    def busy():
        calls.append(1)
        return {**cost.BUILT_IN.factors(), "tiled_call": 2e6}, 0.55  # another program ran

    fresh_table.setattr(calibrate, "_measured", busy)
    fresh_table.setattr(calibrate.time, "sleep", lambda s: None)
    found = cost.table()
    assert len(calls) == calibrate.ATTEMPTS  # measured again after a pause
    assert calibrate.BUSY in found.source and found.tiled_call == 2e6
    assert not path.exists()  # the next process measures again
    assert calibrate.main() == 0 and path.exists()  # asked for explicitly: kept anyway


def test_a_quiet_retry_is_kept(fresh_table, tmp_path):
    path = tmp_path / "cost.json"
    fresh_table.setenv("ATTNKIT_CALIBRATION", str(path))
    shares = iter([0.4, 0.97])
    fresh_table.setattr(calibrate, "_measured", lambda: (cost.BUILT_IN.factors(), next(shares)))
    fresh_table.setattr(calibrate.time, "sleep", lambda s: None)
    found = cost.table()
    assert calibrate.BUSY not in found.source and path.exists()
