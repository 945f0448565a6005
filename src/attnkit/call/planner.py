"""The planner: which backend serves a call, and why each other one does not.

`plan_call` never runs attention: it asks every backend whether it can serve the call
(`can_use`), prices those that can with the cost model (`cost`, with `attnkit.call.cost`'s
table: built in for this CPU's kind, or measured here by `attnkit calibrate`, never by the
call; a call autograd records at its forward and backward, `Backend.training_factor`; a
backend whose cheap `cost_floor` is no better than the best priced so far is not
priced) and picks the cheapest, ties to the earlier in the registry's order (or the one asked
for), and counts the work: `flops = 2·B·H·(allowed query-key pairs)·(D + Dv)`
(flash-attention's convention for the forward pass).
"""

from __future__ import annotations

import html
import math
import textwrap
from dataclasses import dataclass, field

from attnkit import runtime
from attnkit.backends import Backend
from attnkit.call.steps import step_of
from attnkit.contracts import AttentionCall
from attnkit.masks.structure import count_allowed_pairs

__all__ = ["Plan", "backend_for_run", "choose_backend", "cost_summary", "plan_call", "step_order"]

WIDTH = 88  # `print(plan)`'s lines at most (a terminal, the docs' code blocks)


@dataclass(frozen=True)
class Plan:
    """What `attention(...)` would do for a call, computed without running it.

    Made by `attnkit.explain` (or `Prepared.explain`), not by hand; `print(plan)` reads
    as a report, and a notebook shows it as a table. Which backend wins depends on the
    machine's cost table, so code should read the facts below rather than expect one.

    Args:
        backend: the backend that would run, or `"none"` for an empty call (B, H, L, Dv
            or S is 0).
        reasons: every backend by name: None for the chosen one, else why not (it
            cannot serve the call, or its estimated cost).
        flops: 2·B·H·(allowed query-key pairs)·(D + Dv), the forward pass's work.
        peak_bytes: the extra memory the chosen backend needs, estimated.
        shapes: `"q"`, `"k"`, `"v"`, `"out"` (and `"lse"`) to their shapes.
        mask: the mask's description (default `"none"`).
        density: the share of the L×S pairs the mask lets through (default 1.0).
        notes: further lines: the cost table's source (its figures with
            `verbose=True`), packed documents.

    Examples:
        >>> q = torch.randn(1, 2, 4, 8)
        >>> plan = ak.explain(q, q, q, ak.sliding_window(1))
        >>> plan.mask, plan.density, plan.shapes["out"]
        ('sliding_window(left=1, right=0)', 0.4375, (1, 2, 4, 8))
        >>> plan.reasons[plan.backend] is None  # every other backend says why not
        True
        >>> print(plan)  # doctest: +ELLIPSIS
        attnkit plan: backend '...'
          q (1, 2, 4, 8)  k (1, 2, 4, 8)  v (1, 2, 4, 8)  ->  out (1, 2, 4, 8)
          mask     sliding_window(left=1, right=0)  (density 43.8% of L×S)
        ...
    """

    backend: str  # "none" for an empty call (B, H, L, Dv or S is 0)
    reasons: dict[str, str | None]  # backend name -> why not chosen, None for the chosen one
    flops: int
    peak_bytes: int
    shapes: dict[str, tuple[int, ...]]
    mask: str = "none"
    density: float = 1.0
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        s = self.shapes
        lines = [
            f"attnkit plan: backend '{self.backend}'",
            f"  q {s['q']}  k {s['k']}  v {s['v']}  ->  out {s['out']}",
            f"  mask     {self.mask}  (density {self.density:.1%} of L×S)",
            f"  work     {self.flops / 1e9:.3f} GFLOP (2·B·H·allowed pairs·(D+Dv))",
            f"  memory   ≈ {_human_bytes(self.peak_bytes)} extra",
            "  backends",
        ]
        for name, reason in self.reasons.items():
            mark, why = ("✓", "chosen") if reason is None else ("✗", reason)
            lines += _wrapped(f"    {mark} {name:<10} ", why)
        for note in self.notes:
            lines += _wrapped("  note     ", note)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        """What a notebook shows: the plan as a table, the chosen backend first."""
        s = self.shapes
        cells = [
            ("shapes", f"q {s['q']}  k {s['k']}  v {s['v']}  →  out {s['out']}"),
            ("mask", f"{self.mask} (density {self.density:.1%} of L×S)"),
            ("work", f"{self.flops / 1e9:.3f} GFLOP"),
            ("memory", f"≈ {_human_bytes(self.peak_bytes)} extra"),
        ]
        ranked = sorted(self.reasons.items(), key=lambda item: item[1] is not None)
        cells += [(name, "chosen" if why is None else f"not chosen: {why}") for name, why in ranked]
        cells += [("note", n) for n in self.notes]
        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(name)}</th>"
            f"<td style='text-align:left'>{html.escape(text)}</td></tr>"
            for name, text in cells
        )
        title = html.escape(f"attnkit plan: backend '{self.backend}'")
        return f"<div><b>{title}</b><table>{rows}</table></div>"


