"""attnkit.call.calibrate: `auto` prices with a table chosen, never measured, unless asked: the
one `attnkit calibrate` kept for this machine, else the one built in for the CPU's kind;
so a first call costs what a second does and every process picks the same backend."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch

import attnkit as ak
from attnkit import runtime
from attnkit._compat import CPU_KINDS, cpu_kind
from attnkit.backends import BACKENDS, get_backend
from attnkit.call import calibrate, cost
from helpers import span_backend


@pytest.fixture
def fresh_table(monkeypatch, tmp_path):
    """`runtime.current().costs.table()` decides again under the test's environment (an empty cache
    directory; no measuring unless the test allows it), and forgets after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("ATTNKIT_CALIBRATION", raising=False)
    runtime.current().costs.use(None)
    yield monkeypatch
    runtime.current().costs.use(None)


def _never_measure():
    raise AssertionError("measured, but nobody asked")


def _fake_measurement(share: float = 0.97, **factors: dict[str, float]):
    """`calibrate._measured` that times nothing: `factors` by backend name."""
    calls = []

    def measured():
        calls.append(share)
        return factors, share

    return measured, calls


def _tiled_call(table: cost.CostTable) -> float:
    return table.of("tiled", get_backend("tiled").cost_factors)["call"]


def test_with_no_setting_nothing_is_measured_and_the_built_in_table_prices(fresh_table, tmp_path):
    fresh_table.setattr(calibrate, "measure", _never_measure)
    q = torch.randn(1, 2, 64, 16)
    ak.attention(q, q, q, ak.causal())
    assert runtime.current().costs.table() is cost.built_in() is cost.TABLES[cpu_kind()]
    assert f"built in for {cpu_kind()} (" in str(ak.explain(q, q, q, ak.causal()))
    assert not (tmp_path / "cache").exists()  # nothing written either


def test_a_kept_table_is_read_and_off_ignores_it(fresh_table):
    fresh_table.setattr(calibrate, "measure", _never_measure)
    fake = cost.CostTable(cpu_kind(), "measured here (a test)", measured={"tiled": {"pair": 9.0}})
    kept = calibrate._write(calibrate.cache_path(), fake)
    assert calibrate.factors(kept) == calibrate.factors(fake)
    found = runtime.current().costs.table()
    assert calibrate.factors(found) == calibrate.factors(fake)
    assert found.of("tiled", get_backend("tiled").cost_factors)["pair"] == 9.0
    assert found.source.startswith(f"measured on this CPU, kept in {calibrate.cache_path()}")
    fresh_table.setenv("ATTNKIT_CALIBRATION", "off")
    runtime.current().costs.use(None)
    assert runtime.current().costs.table() is cost.built_in()


def test_a_named_file_that_holds_no_table_for_this_machine_gives_the_built_in_one(
    fresh_table, tmp_path, caplog
):
    fresh_table.setattr(calibrate, "measure", _never_measure)
    path = tmp_path / "cost.json"
    fresh_table.setenv("ATTNKIT_CALIBRATION", str(path))
    for content in ("not json", json.dumps({"machine": {"cpu": "elsewhere"}, "factors": {}})):
        path.write_text(content)
        runtime.current().costs.use(None)
        found = runtime.current().costs.table()
        assert calibrate.factors(found) == calibrate.factors(cost.built_in())
        assert found.source.startswith(cost.built_in().source)
        assert f"no table for this machine in {path}" in found.source
        assert path.read_text() == content  # read, never written
    assert "attnkit calibrate" in caplog.text  # how to make one


def test_every_kind_has_a_built_in_table_that_names_it():
    assert cpu_kind() in CPU_KINDS and set(cost.TABLES) == set(CPU_KINDS)
    for kind in CPU_KINDS:
        source = cost.built_in(kind).source
        assert source.startswith(f"built in for {kind} (")
        near = cost.NEAREST.get(kind)
        assert (f"nearest measured: {near};" in source) == (near is not None)
        if near is not None:  # the nearest's factors, but a backend's own for this kind
            own = {b.name: b.cost_factors.kinds.get(kind, {}) for b in BACKENDS.values()}
            nearest = calibrate.factors(cost.built_in(near)).items()
            expected = {name: {**f, **own.get(name, {})} for name, f in nearest}
            assert calibrate.factors(cost.built_in(kind)) == expected
    assert "2026-12-02" in cost.built_in("amx").source
    assert calibrate.factors(cost.built_in("amx")) != calibrate.factors(cost.built_in("avx2"))
    defaults = {b.name: dict(b.cost_factors.default) for b in BACKENDS.values()}
    assert cost.built_in("avx2") is cost.BUILT_IN
    assert calibrate.factors(cost.BUILT_IN) == {n: f for n, f in defaults.items() if f}
    with pytest.raises(ValueError, match="avx2"):
        cost.built_in("sse4")


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_a_kind_named_in_the_setting_prices_with_its_table(fresh_table, kind):
    fresh_table.setenv("ATTNKIT_CALIBRATION", kind)
    assert runtime.current().costs.table() is cost.built_in(kind)


