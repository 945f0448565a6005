"""The site's pictures read at the size the page shows them: the benchmark plot labels a
bar that was not run (never a silent zero), and the mask pictures' text is page-sized."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "docs"))

import hooks  # noqa: E402 (docs/hooks.py; after the importorskip)
from report import draw_plot  # noqa: E402 (benchmarks/report.py)

META = {"roofline_gflops": 100.0, "torch": "2.x", "threads": 2, "repeats": 1}


def _record(peer: str, pass_: str, **extra: object) -> dict[str, object]:
    base = {"S": 256, "pattern": "causal", "dtype": "float32", "pass": pass_, "peer": peer}
    return {**base, **extra}


def _labels(fig) -> dict[str, list[float]]:
    """Each text drawn in a panel, with the x of its place."""
    found: dict[str, list[float]] = {}
    for ax in fig.axes:
        for text in ax.texts:
            found.setdefault(text.get_text(), []).append(text.get_position()[0])
    return found


def test_the_benchmark_plot_labels_bars_that_were_not_run():
    timed = {"ms": 1.0, "roofline_pct": 40.0}
    records = [
        _record("auto", "fwd", **timed),
        _record("sdpa", "fwd", **timed),
        _record("flex", "fwd", **timed),
        _record("naive", "fwd", skipped="skipped: about 99 s a call, over --call-budget 60 s"),
        _record("auto", "fwd+bwd", **timed),
        _record("sdpa", "fwd+bwd", **timed),
        _record("flex", "fwd+bwd", skipped="no backward on CPU (PyTorch 2.13)"),
    ]  # naive fwd+bwd: no record at all
    labels = _labels(draw_plot(META, records))
    assert len(labels["skip"]) == 1  # over the call budget
    assert len(labels["n/a"]) == 2  # flex without a backward, naive without a record
    assert labels["skip"][0] == pytest.approx(-1.5 * 0.2)  # naive's bar: the first of 4
    assert len(draw_plot(META, records).axes) == 2  # one S, two passes


def test_the_report_redraws_a_kept_run_from_its_json(tmp_path):
    run = {
        "meta": {**META, "rooflines": {"float32": 100.0}},
        "records": [
            _record("auto", "fwd", ms=1.0, roofline_pct=40.0, gflops=40.0, backend="sdpa"),
            _record("sdpa", "fwd", ms=1.0, roofline_pct=40.0, gflops=40.0),
        ],
    }
    (tmp_path / "bench.json").write_text(json.dumps(run))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), str(tmp_path / "bench.json")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        "| float32 | 256 | causal | fwd | 1.00× | 1.0 (sdpa) |"
        in (tmp_path / "bench.md").read_text()
    )
    assert (tmp_path / "bench.png").stat().st_size > 10_000


@pytest.mark.parametrize("name", sorted(hooks.PICTURES))
def test_mask_pictures_have_page_sized_text(name):
    fig = hooks.readable(hooks.PICTURES[name]())
    px = hooks.DPI / 72  # pixels a point, shown at the picture's own size
    width = fig.get_size_inches()[0] * hooks.DPI
    assert width <= 360  # two a row fit the text column at a 1280 px window
    ax = fig.axes[0]
    assert ax.title.get_fontsize() * px >= 11
    ticks = ax.get_xticklabels() + ax.get_yticklabels()
    assert ticks and min(t.get_fontsize() for t in ticks) * px >= 10
    assert min(ax.xaxis.label.get_fontsize(), ax.yaxis.label.get_fontsize()) * px >= 11
