"""The mask explorer: a mask's kind and parameters on sliders, its picture redrawn live.

Every change rebuilds the mask with attnkit's constructors, materializes its (L, S)
grid, and asks `attnkit.explain` what a call of those sizes would run. The picture is
an SVG grid (one cell a pair up to 64 a side, blocks of pairs beyond), so it needs no
plotting library and hovering a cell names its pairs. What the library refuses (causal
with L != S and no alignment, say) shows its error message instead of the picture.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from attnkit.call.functional import explain
from attnkit.call.planner import Plan
from attnkit.masks import Align, Mask, causal, chunked, document, key_padding, prefix_lm
from attnkit.masks import sliding_window as window
from attnkit.widgets._common import BLUE, PANEL, error_html, ipywidgets, show, slider

__all__ = ["KINDS", "MaskExplorer", "MaskView", "mask_explorer"]

# label shown (the names of `attnkit mask KIND`) -> constructor
KINDS = {
    "causal": "causal",
    "sliding": "sliding_window",
    "chunked": "chunked",
    "prefix": "prefix_lm",
    "documents": "document",
    "padding": "key_padding",
}
ALIGNMENTS = {
    "none (L == S only)": "none",
    "top_left": "top_left",
    "bottom_right": "bottom_right",
    "offset n": "offset",
}
SIDE = 64  # cells a side at most: one a pair up to this size, blocks of pairs beyond
PIXELS = 448  # the picture's longer side


@dataclass(frozen=True)
class MaskView:
    """What the mask explorer draws now, as data.

    Args:
        L: query length.
        S: key length.
        description: `str(mask)` ("" when the library refused the combination).
        grid: (L, S) bool, True = may attend (None on an error).
        density: the share of the L×S pairs that may attend (None on an error).
        plan: what `attnkit.explain` says for q (1, 1, L, D), k and v (1, 1, S, D)
            (None on an error).
        error: the library's error, `"TypeName: message"`, or None.

    Examples:
        >>> from attnkit.widgets import mask_explorer
        >>> view = mask_explorer("causal", L=4).view
        >>> view.description, view.density, view.grid.sum().item()
        ('causal()', 0.625, 10)
        >>> view.explain_lines[0]  # doctest: +ELLIPSIS
        "explain: backend '...'"
    """

    L: int
    S: int
    description: str = ""
    grid: Tensor | None = None
    density: float | None = None
    plan: Plan | None = None
    error: str | None = None

    @property
    def backend(self) -> str | None:
        """The backend `explain` chose (None on an error)."""
        return None if self.plan is None else self.plan.backend

    @property
    def reasons(self) -> dict[str, str | None]:
        """Every backend by name: None for the chosen one, else why not."""
        return {} if self.plan is None else dict(self.plan.reasons)

    @property
    def explain_lines(self) -> list[str]:
        """`explain: backend '...'`, then one line a backend: ✓ chosen, ✗ and why not."""
        if self.backend is None:
            return []
        marks = [
            f"✓ {name}: chosen" if why is None else f"✗ {name}: {why}"
            for name, why in self.reasons.items()
        ]
        return [f"explain: backend '{self.backend}'", *marks]


class MaskExplorer:
    """Controls for a mask's kind, sizes and parameters, and the live picture.

    Each control is an attribute a test (or a notebook) may set: `kind`, `L`, `S`,
    `left`, `right` (sliding window), `chunk`, `prefix`, `documents` (lengths, repeated
    to cover the keys), `valid` (padding: real keys), `align` (`"none"`, `"top_left"`,
    `"bottom_right"` or `"offset"`), `offset` (with `align="offset"`), `and_causal`
    (`& causal()` for windows, chunks, documents and padding). `view` is what is drawn;
    `grid`, `density`, `plan` and `error` its parts; `widget` the ipywidgets box a
    notebook shows (evaluating the explorer shows it too).

    Args:
        kind: the first mask kind, as `mask_explorer`'s (default `"causal"`).
        L: query length (default 16).
        S: key length (default None: L).
        max_len: the sliders' largest L and S (default 256).
        head_dim: D of the call `explain` plans (default 64).

    Examples:
        >>> from attnkit.widgets import MaskExplorer
        >>> explorer = MaskExplorer("chunked", L=6)
        >>> explorer.chunk.value = 3
        >>> print(explorer.view.description)
        chunked(3)
        >>> explorer.view.density
        0.5
    """

    def __init__(
        self,
        kind: str = "causal",
        *,
        L: int = 16,
        S: int | None = None,
        max_len: int = 256,
        head_dim: int = 64,
    ) -> None:
        w = ipywidgets()
        S = L if S is None else S
        if kind not in KINDS.values():
            raise ValueError(f"kind={kind!r}: choose one of {sorted(KINDS.values())}.")
        if not (1 <= L <= max_len and 1 <= S <= max_len):
            raise ValueError(f"L={L}, S={S}: each must lie in 1..max_len={max_len}.")
        self.head_dim = head_dim
        self.kind = w.Dropdown(options=list(KINDS.items()), value=kind, description="mask")
        self.L = slider("L (queries)", L, 1, max_len)
        self.S = slider("S (keys)", S, 1, max_len)
        self.left = slider("left", 3, 0, max_len)
        self.right = slider("right", 0, 0, max_len)
        self.chunk = slider("chunk", 4, 1, max_len)
        self.prefix = slider("prefix", 4, 0, max_len)
        self.documents = w.Text(
            value="4, 4, 8",
            description="document lengths",
            continuous_update=False,
            style={"description_width": "initial"},
        )
        self.valid = slider("real keys", max(1, S - S // 4), 0, max_len)
        self.align = w.Dropdown(options=list(ALIGNMENTS.items()), value="none", description="align")
        self.offset = slider("offset n", 0, -max_len, max_len)
        self.and_causal = w.Checkbox(value=False, description="& causal", indent=False)
        self.picture = w.HTML()
        self.info = w.HTML()
        self._parameters = [
            self.left,
            self.right,
            self.chunk,
            self.prefix,
            self.documents,
            self.valid,
            self.offset,
        ]
        self.widget = w.VBox(
            [
                w.HBox([self.kind, self.align, self.and_causal]),
                w.HBox([self.L, self.S]),
                w.HBox(self._parameters, layout=w.Layout(flex_flow="row wrap")),
                w.HBox([self.picture, self.info]),
            ]
        )
        self._view = MaskView(L, S)
        for control in (self.kind, self.L, self.S, self.align, self.and_causal, *self._parameters):
            control.observe(self._on_change, names="value")
        self.redraw()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _on_change(self, change: Any) -> None:
        self.redraw()

    @property
    def view(self) -> MaskView:
        """What is drawn now: the grid, density, description, plan or error."""
        return self._view

    @property
    def grid(self) -> Tensor | None:
        """(L, S) bool, the mask drawn (True = may attend); None on an error."""
        return self._view.grid

    @property
    def density(self) -> float | None:
        """The share of the L×S pairs that may attend; None on an error."""
        return self._view.density

    @property
    def plan(self) -> Plan | None:
        """`attnkit.explain`'s plan for a call of these sizes; None on an error."""
        return self._view.plan

    @property
    def error(self) -> str | None:
        """The library's error for these controls, `"TypeName: message"`, or None."""
        return self._view.error

    def document_ids(self) -> Tensor:
        """(S,) document ids: the `documents` lengths, repeated to cover the S keys."""
        try:
            lengths = [int(n) for n in self.documents.value.replace(",", " ").split()]
        except ValueError:
            lengths = []
        if not lengths or min(lengths) < 1:
            raise ValueError(
                f"document lengths {self.documents.value!r}: write positive integers, "
                "e.g. '4, 4, 8' (repeated to cover the S keys)."
            )
        S = self.S.value
        pattern = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        repeats = math.ceil(S / len(pattern))
        ids = pattern + len(lengths) * torch.arange(repeats)[:, None]  # (repeats, period)
        return ids.reshape(-1)[:S]

    def mask(self) -> Mask:
        """The mask the controls describe, built with attnkit's constructors.

        Raises:
            MaskError: parameters a constructor refuses (and the other errors of the
                constructors), or document lengths that are not positive integers.
        """
        chosen = self.align.value
        align = None if chosen in ("none", "offset") else cast(Align, chosen)
        offset = self.offset.value if chosen == "offset" else None
        kind = self.kind.value
        if kind == "causal":
            return causal(align, offset=offset)
        if kind == "prefix_lm":
            return prefix_lm(self.prefix.value, align, offset=offset)
        if kind == "sliding_window":
            m = window(self.left.value, self.right.value, align, offset=offset)
        elif kind == "chunked":
            m = chunked(self.chunk.value, align, offset=offset)
        elif kind == "document":
            m = document(self.document_ids())
        else:
            m = key_padding(torch.tensor([self.valid.value]))
        return m & causal(align, offset=offset) if self.and_causal.value else m

    def redraw(self) -> None:
        """Rebuild the mask from the controls, and the picture and text from it."""
        L, S = self.L.value, self.S.value
        try:
            m = self.mask()
            grid = m.materialize(1, 1, L, S)[0, 0]  # (L, S)
            q = torch.zeros(1, 1, L, self.head_dim)
            kv = torch.zeros(1, 1, S, self.head_dim)
            plan = explain(q, kv, kv, m)
        except (ValueError, TypeError, RuntimeError) as err:
            self._view = MaskView(L, S, error=f"{type(err).__name__}: {err}")
        else:
            density = float(grid.float().mean())
            self._view = MaskView(L, S, str(m), grid, density, plan)
        self._show_controls()
        view = self._view
        if view.error is not None or view.grid is None:
            self.picture.value = error_html(view.error or "")
            self.info.value = ""
            return
        self.picture.value = grid_svg(view.grid)
        self.info.value = _info_html(view)

    def _show_controls(self) -> None:
        kind, placed = self.kind.value, self.kind.value not in ("document", "key_padding")
        combined = self.and_causal.value and kind not in ("causal", "prefix_lm")
        show(self.left, kind == "sliding_window")
        show(self.right, kind == "sliding_window")
        show(self.chunk, kind == "chunked")
        show(self.prefix, kind == "prefix_lm")
        show(self.documents, kind == "document")
        show(self.valid, kind == "key_padding")
        show(self.and_causal, kind not in ("causal", "prefix_lm"))
        show(self.align, placed or combined)
        show(self.offset, (placed or combined) and self.align.value == "offset")


