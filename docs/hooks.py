"""mkdocs hook: the site's pictures, drawn with `attnkit.plot` at every build.

They land in `docs/images/generated/` (not committed), so a picture always shows the
code as it is; the benchmark plot is copied from `benchmarks/results/`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

import attnkit as ak
import attnkit.plot as akplot

PICTURES = {
    "causal": lambda: akplot.mask(ak.causal(), 12),
    "sliding": lambda: akplot.mask(ak.sliding_window(3) & ak.causal(), 12),
    "documents": lambda: akplot.mask(
        ak.document(torch.tensor([0] * 4 + [1] * 5 + [2] * 3)) & ak.causal(), 12
    ),
    "padding": lambda: akplot.mask(ak.key_padding(torch.tensor([12, 7])), 12, batch=1),
    "prefix": lambda: akplot.mask(ak.prefix_lm(4), 12),
    "chunked": lambda: akplot.mask(ak.chunked(4) & ak.causal(), 12),
}


def on_pre_build(config: Any, **kwargs: Any) -> None:
    out = Path(config["docs_dir"]) / "images" / "generated"
    out.mkdir(parents=True, exist_ok=True)
    for name, draw in PICTURES.items():
        draw().savefig(out / f"{name}.png", dpi=64)
    shutil.copyfile(
        Path(config["docs_dir"]).parent / "benchmarks/results/bench.png", out / "bench.png"
    )
