"""The benchmark script runs end to end on a tiny configuration (a smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit._compat import cpu_kind
from attnkit.native import unavailable

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def test_bench_writes_json_table_and_plot(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--sizes",
            "256",
            "--patterns",
            "sliding",
            "padding",
            "tensor",
            "--repeats",
            "1",
            "--no-memory",
            "--no-compiled",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    records = json.loads((tmp_path / "bench.json").read_text())["records"]
    assert {r["peer"] for r in records} == {"naive", "sdpa", "flex", "auto"}
    timed = [r for r in records if "ms" in r]
    assert all(r["ms"] > 0 and r["roofline_pct"] > 0 for r in timed)
    assert any("no backward" in r.get("skipped", "") for r in records)  # flex, fwd+bwd
    table = (tmp_path / "bench.md").read_text()
    assert "| 256 | sliding | fwd |" in table and "| 256 | padding | fwd+bwd |" in table
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert "| bfloat16 | 256 | sliding | fwd |" in table  # the dtype axis
    assert "| float32 | 256 | tensor | fwd+bwd |" in table  # the dense mask a framework passes
    meta = json.loads((tmp_path / "bench.json").read_text())["meta"]
    assert set(meta["cpu"]["features"]) >= {"AVX2", "AVX512-BF16", "AMX"}
    assert set(meta["rooflines"]) == {"float32", "bfloat16"}
    decode = (tmp_path / "bench_decode.md").read_text()
    assert "| 1 | 512 |" in decode and "| 32 | 8192 |" in decode


@pytest.mark.slow
def test_compiled_training_step_rows():
    sys.path.insert(0, str(BENCH.parent))
    from compiled import compiled_markdown, training_steps

    rows = training_steps(1)
    assert {(r["attention"], r["mode"]) for r in rows} == {
        (a, m) for a in ("attnkit", "sdpa") for m in ("eager", "compiled")
    }
    assert all(r["ms"] > 0 for r in rows)
    assert "| compiled |" in compiled_markdown(rows)


def test_budget_predicts_by_s_squared_and_skips_only_peers():
    sys.path.insert(0, str(BENCH.parent))
    from bench import Budget, make_case

    budget = Budget(call_limit=10.0)
    small, big = make_case("causal", 256), make_case("causal", 1024)
    assert budget.refusal(big, "fwd", "sdpa") is None  # nothing measured yet: run it
    budget.record(small, "fwd", "sdpa", 1.0)
    budget.record(small, "fwd", "auto", 1.0)
    assert budget.predict(big, "fwd", "sdpa") == pytest.approx(16.0)
    assert budget.predict(big, "fwd+bwd", "sdpa") is None  # another pass: no prediction
    reason = budget.refusal(big, "fwd", "sdpa")
    assert reason is not None and "16 s" in reason and "S=256" in reason
    assert budget.refusal(big, "fwd", "auto") is None  # auto always runs


def test_paged_bench_compares_three_ways_of_decoding(tmp_path):
    script = BENCH.parent / "paged.py"
    args = [
        "--repeats",
        "2",
        "--trials",
        "1",
        "--sequences",
        "4",
        "--longest",
        "64",
        "--processes",
        "2",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "paged.json").read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]
    assert all(set(r["seconds"]) == {"padded sdpa", "kvcache", "paged"} for r in rows)
    assert all(len(r["process_seconds"]["paged"]) == 2 for r in rows)  # one per process
    assert json.loads((tmp_path / "paged.json").read_text())["cpu"]["read_bytes_per_s"] > 0
    assert "| float32 | paged |" in (tmp_path / "paged.md").read_text()


def test_context_parallel_bench_runs_every_strategy(tmp_path):
    script = BENCH.parent / "context_parallel.py"
    args = [
        "--sizes",
        "256",
        "--worlds",
        "1",
        "2",
        "--patterns",
        "causal",
        "documents",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    kept = tmp_path / f"context_parallel_{cpu_kind()}.json"  # one table per kind of CPU
    rows = json.loads(kept.read_text())["rows"]
    assert {(r["world"], r["strategy"]) for r in rows} >= {
        (1, "single"),
        (2, "ring"),
        (2, "ulysses"),
    }
    aligned = [r for r in rows if r["world"] == 2 and r["pattern"] == "documents"]
    assert all(r["bytes_sent"] == 0 for r in aligned if r["strategy"] == "ring")
    distributed = [r for r in rows if r["world"] == 2]
    # measured on every distributed row (their ratio is the table's, not a test's: timed)
    assert all(r["agree_seconds"] > 0 and r["seconds"] > 0 for r in distributed), distributed


def _small_calls(tmp_path, *args):
    script = BENCH.parent / "small_calls.py"
    done = subprocess.run(
        [sys.executable, str(script), *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (kept,) = tmp_path.glob("small_calls_*.json")  # one per kind of CPU
    return json.loads(kept.read_text())


def test_small_calls_bench_compares_decode_steps_with_and_without_padding(tmp_path):
    found = _small_calls(
        tmp_path,
        "--parts",
        "decode",
        "training",
        "module",
        "--batches",
        "2",
        "--sizes",
        "64",
        "--runs",
        "3",
        "--model-runs",
        "1",
    )
    rows = found["decode"]
    assert [(r["B"], r["S"], r["padding"]) for r in rows] == [(2, 64, False), (2, 64, True)]
    assert all(r["sdpa_us"] > 0 and r["attnkit_us"] > 0 for r in rows)
    assert found["training"]["ratio"] > 0 and found["module"]["ratio"] > 0
    (table,) = (path.read_text() for path in tmp_path.glob("small_calls_*.md"))
    assert "| 2 | 64 | yes |" in table and "KVCache decoding" in table


@pytest.mark.slow
def test_small_calls_bench_times_generate_and_compiled_steps(tmp_path):
    pytest.importorskip("transformers")
    found = _small_calls(tmp_path, "--parts", "generate", "compiled", "--model-runs", "1")
    assert [r["case"] for r in found["generate"]] == ["B=1", "B=4 padded"]
    assert all(r["attnkit_same_tokens"] for r in found["generate"])  # greedy: the same tokens
    assert found["compiled"]["ratio"] > 0


def test_block_mask_bench_times_both_builds_and_checks_their_blocks(tmp_path):
    pytest.importorskip("torch.nn.attention.flex_attention")
    script = BENCH.parent / "block_mask.py"
    done = subprocess.run(
        [sys.executable, str(script), "--sizes", "512", "--runs", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "block_mask.json").read_text())["rows"]
    assert len(rows) == 5 and all(r["same"] and r["to_block_mask_ms"] > 0 for r in rows)
    assert "| causal | 512 |" in (tmp_path / "block_mask.md").read_text()


@pytest.mark.parametrize(
    ("script", "args", "table"),
    [
        ("tile_levers.py", ["--dtypes", "float32", "--size", "512", "--runs", "1"], "tile_levers"),
        ("dropins.py", ["--size", "128", "--runs", "1"], "dropins"),
    ],
)
def test_kernel_and_dropin_benches_write_their_tables(tmp_path, script, args, table):
    done = subprocess.run(
        [sys.executable, str(BENCH.parent / script), *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / f"{table}.json").read_text())["rows"]
    assert rows and all(r["ms" if table == "tile_levers" else "attnkit_ms"] > 0 for r in rows)
    assert "| " in (tmp_path / f"{table}.md").read_text()


@pytest.mark.skipif(unavailable() is not None, reason="it times the native kernels: not built")
def test_native_bench_names_its_cpu_kind_and_compares_every_peer(tmp_path):
    args = [
        "--sizes",
        "256",
        "--patterns",
        "sliding",
        "padding",
        "--no-flex",
        "--no-decode",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(
        [sys.executable, str(BENCH.parent / "native.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / f"native_{cpu_kind()}.json").read_text())
    assert result["kind"] == cpu_kind() and 0 < result["load_s"] < 10
    assert len(result["kernels"]) == 4
    assert all(r["native_ms"] > 0 and r["per_pair"] > 0 for r in result["kernels"])
    assert f"CPU kind: **{cpu_kind()}**" in (tmp_path / f"native_{cpu_kind()}.md").read_text()
