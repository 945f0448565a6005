"""Pictures of the mechanism: a mask, the attention weights, what a plan computes.

Needs matplotlib (`pip install '/path/to/attnkit[plot]'`). Each function returns a
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

from attnkit import runtime
from attnkit.call.functional import explain
from attnkit.call.probs import attention_probs
from attnkit.contracts import normalize_call
from attnkit.masks import Mask, as_mask
from attnkit.masks.spans import CHUNK_ELEMENTS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CELLS", "Region", "attention", "computed_regions", "density_image", "mask", "plan"]

CELLS = 256  # at most this many cells a side; a cell of a larger picture averages pairs


def _figure(width: float, height: float) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "attnkit.plot draws with matplotlib: pip install matplotlib (or, from a checkout,"
            " pip install '.[plot]')"
        ) from err
    return Figure(figsize=(width, height), layout="constrained")


def density_image(m: Mask | None, L: int, S: int, *, batch: int = 0, head: int = 0) -> Tensor:
    """The picture `mask` and `plan` draw, as numbers: the share of each cell's pairs
    that may attend.

    A cell is r×c (query, key) pairs, r and c the smallest that keep the picture within
    `CELLS` a side: 1×1 (the mask itself, as 0.0 / 1.0) up to 256 positions a side. It
    is computed a few rows at a time, so no L×S tensor is built.

    Args:
        m: the `Mask` (None: every key visible, all ones).
        L: query length.
        S: key length.
        batch: the batch row drawn, for masks that differ by row (default 0).
        head: the query head drawn, for masks that differ by head (default 0).

    Returns:
        (⌈L/r⌉, ⌈S/c⌉) float32 tensor of shares in [0, 1]; its mean is the mask's density.

    Examples:
        >>> import attnkit.plot as akplot
        >>> akplot.density_image(ak.causal(), 3, 3)  # small: one cell per pair
        tensor([[1., 0., 0.],
                [1., 1., 0.],
                [1., 1., 1.]])
        >>> image = akplot.density_image(ak.causal(), 1024, 1024)  # cells of 4×4 pairs
        >>> image.shape, round(float(image.mean()), 3)  # causal: about half the pairs
        (torch.Size([256, 256]), 0.5)
    """
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
    """Position i's cell centred on i (as `imshow` places the weights of `attention`),
    ticks at whole positions."""
    from matplotlib.ticker import MaxNLocator

    ax.imshow(
        image.numpy(),
        cmap="Blues",
        vmin=0.0,
        vmax=1.0,
        extent=(-0.5, S - 0.5, L - 0.5, -0.5),
        interpolation="nearest",
        aspect="auto" if max(L, S) > 4 * min(L, S) else "equal",
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")


def mask(
    m: Mask | Tensor, L: int, S: int | None = None, *, batch: int = 0, head: int = 0
) -> Figure:
    """The L×S picture of a mask for one batch row and head: dark = may attend.

    Cell (i, j) is centred on query i, key j (ticks at whole positions); the title names
    the mask, the batch row and head drawn (when the mask differs by them or they were
    chosen), the sizes and the share of pairs that may attend. Above `CELLS` a side a
    cell averages several pairs (`density_image`).

    Args:
        m: a `Mask` or a bool tensor broadcastable to (B, H, L, S) (True = may attend).
        L: query length.
        S: key length (default None: L).
        batch: the batch row drawn (default 0).
        head: the query head drawn (default 0).

    Returns:
        A `matplotlib.figure.Figure` with one axes (made without pyplot).

    Raises:
        ImportError: matplotlib is not installed (the `attnkit[plot]` extra).

    Examples:
        >>> import attnkit.plot as akplot
        >>> fig = akplot.mask(ak.key_padding(torch.tensor([6, 4])), 6, batch=1)
        >>> type(fig).__name__, len(fig.axes)
        ('Figure', 1)
        >>> print(fig.axes[0].get_title())
        key_padding(lengths, B=2)
        batch row 1: L=6, S=6, density 66.7%
    """
    S = L if S is None else S
    visible = as_mask(m)
    image = density_image(visible, L, S, batch=batch, head=head)
    fig = _figure(4.8, 4.8 * min(max(L / S, 0.3), 2.0))
    ax = fig.add_subplot()
    _show_density(ax, image, L, S)
    drawn = [f"batch row {batch}"] if batch or visible.batch_size else []
    drawn += [f"head {head}"] if head or visible.num_heads or visible.head_dependent else []
    where = ", ".join(drawn) + ": " if drawn else ""
    title = f"{visible}\n{where}L={L}, S={S}, density {float(image.mean()):.1%}"
    ax.set_title(title, fontsize=9)
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
    """Heatmaps of the exact attention weights of some heads and query rows of one
    batch row, from `attention_probs`: one axes and its colorbar per head.

    Only what is asked is computed: (1, len(heads), len(rows), S) weights where the
    mask does not depend on the batch row or head; otherwise every batch row and head of
    the asked rows. Cell (i, j) is centred on query i, key j.

    Args:
        q: (B, H, L, D) queries.
        k: (B, Hkv, S, D) keys, q's dtype; H % Hkv == 0 (GQA).
        mask: a `Mask`, a bool tensor broadcastable to (B, H, L, S) (True = may attend)
            or a float bias (default None: every key visible).
        rows: the query rows drawn: an int, a list or a slice (default None: all L).
        heads: the query heads drawn: an int or a list (default None: all H).
        batch: the batch row drawn (default 0).
        scale: multiplies q·kᵀ (default None: 1/√D).

    Returns:
        A `matplotlib.figure.Figure`: per head an axes of (rows, S) weights and its
        colorbar (2 axes a head), titled with the batch row and the mask.

    Raises:
        ValueError: a head outside 0..H-1 or a batch row outside 0..B-1.
        ImportError: matplotlib is not installed (the `attnkit[plot]` extra).

    Examples:
        >>> import attnkit.plot as akplot
        >>> q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)  # (B, H|Hkv, L, D)
        >>> fig = akplot.attention(q, k, ak.causal(), heads=[0, 3], rows=slice(4, 8))
        >>> len(fig.axes)  # two heads, each with its colorbar
        4
        >>> fig.axes[0].images[0].get_array().shape  # rows 4..7 against S = 8 keys
        (4, 8)
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
        image = ax.imshow(
            w.numpy(), cmap="viridis", vmin=0.0, aspect="auto", interpolation="nearest"
        )
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xlabel("key j")
        if len(row_ids) <= 16:
            ax.set_yticks(range(len(row_ids)), [str(i) for i in row_ids.tolist()])
        ax.set_ylabel("query i")
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(
        f"attention weights, batch row {batch}: {m if m is not None else 'no mask'}", fontsize=10
    )
    return fig