def _wrapped(head: str, text: str) -> list[str]:
    """`head` and `text` in lines of at most `WIDTH`, continued under the text."""
    return textwrap.wrap(
        text, WIDTH, initial_indent=head, subsequent_indent=" " * len(head), break_on_hyphens=False
    )


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover


def backend_for_run(call: AttentionCall, name: str, *, need_lse: bool) -> Backend:
    """The backend `choose_backend` would choose, without the reasons for the others. A
    dense call or a decoding step (`steps.step_of`) goes straight to a backend that
    `takes_step` it, else to the one whose dense kernel is the cheapest per pair
    (`Backend.fastest_on_dense`: sdpa), where it can serve it. A prepared call keeps the
    choice."""
    if name == "auto" and (backend := _dense_shortcut(call, need_lse)) is not None:
        return backend
    return _pick(call, name, need_lse)[0]


def step_order(call: AttentionCall) -> list[Backend]:
    """The backends a dense call or decoding step runs on unpriced, in order (the first
    that can serve it); [] for a call that is priced. Reads neither the mask's tensors
    nor S but by its bucket: the same for every step of a bucket."""
    if call.softcap is not None or not (call.is_dense or step_of(call) is not None):
        return []
    backends = runtime.current().backends
    takers = [b for b in backends if b.takes_step(call)]
    if not takers and any(b.beats_dense(call) for b in backends):
        return []  # priced: a kernel may beat the dense-fastest one here
    return takers + [b for b in backends if b.fastest_on_dense]


def _dense_shortcut(call: AttentionCall, need_lse: bool) -> Backend | None:
    """The backend a dense call or decoding step runs on unpriced, or None (priced)."""
    for backend in step_order(call):  # a backend that takes this call comes first
        if backend.can_use(call, need_lse=need_lse) is None:
            return backend
    return None


def _pick(
    call: AttentionCall, name: str, need_lse: bool
) -> tuple[Backend, dict[str, str | None], dict[str, float], set[str]]:
    """The backend to run, every backend's refusal (None: it can serve) and, for `auto`,
    the estimated cost of each that can: a backend whose `cost_floor` (a cheap lower
    bound) is no better than the best priced so far gets that floor, unpriced (the
    last: those names)."""
    backends = runtime.current().backends
    refusals = {b.name: b.can_use(call, need_lse=need_lse) for b in backends}
    if name != "auto":
        backend = backends.get(name)
        if refusals[name] is not None:
            raise ValueError(
                f"backend {name!r} cannot serve this call: {refusals[name]}. Use "
                "backend='auto' (it picks one that can) or backend='reference'."
            )
        return backend, refusals, {}, set()
    costs: dict[str, float] = {}
    floored: set[str] = set()
    for backend in (b for b in backends if refusals[b.name] is None):
        n = backend.name
        training = backend.training_factor(call)  # 1 without gradient
        floor = backend.cost_floor(call) * training
        if floor >= min(costs.values(), default=math.inf):
            costs[n] = floor  # never cheaper: not priced (tiled's plan costs ms)
            floored.add(n)
        else:
            costs[n] = backend.cost(call, need_lse=need_lse) * training
    chosen = min(costs, key=costs.__getitem__)  # ties go to the earlier in the registry
    return backends.get(chosen), refusals, costs, floored