def test_a_table_decides_auto(fresh_table):
    fresh_table.setenv("ATTNKIT_CALIBRATION", "avx2")
    q = torch.randn(1, 2, 512, 16)
    mask = ak.sliding_window(16) & ak.causal()
    assert ak.explain(q, q, q, mask).backend == span_backend()
    slow = {"tiled": {"pair": 50.0, "causal": 50.0}, "native": {"pair": 50.0}}
    runtime.current().costs.use(cost.CostTable("avx2", "a test", measured=slow))
    plan = ak.explain(q, q, q, mask)
    assert plan.backend == "sdpa" and "a test" in str(plan)


def test_a_measured_table_is_kept_and_read_back(fresh_table, tmp_path, capsys):
    """`attnkit calibrate` measures for real, keeps the table where the setting says."""
    path = tmp_path / "cost.json"
    fresh_table.setenv("ATTNKIT_CALIBRATION", str(path))
    assert calibrate.main() == 0
    kept = json.loads(path.read_text())
    factors = kept["factors"]
    assert kept["machine"] == calibrate.machine_key()
    built_in = calibrate.factors(cost.built_in())
    assert {n: f.keys() for n, f in factors.items()} == {n: f.keys() for n, f in built_in.items()}
    assert all(math.isfinite(x) and x > 0 for f in factors.values() for x in f.values())
    assert factors["flex"] == built_in["flex"]  # not timed (it compiles): built in
    assert factors["sdpa"] != built_in["sdpa"]  # timed
    assert f"kept in {path}" in capsys.readouterr().out
    fresh_table.setattr(calibrate, "measure", _never_measure)
    runtime.current().costs.use(None)
    again = runtime.current().costs.table()
    assert calibrate.factors(again) == factors and str(path) in again.source
    q = torch.randn(1, 2, 64, 16)
    assert str(path) in str(ak.explain(q, q, q, ak.causal()))  # explain says where from


def test_measure_measures_at_first_use_and_keeps_the_table(fresh_table):
    fresh_table.setenv("ATTNKIT_CALIBRATION", "measure")
    measured, calls = _fake_measurement(tiled={"call": 2e6})
    fresh_table.setattr(calibrate, "_measured", measured)
    found = runtime.current().costs.table()
    assert calls and _tiled_call(found) == 2e6
    assert found.source.startswith(f"measured on this CPU, kept in {calibrate.cache_path()}")
    fresh_table.delenv("ATTNKIT_CALIBRATION")  # a later process, asking for nothing
    fresh_table.setattr(calibrate, "measure", _never_measure)
    runtime.current().costs.use(None)
    assert _tiled_call(runtime.current().costs.table()) == 2e6


def test_a_failed_calibration_prices_with_the_built_in_table(fresh_table, tmp_path):
    fresh_table.setenv("ATTNKIT_CALIBRATION", "measure")

    def failing():
        raise RuntimeError("no timer here")

    fresh_table.setattr(calibrate, "measure", failing)
    found = runtime.current().costs.table()
    assert calibrate.factors(found) == calibrate.factors(cost.built_in())
    assert "no timer here" in found.source
    q = torch.randn(1, 2, 64, 16)
    torch.testing.assert_close(
        ak.attention(q, q, q, ak.causal()), ak.attention(q, q, q, ak.causal(), backend="reference")
    )
    assert not (tmp_path / "cache").exists()


def test_a_table_measured_on_a_busy_cpu_is_kept_with_a_warning(fresh_table, caplog, capsys):
    fresh_table.setenv("ATTNKIT_CALIBRATION", "measure")
    measured, calls = _fake_measurement(share=0.55, tiled={"call": 2e6})  # another program ran
    fresh_table.setattr(calibrate, "_measured", measured)
    fresh_table.setattr(calibrate.time, "sleep", lambda s: None)
    with caplog.at_level(logging.WARNING, logger="attnkit"):
        found = runtime.current().costs.table()
    assert len(calls) == calibrate.ATTEMPTS  # measured again after a pause
    assert _tiled_call(found) == 2e6 and calibrate.BUSY in found.source
    assert calibrate.cache_path().exists()  # asked for: kept all the same
    assert calibrate.BUSY in caplog.text and "attnkit calibrate" in caplog.text
    assert calibrate.main() == 0
    err = capsys.readouterr().err
    assert f"warning: {calibrate.BUSY}" in err and calibrate.AGAIN in err


def test_a_quiet_retry_leaves_no_warning(fresh_table, caplog):
    fresh_table.setenv("ATTNKIT_CALIBRATION", "measure")
    shares = iter([0.4, 0.97])
    fresh_table.setattr(calibrate, "_measured", lambda: ({}, next(shares)))
    fresh_table.setattr(calibrate.time, "sleep", lambda s: None)
    found = runtime.current().costs.table()
    assert calibrate.BUSY not in found.source and calibrate.cache_path().exists()
    assert calibrate.BUSY not in caplog.text