class Region(NamedTuple):
    """A block of the L×S score matrix a backend computes (`computed_regions`).

    Attributes:
        row0: its first query row.
        rows: how many query rows: rows [row0, row0 + rows).
        key0: its first key.
        keys: how many keys: keys [key0, key0 + keys).
        causal: only the block's lower triangle (its row m sees its keys up to m), as
            SDPA's `is_causal` computes (default False: the whole block).

    Examples:
        >>> from attnkit.plot import Region
        >>> Region(row0=0, rows=4, key0=0, keys=4).pairs  # (query, key) pairs computed
        16
        >>> Region(0, 4, 0, 4, causal=True).pairs  # 1 + 2 + 3 + 4
        10
    """

    row0: int
    rows: int
    key0: int
    keys: int
    causal: bool = False

    @property
    def pairs(self) -> int:
        """The (query, key) pairs the block computes."""
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
    """The backend `attention` would run and the blocks of one batch row it computes:
    the tiled backend's tile plan, FlexAttention's present blocks, or the whole matrix
    (its lower triangle for SDPA's `is_causal`). The rest of L×S it skips.

    Args:
        q: (B, H, L, D) queries.
        k: (B, Hkv, S, D) keys.
        v: (B, Hkv, S, Dv) values.
        mask: as `attnkit.attention` takes it (default None: every key visible).
        batch: the batch row whose blocks are listed (default 0).
        backend: as `attnkit.attention` takes it (default "auto": the one it chooses).

    Returns:
        `(backend, regions)`: the backend's name (str; "none" for an empty call) and
        the list of `Region`s it computes; their `pairs` sum to the work done.

    Raises:
        ValueError: a backend that cannot serve the call, saying why.

    Examples:
        >>> import attnkit.plot as akplot
        >>> q = torch.randn(1, 1, 512, 8)  # (B, H, L, D)
        >>> name, regions = akplot.computed_regions(
        ...     q, q, q, ak.sliding_window(64) & ak.causal(), backend="tiled")
        >>> name, len(regions) > 1  # tiles along the diagonal band
        ('tiled', True)
        >>> sum(r.pairs for r in regions) < 512 * 512 // 2  # less than even causal
        True
    """
    backend = explain(q, k, v, mask, backend=backend).backend
    call = normalize_call(q, k, v, mask, table=runtime.current().costs.table())
    d = call.dims
    if backend == "none":
        return backend, []
    work = runtime.current().backends.get(backend).work(call)
    if work is not None:
        return backend, [
            Region(b.row0, min(b.rows, d.L - b.row0), b.key0, min(b.keys, d.S - b.key0), b.causal)
            for b in work.blocks
            if b.batch == batch
        ]
    return backend, [Region(0, d.L, 0, d.S)]  # the whole matrix


