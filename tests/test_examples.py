"""The tiny GPT example runs end to end for a handful of steps."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny_gpt.py"


def load_example():
    spec = importlib.util.spec_from_file_location("tiny_gpt", EXAMPLE)
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
