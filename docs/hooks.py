"""mkdocs hook: the site's pictures, drawn with `attnkit.plot` at every build.

They land in `docs/images/generated/` (not committed), so a picture always shows the
code as it is; the benchmark plot is copied from `benchmarks/results/`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import attnkit as ak
import attnkit.plot as akplot

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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


# The page shows a mask picture at its own size, two a row: 4.8 inches at 72 dpi (346 px),
# so a point of text is a pixel; the sizes below make its text 11-12 px, near the page's.
DPI = 72
TITLE_PT, LABEL_PT, TICK_PT = 12, 12, 11


def readable(fig: Figure) -> Figure:
    """Titles, axis labels and tick labels sized for the page (see `DPI`)."""
    for ax in fig.axes:
        ax.title.set_fontsize(TITLE_PT)
        ax.xaxis.label.set_fontsize(LABEL_PT)
        ax.yaxis.label.set_fontsize(LABEL_PT)
        ax.tick_params(labelsize=TICK_PT)
    return fig


def on_pre_build(config: Any, **kwargs: Any) -> None:
    out = Path(config["docs_dir"]) / "images" / "generated"
    out.mkdir(parents=True, exist_ok=True)
    for name, draw in PICTURES.items():
        readable(draw()).savefig(out / f"{name}.png", dpi=DPI)
    shutil.copyfile(
        Path(config["docs_dir"]).parent / "benchmarks/results/bench.png", out / "bench.png"
    )
