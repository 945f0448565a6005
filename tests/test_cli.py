"""The attnkit command: the tour passes its own checks; masks, plans and timings print,
on any console, and errors speak in the command's options."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

import attnkit as ak
from attnkit import runtime
from attnkit.cli import in_cli_terms, main
from attnkit.learn.benchmark import run_bench
from attnkit.learn.console import Progress
from attnkit.learn.tour import run_tour


def test_tour_runs_every_section_and_every_check_passes():
    lines: list[str] = []
    failed = run_tour(lines.append)
    text = "\n".join(lines)
    assert failed == 0
    for section in range(1, 8):
        assert f"\n{section}. " in text
    assert "0.1956" in text and "0.8044" in text
    checks = [line for line in lines if line.startswith(("   ✓", "   ✗"))]
    assert len(checks) >= 15 and all(line.startswith("   ✓") for line in checks)


def test_mask_command_draws(capsys):
    assert main(["mask", "causal", "-L", "3"]) == 0
    out = capsys.readouterr().out
    assert "■ · ·\n■ ■ ·\n■ ■ ■" in out


def test_mask_command_reports_contract_errors(capsys):
    assert main(["mask", "causal", "-L", "2", "-S", "4"]) == 2
    assert "align" in capsys.readouterr().err


def test_explain_command_prints_a_plan(capsys):
    assert main(["explain", "sliding", "-L", "256", "--window", "15"]) == 0
    out = capsys.readouterr().out
    assert "attnkit plan" in out and "sliding_window(left=15" in out


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    environ = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "attnkit.cli", *args], capture_output=True, env=environ
    )


def test_explain_plans_without_the_inputs_values(monkeypatch, capsys):
    """The command's q, k, v hold one row of numbers (planning reads sizes, strides and
    dtypes), so a long call costs no L·D memory; the plan keeps the full-size shapes."""
    made = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: made.append(a) or real_empty(*a, **kw))
    assert main(["explain", "causal", "-L", "100000", "--dim", "64"]) == 0
    assert "q (1, 8, 100000, 64)" in capsys.readouterr().out
    assert made[0] == (64,)  # one row, expanded to q, k, v
    assert not any(100_000 in size for size in made)  # nothing of L allocated for them


@pytest.mark.slow
def test_explain_a_call_of_a_hundred_million_queries():
    """`attnkit explain causal -L 100000000` plans (q, k, v of 200 GB never exist)."""
    command = [sys.executable, "-m", "attnkit.cli", "explain", "causal", "-L", "100000000"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "q (1, 8, 100000000, 64)" in done.stdout and "chosen" in done.stdout


def test_version_names_attnkit_and_torch(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"attnkit {ak.__version__} (torch {torch.__version__})")


def test_errors_speak_in_options_and_come_alone(capsys):
    assert main(["mask", "causal", "-L", "3", "-S", "6"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no header before the error
    assert captured.err.startswith("attnkit mask: ")
    for fix in ("--align top_left", "--align bottom_right", "--offset N"):
        assert fix in captured.err
    assert "align=" not in captured.err and "causal(" not in captured.err


def test_python_fixes_become_options():
    message = "give align='top_left' or offset=3, not both; window=-1 is negative"
    assert (
        in_cli_terms(message)
        == "give --align top_left or --offset 3, not both; --window -1 is negative"
    )


@pytest.mark.parametrize("args", [["-L", "0"], ["-S", "-2"], ["--window", "-1"]])
def test_counts_out_of_range_are_refused_by_the_parser(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["mask", "sliding", *args])
    assert exit_.value.code == 2
    flag, value = args
    assert f"error: argument {flag}: {value} is below" in capsys.readouterr().err


@pytest.mark.parametrize("encoding", ["ascii", "cp1252"])
def test_mask_draws_on_a_console_without_the_characters(encoding):
    done = _run("mask", "causal", "-L", "3", env={"PYTHONIOENCODING": encoding})
    assert done.returncode == 0, done.stderr.decode()
    dot = "." if encoding == "ascii" else "·"  # cp1252 has the middle dot, not the square
    assert f"# {dot} {dot}\n# # {dot}\n# # #" in done.stdout.decode(encoding)
    assert done.stderr == b""


def test_tour_runs_on_an_ascii_console():
    done = _run("tour", env={"PYTHONIOENCODING": "ascii"})
    assert done.returncode == 0, done.stderr.decode()
    text = done.stdout.decode("ascii")
    assert "   ok weights are" in text and "checks passed, 0 failed" in text


def test_a_closed_pipe_ends_the_command_quietly():
    child = subprocess.Popen(
        [sys.executable, "-m", "attnkit.cli", "tour"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()  # the reader leaves before the first line, as `| head -0` would
    err = child.stderr.read()
    assert child.wait(timeout=120) == 0
    assert err == b""


def test_bench_prints_a_row_per_pattern_and_pass(capsys):
    args = ["bench", "-S", "64", "--runs", "1", "--patterns", "causal", "sliding", "--backward"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("causal", "sliding"))]
    assert [row.split()[:2] for row in rows] == [
        ["causal", "forward"],
        ["causal", "forward+backward"],
        ["sliding", "forward"],
        ["sliding", "forward+backward"],
    ]
    assert all(row.count("ms") == 2 and "×" in row for row in rows)
    header = out.splitlines()[0]
    assert "B=1, H=8, L=S=64, D=64, float32" in header  # what was measured
    assert "sliding_window(left=4, right=0)" in out  # and each pattern's mask


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["mask", "causal", "--window", "3"], "causal does not read --window"),
        (["mask", "padding", "--offset", "1"], "padding does not read --offset"),
        (["explain", "sliding", "-L", "64", "--chunk", "4"], "sliding does not read --chunk"),
        (["mask", "documents", "--documents", "10", "-L", "4"], "--documents 10 is more than"),
    ],
)
def test_an_option_the_kind_does_not_read_is_an_error_not_ignored(args, said, capsys):
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and said in captured.err


def test_a_large_mask_is_drawn_in_blocks_one_mark_each(capsys):
    assert main(["mask", "causal", "-L", "500"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "one mark per 8×8 block" in lines[0]
    drawing = lines[1:]
    assert len(drawing) == 63 and max(len(line) for line in drawing) == 2 * 63 - 1
    assert drawing[0].startswith("▪ ·") and drawing[-1].endswith("■ ▪")


def test_size_options_scale_with_the_call_when_left_out(capsys):
    assert main(["explain", "padding", "-L", "512"]) == 0
    assert "density 50.0%" in capsys.readouterr().out  # half the keys, not 5 of them
    assert main(["mask", "sliding"]) == 0
    assert "sliding_window(left=2, right=0)" in capsys.readouterr().out  # a quarter of L = 8


def test_calibrate_command_keeps_the_table_and_prints_it(monkeypatch, tmp_path, capsys):
    from attnkit.backends import get_backend
    from attnkit.call import calibrate

    path = tmp_path / "cost.json"
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(path))  # a file named: kept there
    measured = {"tiled": {"call": 3e5}}
    monkeypatch.setattr(calibrate, "_measured", lambda: (measured, 0.97))  # a quiet CPU
    try:
        assert main(["calibrate"]) == 0
        assert (
            get_backend("tiled").factors(runtime.current().costs.table())["call"] == 3e5
        )  # this process prices with it too
    finally:
        runtime.current().costs.use(None)
    captured = capsys.readouterr()
    assert f"kept in {path}" in captured.out and '"call": 300000.0' in captured.out
    assert "measuring the cost model" in captured.err and "warning" not in captured.err
    assert json.loads(path.read_text())["factors"]["tiled"]["call"] == 3e5  # every factor kept


def test_bench_refuses_an_unknown_pattern():
    with pytest.raises(ValueError, match="unknown patterns"):
        run_bench(64, patterns=("diagonal",))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_terminal_once_the_run_is_long():
    long_run, short_run, log = _Terminal(), _Terminal(), io.StringIO()
    for stream, after in ((long_run, 0.0), (short_run, 60.0), (log, 0.0)):
        bar = Progress(2, stream, after=after)
        bar.step("first")
        bar.step("second")
        bar.close()
    assert "1/2 first" in long_run.getvalue() and "2/2 second" in long_run.getvalue()
    assert long_run.getvalue().endswith("\r")  # cleared for what follows
    assert short_run.getvalue() == "" and log.getvalue() == ""