def choose_backend(
    call: AttentionCall, name: str, *, need_lse: bool
) -> tuple[Backend, dict[str, str | None]]:
    """The backend to run and, for every backend, why it was not chosen (None if chosen)."""
    backend, reasons, costs, floored = _pick(call, name, need_lse)
    shortcut = _dense_shortcut(call, need_lse) if name == "auto" else None
    if shortcut is not None and shortcut is not backend:
        own = max(costs.get(shortcut.name, 1.0), 1.0)
        kind = "a dense call" if call.is_dense else "a decoding step"
        for n, estimate in costs.items():  # explain says what runs: the dense call's rule
            reasons[n] = (
                f"{kind} runs on '{shortcut.name}' unpriced "
                f"(estimated {estimate / own:.1f}× its cost)"
            )
        reasons[shortcut.name] = None
        return shortcut, reasons
    if name != "auto":
        for n in reasons:
            reasons[n] = None if n == name else reasons[n] or f"not asked for (backend={name!r})"
        return backend, reasons
    chosen = backend.name
    passes = " (forward+backward)" if call.requires_grad else ""
    for n, estimate in costs.items():
        if n == chosen:
            continue
        reasons[n] = (
            "its first call would compile a kernel (seconds); warm it once with "
            f"backend={n!r}, then auto considers it"
            if math.isinf(estimate)
            else f"slower here: estimated {estimate / max(costs[chosen], 1.0):.1f}× the cost "
            f"of '{chosen}'{' or more' if n in floored else ''}{passes}"
        )
    reasons[chosen] = None
    return backend, reasons


def _shapes(call: AttentionCall) -> dict[str, tuple[int, ...]]:
    d = call.dims
    return {
        "q": tuple(call.q.shape),
        "k": tuple(call.k.shape),
        "v": tuple(call.v.shape),
        "out": (d.B, d.H, d.L, d.Dv),
        "lse": (d.B, d.H, d.L),
    }


def _empty_plan(call: AttentionCall, name: str) -> Plan:
    """Nothing to compute (B, H, L, Dv or S is 0): zeros, and no backend runs."""
    backends = runtime.current().backends
    if name != "auto":
        backends.get(name)  # an unknown name still raises
    why = "nothing to compute: B, H, L, Dv or S is 0, so the output is all zeros"
    return Plan(
        backend="none",
        reasons=dict.fromkeys(backends.names()[1:], why),
        flops=0,
        peak_bytes=0,
        shapes=_shapes(call),
        mask="none" if call.mask is None else str(call.mask),
        density=0.0,
        notes=[why],
    )


def cost_summary() -> str:
    """One line for `explain`: each backend's factors in the table the process prices
    with, and where they came from."""
    table = runtime.current().costs.table()
    parts = [
        f"{b.name} " + ", ".join(f"{name} {_figure(x)}" for name, x in b.factors(table).items())
        for b in runtime.current().backends
        if b.cost_factors.default
    ]
    return f"cost model (× dense SDPA per pair): {'; '.join(parts)}; {table.source}"


def _figure(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def plan_call(
    call: AttentionCall, name: str = "auto", *, need_lse: bool = False, verbose: bool = False
) -> Plan:
    """The `Plan` for a validated call; `verbose`: with the cost model's figures."""
    d = call.dims
    if call.is_empty:
        return _empty_plan(call, name)
    backend, reasons = choose_backend(call, name, need_lse=need_lse)
    pairs = count_allowed_pairs(call.mask, d.B, d.H, d.L, d.S, call.q.device)
    shapes = {**_shapes(call), **backend.intermediates(call)}
    notes = ["an additive bias is applied to the scores"] if call.has_bias else []
    notes += backend.notes(call)
    if name == "auto":  # the table it priced with (its figures where asked)
        table = runtime.current().costs.table()
        source = f"cost table: {table.source}; its figures: explain(..., verbose=True)"
        notes.append(cost_summary() if verbose else source)
    return Plan(
        backend=backend.name,
        reasons=reasons,
        flops=2 * pairs * (d.D + d.Dv),
        peak_bytes=backend.peak_bytes(call, need_lse=need_lse),
        shapes=shapes,
        mask="none" if call.mask is None else str(call.mask),
        density=pairs / (d.B * d.H * d.L * d.S),
        notes=notes,
    )