def mask_explorer(
    kind: str = "causal",
    *,
    L: int = 16,
    S: int | None = None,
    max_len: int = 256,
    head_dim: int = 64,
) -> MaskExplorer:
    """An interactive mask in Jupyter: choose a kind and its parameters, see it live.

    Shows the L×S picture (dark = may attend; hover a cell for its pair), `str(mask)`,
    its density and what `attnkit.explain` would run for q (1, 1, L, D) and k, v
    (1, 1, S, D), with every other backend's reason. What the library refuses shows its
    error message instead. Needs ipywidgets (`pip install '.[widgets]' from a checkout`).

    Args:
        kind: `"causal"`, `"sliding_window"`, `"chunked"`, `"prefix_lm"`, `"document"`
            or `"key_padding"` (default `"causal"`).
        L: query length (default 16).
        S: key length (default None: L).
        max_len: the sliders' largest L and S (default 256; beyond 64 the picture draws
            blocks of pairs, each shaded by the share that may attend).
        head_dim: D of the call `explain` plans (default 64).

    Returns:
        A `MaskExplorer`: its controls as attributes, `view` (what is drawn, as data),
        `widget` (the box a notebook shows; the last line of a cell shows it).

    Raises:
        ImportError: ipywidgets is not installed.
        ValueError: an unknown `kind`, or L or S outside 1..max_len.

    Examples:
        >>> from attnkit.widgets import mask_explorer
        >>> explorer = mask_explorer("sliding_window", L=8)
        >>> explorer.left.value = 2
        >>> explorer.view.description, explorer.view.density
        ('sliding_window(left=2, right=0)', 0.328125)
        >>> explorer.S.value = 12  # L != S and no alignment: the library's error
        >>> print(explorer.view.error)  # doctest: +ELLIPSIS
        ShapeContractError: sliding_window mask with L=8 queries and S=12 keys: ...
        >>> explorer.align.value = "bottom_right"
        >>> explorer.view.grid.shape
        torch.Size([8, 12])
    """
    return MaskExplorer(kind, L=L, S=S, max_len=max_len, head_dim=head_dim)


