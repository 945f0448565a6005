"""The tiny GPT example runs end to end for a handful of steps."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str = "tiny_gpt"):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_gpt_trains_generates_with_the_cache_and_plots(tmp_path, capsys):
    tiny_gpt = load_example()
    picture = tmp_path / "attention.png"
    result = tiny_gpt.main(
        [
            "--steps",
            "8",
            "--block",
            "32",
            "--batch",
            "8",
            "--generate",
            "12",
            "--plot",
            str(picture),
        ]
    )
    out = capsys.readouterr().out
    assert result["steps"] == 8 and math.isfinite(result["val_loss"])
    assert result["val_loss"] < 4.7  # below a uniform guess over ~100 characters
    assert result["same"] == 1.0  # KV-cache decoding reproduces the full forward
    assert "unigram baseline" in out and "with KV cache" in out
    assert picture.exists() and picture.stat().st_size > 10_000


def test_the_training_text_ships_with_python():
    text = load_example().python_docs()
    assert len(text) > 100_000 and "Return" in text


def test_transformers_example_trains_with_both_implementations(capsys):
    pytest.importorskip("transformers")
    rows = load_example("transformers_train").main(
        ["--tokens", "256", "--steps", "1", "--layers", "1"]
    )
    assert [r["batch"] for r in rows] == ["packed", "padded", "unpadded"]
    assert all(r["loss_diff"] < 1e-4 and r["attnkit_tokens_s"] > 0 for r in rows)
    assert "| packed |" in capsys.readouterr().out


def test_context_parallel_example_matches_one_process():
    run = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "context_parallel.py"),
            "--steps",
            "2",
            "--block",
            "32",
            "--batch",
            "2",
            "--world",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "losses match" in run.stdout and "context parallel: strategy 'ulysses'" in run.stdout


def test_serve_example_batches_forks_and_matches_kv_cache_decoding():
    run = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "serve.py"),
            "--requests",
            "5",
            "--new",
            "6",
            "--train-steps",
            "0",
            "--batch",
            "3",
            "--samples",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "7 of 7 outputs equal decoding the prompt alone with KVCache" in run.stdout
    assert "tokens/s" in run.stdout and "blocks of 16 tokens in use" in run.stdout


def test_a_backend_of_ones_own_registers_in_one_line_and_leaves_no_trace(capsys):
    """examples/own_backend.py: `auto`, `explain` and `backend=` know it while registered."""
    from attnkit.backends import BACKENDS

    own_backend = load_example("own_backend")
    gap = own_backend.main()
    printed = capsys.readouterr().out
    assert gap < 1e-5 and re.search(r"float64 +slower here", printed)
    assert "float64" not in BACKENDS
