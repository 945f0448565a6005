"""`auto` never slower than the plain call: on every kind of CPU with a table of
`benchmarks/native.py`, the backend `auto` plans for each measured call (patterns none,
causal, sliding, padding and prefix at S = 1024 and 4096, and at S = 341, one document
of a pack, where a table has it; every dtype measured, forward and forward+backward),
and for each point of its decoding grid, is within the noise of the fastest backend
measured there.

The tables are the benchmark's own (`benchmarks/results/native_<kind>.json`), priced
with the kind's built-in cost table: a change of the cost model that moves a choice off
the fastest backend fails here, and so does a table measured anew where the kernels
changed the ranking. Packed documents are left out: `auto` runs them one call per
document (a sequence's result the same wherever it is packed), a path no column of the
table times.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import attnkit as ak
from attnkit import runtime
from attnkit.call import cost
from attnkit.native import unavailable
from helpers import half_kernels

RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"
NOISE = 1.10  # repeated runs of one table move a ratio by about ±0.05
BACKENDS = ("sdpa", "tiled", "native")
PATTERNS = ("none", "causal", "sliding", "padding", "prefix")
HALF_MODE = {"avx2": "float32", "amx": "amx"}  # what half computes in by default there


def _rows() -> list[tuple[str, str, dict[str, object]]]:
    rows = []
    for path in sorted(RESULTS.glob("native_*.json")):
        table = json.loads(path.read_text())
        for part in ("kernels", "train"):
            for row in table.get(part, []):
                if row["pattern"] in PATTERNS and row["S"] in (341, 1024, 4096):
                    rows.append((table["kind"], part, row))
    return rows


ROWS = _rows()
pytestmark = pytest.mark.skipif(
    unavailable() is not None, reason="the tables time the native kernels, not built here"
)


@pytest.fixture
def case_of(monkeypatch):
    """The benchmark's own case of a row (its masks and sizes)."""
    monkeypatch.syspath_prepend(str(RESULTS.parent))
    sys.modules.pop("bench", None)
    from bench import D, H, make_case

    def make(row: dict[str, object]) -> tuple[ak.Mask | None, torch.Tensor]:
        case = make_case(row["pattern"], row["S"], getattr(torch, row["dtype"]))
        q = torch.empty(case.B, H, case.S, D, dtype=case.dtype)
        return case.mask, q

    return make


def test_the_tables_cover_every_measured_kind():
    kinds = {kind for kind, _, _ in ROWS}
    assert {"avx2", "avx512_bf16", "amx"} <= kinds
    assert {part for _, part, _ in ROWS} == {"kernels", "train"}


@pytest.mark.parametrize(
    ("kind", "part", "row"),
    ROWS,
    ids=[f"{k}-{p}-{r['dtype']}-{r['pattern']}-{r['S']}" for k, p, r in ROWS],
)
def test_auto_plans_the_fastest_backend_measured(kind, part, row, case_of, monkeypatch):
    """Half runs as by default on the table's kind: in float32 on AVX2, on AMX's tiles on
    `amx`, on the pair dots elsewhere."""
    half_kernels(monkeypatch, HALF_MODE.get(kind, "native"))
    mask, q = case_of(row)
    runtime.current().costs.use(cost.built_in(kind))
    try:
        grad = part == "train"
        q = q.requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            picked = ak.explain(q, q, q, mask).backend
    finally:
        runtime.current().costs.use(None)
    times = {name: row[f"{name}_ms"] for name in BACKENDS if row.get(f"{name}_ms")}
    if row["auto"] == picked:  # the auto column timed the same call again: the better
        times[picked] = min(times[picked], row["auto_ms"])
    fastest = min(times, key=times.__getitem__)
    assert times[picked] <= NOISE * times[fastest], (
        f"auto plans {picked} ({times[picked]:.1f} ms) where {fastest} took {times[fastest]:.1f} ms"
    )


@pytest.mark.parametrize("kind", ["avx2", "avx512_bf16", "amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_tiny_call_plans_on_a_fused_kernel(kind, dtype):
    """A causal call of 28 rows (one short document of a pack): the reference's call (the
    mask made dense, a dozen operators) and a composed backend's cost more than SDPA's or
    the kernel's whole call, in every dtype."""
    q = torch.empty(1, 8, 28, 64, dtype=dtype)
    runtime.current().costs.use(cost.built_in(kind))
    try:
        picked = ak.explain(q, q, q, ak.causal()).backend
    finally:
        runtime.current().costs.use(None)
    assert picked in ("sdpa", "native")


def _steps() -> list[tuple[str, dict[str, object]]]:
    return [
        (json.loads(path.read_text())["kind"], row)
        for path in sorted(RESULTS.glob("native_*.json"))
        for row in json.loads(path.read_text()).get("decode", [])
    ]


STEPS = _steps()


@pytest.mark.parametrize(
    ("kind", "row"),
    STEPS,
    ids=[
        f"{k}-{r['dtype']}-Hkv{r['Hkv']}-{'padded' if r['padded'] else 'full'}-B{r['B']}-S{r['S']}"
        for k, r in STEPS
    ],
)
def test_auto_decodes_on_the_fastest_backend_measured(kind, row, monkeypatch):
    """Each point of every kind's decoding grid (L = 1, H = 8, D = 64; GQA and MHA, full
    and padded, the grid to lengths from S/2 to S: the rule reads that a step is padded,
    not its lengths) plans the backend within the noise of the fastest of SDPA and the
    kernel there (the step rule reads the kind's thresholds)."""
    half_kernels(monkeypatch, HALF_MODE.get(kind, "native"))
    B, S, Hkv, dtype = row["B"], row["S"], row["Hkv"], getattr(torch, row["dtype"])
    q = torch.empty(B, 8, 1, 64, dtype=dtype)
    k = torch.empty(B, Hkv, S, 64, dtype=dtype)
    mask = ak.causal(align="bottom_right")
    if row["padded"]:
        mask = mask & ak.key_padding(torch.full((B,), S // 2))
    runtime.current().costs.use(cost.built_in(kind))
    try:
        picked = ak.explain(q, k, k, mask).backend
    finally:
        runtime.current().costs.use(None)
    times = {name: row[f"{name}_us"] for name in ("sdpa", "native")}
    fastest = min(times, key=times.__getitem__)
    assert picked in times and times[picked] <= NOISE * times[fastest], (
        f"auto plans {picked} ({times.get(picked, 0):.0f} µs) where {fastest} took "
        f"{times[fastest]:.0f} µs"
    )


@pytest.mark.parametrize("kind", ["avx2", "avx512_bf16", "amx"])
def test_a_half_step_sdpa_would_convert_runs_on_the_kernel(kind, monkeypatch):
    """Where half inputs compute in float32 (`ATTNKIT_HALF_KERNELS=float32`, or a CPU
    without the units), SDPA converts the whole cache every step: the kernel takes every
    half step, on AMX too (whose thresholds price SDPA on the tiles)."""
    half_kernels(monkeypatch, "float32")
    q, k = torch.empty(1, 8, 1, 64, dtype=torch.bfloat16), torch.empty(1, 2, 512, 64).bfloat16()
    runtime.current().costs.use(cost.built_in(kind))
    try:
        picked = ak.explain(q, k, k, ak.causal(align="bottom_right")).backend
    finally:
        runtime.current().costs.use(None)
    assert picked == "native"