def test_the_measured_cost_of_short_blocks_picks_the_tile_height(fresh_table):
    """A CPU where short blocks run badly (a large tiled `short`) gets taller tiles."""
    from attnkit.backends.tilecost import FACTORS
    from attnkit.backends.tileplan import best_plan

    mask = ak.sliding_window(255) & ak.causal()
    heights = {}
    for short in (0.01, 0.5):
        table = cost.CostTable("avx2", "a test", measured={"tiled": {"short": short}})
        heights[short] = best_plan(mask, 1, 8, 8, 4096, 4096, table.of("tiled", FACTORS)).tile
    assert heights[0.01] < heights[0.5]


def test_the_short_block_exponent_is_measured_in_bounds():
    from attnkit.backends.tilecost import _short_blocks

    assert 0.01 <= _short_blocks(calibrate._Probe()) <= 0.5


def test_a_kept_table_naming_other_factors_than_a_backend_has_is_not_read(fresh_table):
    """A table kept by another version (a factor renamed, added or gone) prices nothing."""
    fresh_table.setattr(calibrate, "measure", _never_measure)
    fake = cost.CostTable(cpu_kind(), "a test", measured={"tiled": {"pair": 9.0}})
    path = calibrate.cache_path()
    calibrate._write(path, fake)
    data = json.loads(path.read_text())
    data["factors"]["tiled"]["old_name"] = 1.0
    path.write_text(json.dumps(data))
    assert calibrate._read(path) is None
    assert runtime.current().costs.table() is cost.built_in()
    del data["factors"]["tiled"]["old_name"], data["factors"]["sdpa"]  # one backend absent
    path.write_text(json.dumps(data))
    kept = calibrate._read(path)
    assert kept is not None and kept.of("tiled", get_backend("tiled").cost_factors)["pair"] == 9.0
    sdpa = get_backend("sdpa").cost_factors
    assert kept.of("sdpa", sdpa) == sdpa.built_in(cpu_kind())  # built in for the kind


# ------------------------------------------------------------ processes side by side

# one process: its first and second attention call, and what `auto` picks for five calls
_PROCESS = """
import json, time, torch
import attnkit as ak
from attnkit.call import calibrate, cost

measured = []
calibrate.measure = lambda: measured.append(1) or cost.BUILT_IN
q = torch.randn(1, 2, 64, 16)
times = []
for _ in range(2):
    start = time.perf_counter()
    ak.attention(q, q, q, ak.causal())
    times.append(time.perf_counter() - start)

def qkv(L, S=None, B=1):
    return torch.zeros(B, 8, L, 64), torch.zeros(B, 8, S or L, 64), torch.zeros(B, 8, S or L, 64)

calls = [
    (qkv(1024), ak.causal()),
    (qkv(2048), ak.sliding_window(128)),
    (qkv(2048), ak.document(torch.arange(2048) // 300) & ak.causal()),
    (qkv(1024, B=2), ak.key_padding(torch.tensor([1024, 700]))),
    (qkv(1, 4096), ak.causal(align="bottom_right")),
]
plans = [ak.explain(*inputs, mask, verbose=True) for inputs, mask in calls]
print(json.dumps({
    "first": times[0], "second": times[1], "measured": len(measured),
    "backends": [plan.backend for plan in plans], "notes": plans[0].notes[-1],
    "built_in": cost.built_in().source,
}))
"""


@pytest.fixture(scope="module")
def three_processes(tmp_path_factory):
    """Three processes started together, beside a fourth that keeps a core busy, with an
    empty cache directory and no `ATTNKIT_CALIBRATION`: what each printed, and the cache."""
    cache = tmp_path_factory.mktemp("cache")
    env = {k: v for k, v in os.environ.items() if k != "ATTNKIT_CALIBRATION"}
    env["XDG_CACHE_HOME"] = str(cache)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        children = [
            subprocess.Popen(
                [sys.executable, "-c", _PROCESS], env=env, stdout=subprocess.PIPE, text=True
            )
            for _ in range(3)
        ]
        outs = [child.communicate(timeout=120)[0] for child in children]
        assert all(child.returncode == 0 for child in children)
    finally:
        busy.kill()
        busy.wait()
    return [json.loads(out) for out in outs], cache


def test_no_process_measures_or_writes_a_table_on_a_busy_cpu(three_processes):
    found, cache = three_processes
    assert list(cache.iterdir()) == []
    for one in found:
        assert one["measured"] == 0
        assert one["notes"].endswith(one["built_in"]) and "built in for" in one["built_in"]
    # the first call costs at most 0.2 s more than the second (the least disturbed of
    # three processes: a busy core may pause any one of them)
    assert min(one["first"] - one["second"] for one in found) < 0.2, found


def test_every_process_picks_the_same_backends(three_processes):
    found, _ = three_processes
    assert found[0]["backends"][-1] == "sdpa"  # a decoding step
    assert all(one["backends"] == found[0]["backends"] for one in found), found
