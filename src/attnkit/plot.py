"""Pictures of the mechanism: a mask, the attention weights, what a plan computes.

Needs matplotlib (`pip install 'attnkit[plot]'`). Each function returns a
`matplotlib.figure.Figure`, made without pyplot's global state: a notebook shows it
(with `%matplotlib inline`), `fig.savefig("mask.png")` writes it, and nothing opens a
window or stays alive after the last reference. Large problems are drawn at most
`CELLS` cells a side, each cell the share of its pairs that may attend, computed a few
rows at a time (no L×S tensor is built).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from attnkit.backends import BACKENDS
from attnkit.contracts import normalize_call
from attnkit.functional import attention_probs, explain
from attnkit.masks import Mask, as_mask
from attnkit.masks.spans import CHUNK_ELEMENTS
from attnkit.masks.structure import is_sdpa_causal

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CELLS", "Region", "attention", "computed_regions", "density_image", "mask", "plan"]

CELLS = 256  # at most this many cells a side; a cell of a larger picture averages pairs


def _figure(width: float, height: float) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "attnkit.plot draws with matplotlib: pip install 'attnkit[plot]' (or matplotlib)"
        ) from err
    return Figure(figsize=(width, height), layout="constrained")


def density_image(m: Mask | None, L: int, S: int, *, batch: int = 0, head: int = 0) -> Tensor:
    """(⌈L/r⌉, ⌈S/c⌉) float: the share of each r×c cell's pairs that may attend, with
    r, c the smallest cells that keep the picture within `CELLS` a side (1×1 when small)."""
    r, c = math.ceil(L / CELLS), math.ceil(S / CELLS)
    if m is None:
        return torch.ones(math.ceil(L / r), math.ceil(S / c))
    B, H = max(m.batch_size or 1, batch + 1), max(m.num_heads or 1, head + 1)
    step = r * max(1, CHUNK_ELEMENTS // (r * S))  # rows a chunk: whole cells
    parts = []
    for start in range(0, L, step):
        rows = torch.arange(start, min(L, start + step))
        dense = m.dense(B, H, L, S, rows=rows)  # (B|1, H|1, R, S|1)
        grid = dense.expand(B, H, rows.numel(), S)[batch, head].float()  # (R, S)
        grid = torch.nn.functional.pad(grid, (0, -S % c, 0, -rows.numel() % r), value=math.nan)
        cells = grid.reshape(grid.shape[0] // r, r, grid.shape[1] // c, c)
        parts.append(cells.nanmean(dim=(1, 3)))
    return torch.cat(parts)


def _show_density(ax: Any, image: Tensor, L: int, S: int) -> None:
    ax.imshow(
        image.numpy(), cmap="Blues", vmin=0.0, vmax=1.0, extent=(0, S, L, 0),
        interpolation="nearest", aspect="auto" if max(L, S) > 4 * min(L, S) else "equal",
    )  # fmt: skip
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")


def mask(
    m: Mask | Tensor, L: int, S: int | None = None, *, batch: int = 0, head: int = 0
) -> Figure:
    """The L×S picture of a mask for one batch row and head: dark = may attend.

    `m` is a `Mask` or a bool tensor (True = may attend); S defaults to L.
    """
    S = L if S is None else S
    visible = as_mask(m)
    image = density_image(visible, L, S, batch=batch, head=head)
    fig = _figure(4.8, 4.8 * min(max(L / S, 0.3), 2.0))
    ax = fig.add_subplot()
    _show_density(ax, image, L, S)
    ax.set_title(f"{visible}\nL={L}, S={S}, density {float(image.mean()):.1%}", fontsize=9)
    return fig


def _heads(heads: int | Sequence[int] | None, H: int) -> list[int]:
    chosen = list(range(H)) if heads is None else [heads] if isinstance(heads, int) else list(heads)
    bad = [h for h in chosen if not 0 <= h < H]
    if bad or not chosen:
        raise ValueError(f"heads={heads!r}: choose query heads in 0..{H - 1} (q has H={H}).")
    return chosen


def attention(
    q: Tensor,
    k: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    rows: int | Sequence[int] | slice | None = None,
    heads: int | Sequence[int] | None = None,
    batch: int = 0,
    scale: float | None = None,
) -> Figure:
    """Heatmaps of the exact attention weights of `heads` (default: all) for query `rows`
    (default: all) of one batch row, from `attention_probs`.

    Only what is asked is computed: (1, len(heads), len(rows), S) weights where the
    mask does not depend on the batch row or head; otherwise every batch row and head of
    the asked rows.
    """
    B, H, L, _ = q.shape
    Hkv = k.shape[1]
    chosen = _heads(heads, H)
    m = None if mask is None else as_mask(mask)
    if not 0 <= batch < B:
        raise ValueError(f"batch={batch}: choose a batch row in 0..{B - 1} (q has B={B}).")
    if m is None or not (m.batch_size or m.num_heads or m.head_dependent or m.has_bias):
        kv_heads = [h // (H // Hkv) for h in chosen] if H % Hkv == 0 else chosen
        q_part, k_part = q[batch : batch + 1, chosen], k[batch : batch + 1, kv_heads]
        weights = attention_probs(q_part, k_part, m, rows=rows, scale=scale)[0]  # (h, R, S)
    else:
        weights = attention_probs(q, k, m, rows=rows, scale=scale)[batch, chosen]  # (h, R, S)
    row_ids = torch.arange(L)[rows] if rows is not None else torch.arange(L)
    row_ids = row_ids.reshape(-1)
    columns = min(len(chosen), 4)
    fig = _figure(3.2 * columns, 3.0 * math.ceil(len(chosen) / columns))
    for n, (h, w) in enumerate(zip(chosen, weights.detach().float(), strict=True)):
        ax = fig.add_subplot(math.ceil(len(chosen) / columns), columns, n + 1)
        image = ax.imshow(w.numpy(), cmap="viridis", vmin=0.0, aspect="auto",
                          interpolation="nearest")  # fmt: skip
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xlabel("key j")
        if len(row_ids) <= 16:
            ax.set_yticks(range(len(row_ids)), [str(i) for i in row_ids.tolist()])
        ax.set_ylabel("query i")
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(f"attention weights, batch row {batch}: {m if m is not None else 'no mask'}",
                 fontsize=10)  # fmt: skip
    return fig


class Region(NamedTuple):
    """Query rows [row0, row0 + rows) × keys [key0, key0 + keys) a backend computes;
    `causal`: only the lower triangle of it (row m sees keys up to m)."""

    row0: int
    rows: int
    key0: int
    keys: int
    causal: bool = False

    @property
    def pairs(self) -> int:
        if not self.causal:
            return self.rows * self.keys
        n = min(self.rows, self.keys)  # rows m < n see m + 1 keys, the rest every key
        return n * (n + 1) // 2 + (self.rows - n) * self.keys


def computed_regions(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    batch: int = 0,
    backend: str = "auto",
) -> tuple[str, list[Region]]:
    """The backend `attention` would run (`backend="auto"`: the one it chooses) and the
    blocks of batch row `batch` it computes (the rest of L×S it skips): the tiled
    backend's tile plan, FlexAttention's present blocks, or the whole matrix (the lower
    triangle for SDPA's `is_causal`)."""
    backend = explain(q, k, v, mask, backend=backend).backend
    call = normalize_call(q, k, v, mask)
    d = call.dims
    if backend == "none":
        return backend, []
    work = BACKENDS[backend].work(call)
    if work is not None:
        return backend, [
            Region(b.row0, min(b.rows, d.L - b.row0), b.key0, min(b.keys, d.S - b.key0), b.causal)
            for b in work.blocks
            if b.batch == batch
        ]
    if backend == "flex" and call.mask is not None:
        block = call.mask.to_block_mask(d.B, 1, d.L, d.S)
        size_q, size_k = block.BLOCK_SIZE
        blocks = block.to_dense()  # (B|1, 1, L blocks, S blocks), nonzero = computed
        present = blocks[min(batch, blocks.shape[0] - 1), 0]
        return backend, [
            Region(i * size_q, min(size_q, d.L - i * size_q), j * size_k,
                   min(size_k, d.S - j * size_k))
            for i, j in present.nonzero().tolist()
        ]  # fmt: skip
    causal = backend == "sdpa" and call.mask is not None and is_sdpa_causal(call.mask, d.L, d.S)
    return backend, [Region(0, d.L, 0, d.S, causal)]


def plan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    batch: int = 0,
    backend: str = "auto",
) -> Figure:
    """What `attention(q, k, v, mask, backend=backend)` computes: the mask's density
    (blue) under the blocks the backend computes (outlined); the rest it skips."""
    from matplotlib.patches import Polygon, Rectangle

    L, S = q.shape[-2], k.shape[-2]
    backend, regions = computed_regions(q, k, v, mask, batch=batch, backend=backend)
    m = None if mask is None else as_mask(mask)
    image = density_image(m, L, S, batch=batch)
    fig = _figure(5.2, 5.2 * min(max(L / S, 0.3), 2.0))
    ax = fig.add_subplot()
    _show_density(ax, image, L, S)
    for r in regions:
        rows, keys = r.rows, r.keys
        if r.causal:
            corners = [(r.key0, r.row0), (r.key0, r.row0 + rows), (r.key0 + keys, r.row0 + rows)]
            ax.add_patch(Polygon(corners, fill=False, edgecolor="tab:orange", linewidth=0.8))
        else:
            ax.add_patch(Rectangle((r.key0, r.row0), keys, rows, fill=False,
                                   edgecolor="tab:orange", linewidth=0.8))  # fmt: skip
    computed = sum(r.pairs for r in regions) / (L * S)
    ax.set_title(
        f"backend '{backend}': computes {computed:.1%} of L×S (outlined)\n"
        f"mask {m if m is not None else 'none'}: density {float(image.mean()):.1%}",
        fontsize=9,
    )
    return fig