def _cells(grid: Tensor) -> tuple[Tensor, int, int]:
    """(⌈L/r⌉, ⌈S/c⌉) shares of r×c blocks of pairs that may attend, with r, c the
    smallest blocks that keep the picture within `SIDE` cells a side (1×1 when small)."""
    L, S = grid.shape
    r, c = math.ceil(L / SIDE), math.ceil(S / SIDE)
    padded = torch.nn.functional.pad(grid.float(), (0, -S % c, 0, -L % r), value=math.nan)
    blocks = padded.reshape(padded.shape[0] // r, r, padded.shape[1] // c, c)
    return blocks.nanmean(dim=(1, 3)), r, c  # (⌈L/r⌉, ⌈S/c⌉)


def _span(start: int, size: int, end: int) -> str:
    last = min(start + size, end) - 1
    return str(start) if last == start else f"{start}–{last}"


def grid_svg(grid: Tensor) -> str:
    """An SVG picture of an (L, S) bool grid: blue = may attend; each cell's title (its
    tooltip) names its query and key, or its block's ranges and share."""
    L, S = grid.shape
    cells, r, c = _cells(grid)
    rows, columns = cells.shape
    size = max(3, min(24, PIXELS // max(rows, columns)))
    margin = 34
    width, height = margin + columns * size + 4, margin + rows * size + 4
    stroke = "white" if size >= 6 else "none"
    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"style='{PANEL}'>",
        f"<text x='{margin}' y='12'>key j → (S={S})</text>",
        f"<text x='12' y='{margin}' transform='rotate(90 12 {margin})'>query i → (L={L})</text>",
        f"<g stroke='{stroke}' stroke-width='0.5'>",
    ]
    for a, row in enumerate(cells.tolist()):
        for b, share in enumerate(row):
            i, j = a * r, b * c
            if r == c == 1:
                title = f"query {i}, key {j}: {'may attend' if share else 'hidden'}"
            else:
                title = f"queries {_span(i, r, L)}, keys {_span(j, c, S)}: {share:.0%} may attend"
            fill = f"rgba({BLUE},{share:.3f})" if share > 0 else "#f0f0f0"
            parts.append(
                f"<rect x='{margin + b * size}' y='{margin + a * size}' width='{size}' "
                f"height='{size}' fill='{fill}'><title>{html.escape(title)}</title></rect>"
            )
    parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


def _info_html(view: MaskView) -> str:
    assert view.grid is not None and view.density is not None
    allowed = int(view.grid.sum())
    lines = view.explain_lines
    reasons = "".join(f"<li>{html.escape(line)}</li>" for line in lines[1:])
    return (
        f"<div style='{PANEL}; max-width: 560px; padding-left: 12px'>"
        f"<b>{html.escape(view.description)}</b><br>"
        f"density {view.density:.1%}: {allowed} of {view.L}×{view.S} pairs may attend<br>"
        f"<br>{html.escape(lines[0])} for q (1, 1, {view.L}, D), k and v (1, 1, {view.S}, D)"
        f"<ul style='margin: 2px 0; padding-left: 16px'>{reasons}</ul></div>"
    )
