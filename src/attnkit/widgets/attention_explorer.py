"""The attention explorer: token-labelled attention weights, one panel a head.

The weights come from `attnkit.attention_probs` (exact, for q and k) or from a model's
own weights (transformers' `output_attentions`: a tuple of per-layer (B, H, L, S)
tensors). Each panel is an HTML table, one cell a (query, key) pair shaded by its
weight; hovering a cell shows its title: the head, the query token, the key token and
the weight. It is plain HTML, so it draws in any notebook and a test can read it.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from attnkit.call.probs import attention_probs
from attnkit.masks import Mask
from attnkit.widgets._common import BLUE, PANEL, error_html, ipywidgets, show

__all__ = ["AttentionExplorer", "AttentionView", "attention_explorer"]

Tokens = Sequence[str] | Sequence[Sequence[str]]  # one label a position, or a list a batch row
LABEL = 10  # characters of a token label shown (the hover text has it whole)


@dataclass(frozen=True)
class AttentionView:
    """What the attention explorer draws now, as data.

    Args:
        layer: the layer shown (0 for q and k).
        batch: the batch row shown.
        heads: the query heads shown, one panel each.
        weights: (len(heads), L, S) float, the weights of those heads.
        query_tokens: the L query labels of this batch row.
        key_tokens: the S key labels of this batch row.

    Examples:
        >>> from attnkit.widgets import attention_explorer
        >>> q = torch.randn(1, 2, 3, 8)
        >>> view = attention_explorer(q, q, ak.causal(), tokens=["a", "b", "c"]).view
        >>> view.heads, view.weights.shape, view.key_tokens
        ((0, 1), torch.Size([2, 3, 3]), ['a', 'b', 'c'])
    """

    layer: int
    batch: int
    heads: tuple[int, ...]
    weights: Tensor
    query_tokens: list[str]
    key_tokens: list[str]


def _labels(tokens: Tokens | None, n: int, B: int, what: str) -> list[list[str]]:
    """One list of n labels a batch row (positions "0", "1", ... when None)."""
    if tokens is None:
        return [[str(i) for i in range(n)]] * B
    rows = [list(tokens)] * B if all(isinstance(t, str) for t in tokens) else list(tokens)
    if len(rows) != B:
        raise ValueError(f"{what}: {len(rows)} lists of labels for B={B} batch rows.")
    if any(len(row) != n for row in rows):
        raise ValueError(
            f"{what}: {[len(row) for row in rows]} labels but {n} positions; give one "
            "label a position (a list, or one list a batch row)."
        )
    return [[str(t) for t in row] for row in rows]


def _layers(attentions: Tensor | Sequence[Tensor]) -> list[Tensor]:
    layers = [attentions] if isinstance(attentions, Tensor) else list(attentions)
    if not layers or any(not isinstance(a, Tensor) for a in layers):
        raise ValueError(
            "attentions: give the (B, H, L, S) weights of each layer (a transformers model "
            "returns them with output_attentions=True and attn_implementation='eager'; "
            "its fused kernels return None)."
        )
    shapes = {tuple(a.shape) for a in layers}
    if len(shapes) != 1 or len(next(iter(shapes))) != 4:
        raise ValueError(f"attentions: every layer must be (B, H, L, S), got {sorted(shapes)}.")
    return [a.detach().float().cpu() for a in layers]


class AttentionExplorer:
    """Per-head panels of attention weights, with a layer, batch row and head selector.

    Its controls are attributes a test (or a notebook) may set: `layer` (a slider, shown
    when there are several), `batch` and `heads` (a tuple of query heads). `view` is what
    is drawn (`weights`: its first head's (L, S)), `hover(i, j)` a cell's hover text,
    `widget` the box a notebook shows (evaluating the explorer shows it too).

    Args:
        layers: one (B, H, L, S) weight tensor a layer.
        tokens: L query labels (or one list a batch row); default None: positions.
        key_tokens: S key labels; default None: `tokens` where L == S, else positions.

    Examples:
        >>> from attnkit.widgets import AttentionExplorer
        >>> weights = torch.tensor([[[[1.0, 0.0], [0.25, 0.75]]]])  # (B, H, L, S)
        >>> explorer = AttentionExplorer([weights], tokens=["hi", "there"])
        >>> print(explorer.hover(1, 0))
        head 0: query 1 'there' → key 0 'hi': weight 0.2500
    """

    def __init__(
        self,
        layers: Sequence[Tensor],
        tokens: Tokens | None = None,
        key_tokens: Tokens | None = None,
    ) -> None:
        w = ipywidgets()
        self.layers = _layers(layers)
        B, H, L, S = self.layers[0].shape
        self.query_labels = _labels(tokens, L, B, "tokens")
        if key_tokens is None and tokens is not None and L == S:
            key_tokens = tokens
        self.key_labels = _labels(key_tokens, S, B, "key_tokens")
        self.layer = w.IntSlider(value=0, min=0, max=len(self.layers) - 1, description="layer")
        self.batch = w.Dropdown(
            options=[(f"row {b}", b) for b in range(B)], value=0, description="batch"
        )
        self.heads = w.SelectMultiple(
            options=[(f"head {h}", h) for h in range(H)],
            value=tuple(range(min(H, 4))),
            rows=min(H, 8),
            description="heads",
        )
        self.picture = w.HTML()
        show(self.layer, len(self.layers) > 1)
        show(self.batch, B > 1)
        self.widget = w.VBox([w.HBox([self.layer, self.batch, self.heads]), self.picture])
        for control in (self.layer, self.batch, self.heads):
            control.observe(self._on_change, names="value")
        self.redraw()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _on_change(self, change: Any) -> None:
        self.redraw()

    @property
    def view(self) -> AttentionView:
        """What is drawn now: the chosen heads' (len(heads), L, S) weights and labels."""
        layer, b, heads = self.layer.value, self.batch.value, tuple(self.heads.value)
        weights = self.layers[layer][b, list(heads)]  # (len(heads), L, S)
        return AttentionView(layer, b, heads, weights, self.query_labels[b], self.key_labels[b])

    @property
    def weights(self) -> Tensor:
        """(L, S) weights of the first head shown (`view.weights` has every shown head's)."""
        view = self.view
        if not view.heads:
            raise ValueError("No head is shown: choose one with `explorer.heads.value = (h,)`.")
        return view.weights[0]

    def hover(self, i: int, j: int, head: int | None = None) -> str:
        """The hover text of the cell of query `i` and key `j` of `head` (default: the
        first head shown), for the layer and batch row shown."""
        view = self.view
        h = view.heads[0] if head is None else head
        return _hover(view, h, i, j, float(self.layers[view.layer][view.batch, h, i, j]))

    def redraw(self) -> None:
        """Draw the chosen heads' panels for the layer and batch row shown."""
        view = self.view
        if not view.heads:
            self.picture.value = error_html("Choose at least one head (ctrl/shift-click).")
            return
        panels = [_panel(view, h, w) for h, w in zip(view.heads, view.weights, strict=True)]
        self.picture.value = (
            f"<div style='display: flex; flex-wrap: wrap; gap: 16px; {PANEL}'>"
            f"{''.join(panels)}</div>"
        )


def _hover(view: AttentionView, head: int, i: int, j: int, weight: float) -> str:
    query, key = view.query_tokens[i], view.key_tokens[j]
    return f"head {head}: query {i} {query!r} → key {j} {key!r}: weight {weight:.4f}"


def _panel(view: AttentionView, head: int, weights: Tensor) -> str:
    """One head's (L, S) weights as a table shaded by weight, its largest darkest."""
    L, S = weights.shape
    size = 14 if max(L, S) <= 32 else 8
    top = float(weights.max()) or 1.0
    cell = f"width: {size}px; height: {size}px; padding: 0; border: 1px solid white"
    header = "".join(
        f"<th style='writing-mode: vertical-rl; font-weight: normal; padding: 1px'>"
        f"{html.escape(t[:LABEL])}</th>"
        for t in view.key_tokens
    )
    rows = []
    for i, row in enumerate(weights.tolist()):
        cells = "".join(
            f"<td title='{html.escape(_hover(view, head, i, j, p), quote=True)}' "
            f"style='{cell}; background: rgba({BLUE}, {p / top:.3f})'></td>"
            for j, p in enumerate(row)
        )
        label = html.escape(view.query_tokens[i][:LABEL])
        rows.append(
            f"<tr><th style='text-align: right; font-weight: normal; padding: 0 3px'>"
            f"{label}</th>{cells}</tr>"
        )
    return (
        f"<div><b>head {head}</b> (layer {view.layer}, batch row {view.batch}; "
        f"darkest = {top:.3f})<table style='border-collapse: collapse'>"
        f"<tr><th></th>{header}</tr>{''.join(rows)}</table></div>"
    )


def attention_explorer(
    q: Tensor | None = None,
    k: Tensor | None = None,
    mask: Mask | Tensor | None = None,
    *,
    attentions: Tensor | Sequence[Tensor] | None = None,
    tokens: Tokens | None = None,
    key_tokens: Tokens | None = None,
    scale: float | None = None,
) -> AttentionExplorer:
    """Interactive attention weights in Jupyter: one panel a head, labelled by tokens.

    Give q and k (the weights are `attnkit.attention_probs(q, k, mask, scale=scale)`,
    exact) or a model's `attentions` (transformers' `outputs.attentions` with
    `output_attentions=True`: one (B, H, L, S) tensor a layer; load the model with
    `attn_implementation="eager"`, whose kernels return them). Hovering a cell shows the
    query token, the key token and the weight. Needs ipywidgets
    (`pip install '.[widgets]' from a checkout`).

    Args:
        q: (B, H, L, D) queries.
        k: (B, Hkv, S, D) keys (Hkv divides H).
        mask: as `attnkit.attention` (default None).
        attentions: instead of q and k, a (B, H, L, S) tensor or a sequence of them, one
            a layer (default None).
        tokens: L query labels, or one list a batch row (default None: positions);
            `tokenizer.convert_ids_to_tokens(ids)` gives a model's.
        key_tokens: S key labels (default None: `tokens` where L == S, else positions).
        scale: as `attnkit.attention` (default None: 1/√D).

    Returns:
        An `AttentionExplorer`: its controls (`layer`, `batch`, `heads`) as attributes,
        `view` (what is drawn, as data), `hover(i, j)`, `widget`.

    Raises:
        ImportError: ipywidgets is not installed.
        ValueError: neither or both of q, k and `attentions`, labels that do not fit,
            and the errors of `attention_probs` for the same causes.

    Examples:
        >>> from attnkit.widgets import attention_explorer
        >>> q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
        >>> explorer = attention_explorer(q, k, ak.causal(), tokens=["the", "cat", "sat"])
        >>> explorer.heads.value = (1,)
        >>> torch.equal(explorer.view.weights[0], ak.attention_probs(q, k, ak.causal())[0, 1])
        True
        >>> print(explorer.hover(2, 0))  # hover the cell: query 'sat', key 'the'
        head 1: query 2 'sat' → key 0 'the': weight 0.5417
    """
    if attentions is not None:
        if q is not None or k is not None or mask is not None:
            raise ValueError("Give either q and k (and a mask) or attentions, not both.")
        return AttentionExplorer(_layers(attentions), tokens, key_tokens)
    if q is None or k is None:
        raise ValueError("Give q (B, H, L, D) and k (B, Hkv, S, D), or attentions.")
    weights = attention_probs(q, k, mask, scale=scale)  # (B, H, L, S)
    return AttentionExplorer([weights], tokens, key_tokens)