def plan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    batch: int = 0,
    backend: str = "auto",
) -> Figure:
    """What `attention(q, k, v, mask, backend=backend)` computes, drawn: the mask's
    density (blue) under the blocks the backend computes (outlined in orange, from
    `computed_regions`); the rest it skips. The title names the backend and the share
    of L×S it computes.

    Args:
        q: (B, H, L, D) queries.
        k: (B, Hkv, S, D) keys.
        v: (B, Hkv, S, Dv) values.
        mask: as `attnkit.attention` takes it (default None: every key visible).
        batch: the batch row drawn (default 0).
        backend: as `attnkit.attention` takes it (default "auto": the one it chooses).

    Returns:
        A `matplotlib.figure.Figure` with one axes.

    Raises:
        ValueError: a backend that cannot serve the call, saying why.
        ImportError: matplotlib is not installed (the `attnkit[plot]` extra).

    Examples:
        >>> import attnkit.plot as akplot
        >>> q = torch.randn(1, 1, 256, 8)  # (B, H, L, D)
        >>> fig = akplot.plan(q, q, q, ak.sliding_window(32) & ak.causal(), backend="tiled")
        >>> type(fig).__name__, len(fig.axes)
        ('Figure', 1)
        >>> fig.axes[0].get_title().startswith("backend 'tiled'")
        True
    """
    from matplotlib.patches import Polygon, Rectangle

    L, S = q.shape[-2], k.shape[-2]
    backend, regions = computed_regions(q, k, v, mask, batch=batch, backend=backend)
    m = None if mask is None else as_mask(mask)
    image = density_image(m, L, S, batch=batch)
    fig = _figure(5.2, 5.2 * min(max(L / S, 0.3), 2.0))
    ax = fig.add_subplot()
    _show_density(ax, image, L, S)
    for r in regions:  # position p's cell spans p - 0.5 .. p + 0.5 (`_show_density`)
        rows, keys, x, y = r.rows, r.keys, r.key0 - 0.5, r.row0 - 0.5
        if r.causal:
            corners = [(x, y), (x, y + rows), (x + keys, y + rows)]
            ax.add_patch(Polygon(corners, fill=False, edgecolor="tab:orange", linewidth=0.8))
        else:
            ax.add_patch(
                Rectangle((x, y), keys, rows, fill=False, edgecolor="tab:orange", linewidth=0.8)
            )
    computed = sum(r.pairs for r in regions) / (L * S)
    ax.set_title(
        f"backend '{backend}': computes {computed:.1%} of L×S (outlined)\n"
        f"mask {m if m is not None else 'none'}: density {float(image.mean()):.1%}",
        fontsize=9,
    )
    return fig
