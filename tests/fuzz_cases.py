"""Random attention calls for the differential fuzz harness: shapes, dtypes, layouts, masks.

A case is drawn through a `Draw`: the same generator serves hypothesis (`HypothesisDraw`,
which shrinks a failure to a small case) and a seeded campaign (`RandomDraw`, where case
`i` of seed `s` is always the same call). `build(case)` turns it into tensors.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

import attnkit as ak
from attnkit.masks import row_spans
from attnkit.masks.structure import dense_bias

T = TypeVar("T")

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
LAYOUTS = ("contiguous", "transposed", "last_dim", "sliced", "expanded")
HEAD_DIMS = (1, 2, 3, 8, 16, 40, 64, 72)


class Draw(Protocol):
    def int(self, lo: int, hi: int) -> int: ...

    def choice(self, options: Sequence[T]) -> T: ...


class RandomDraw:
    """Draws from a seeded `random.Random`: case `index` of `seed` is reproducible."""

    def __init__(self, seed: int, index: int) -> None:
        self.rng = random.Random(f"{seed}:{index}")

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]


class HypothesisDraw:
    """Draws through hypothesis's `st.data()`, so failures shrink."""

    def __init__(self, data: Any) -> None:
        from hypothesis import strategies as st

        self.data, self.st = data, st

    def int(self, lo: int, hi: int) -> int:
        value: int = self.data.draw(self.st.integers(lo, hi))
        return value

    def choice(self, options: Sequence[T]) -> T:
        return options[self.int(0, len(options) - 1)]


def chance(draw: Draw, percent: int) -> bool:
    return draw.int(0, 99) < percent


@dataclass
class Case:
    """One attention call, described so that `build` makes it and `str` names it."""

    B: int
    H: int
    Hkv: int
    L: int
    S: int
    D: int
    Dv: int
    dtype: torch.dtype
    layouts: tuple[str, str, str]
    mask: MaskSpec | None
    magnitude: float  # typical |logit|: q is scaled so scores reach about this
    scale: float | None
    softcap: float | None
    poison: float | None  # NaN or Inf written into keys no query sees
    seed: int
    rows: tuple[int, ...] = ()  # rows asked of attention_probs
    flex: bool = False
    leak: str | None = None  # "k" or "v": NaN at a key some rows see and others hide

    def __str__(self) -> str:
        return (
            f"B={self.B} H={self.H} Hkv={self.Hkv} L={self.L} S={self.S} D={self.D} "
            f"Dv={self.Dv} {str(self.dtype)[6:]} layouts={','.join(self.layouts)} "
            f"mask={self.mask} |logit|~{self.magnitude:g} scale={self.scale} "
            f"softcap={self.softcap} poison={self.poison} seed={self.seed}"
            + (f" leak={self.leak}" if self.leak else "")
        )


@dataclass
class MaskSpec:
    """A mask as a tree: `make(case, generator)` builds it; `str` describes it."""

    text: str
    make: Callable[[Case, torch.Generator], Any]
    bias: bool = False  # adds to the scores: combines by `&` only
    tensor_bias: bool = False  # a float tensor: stands alone
    parts: list[MaskSpec] = field(default_factory=list)

    def __str__(self) -> str:
        return self.text


def _align(draw: Draw, L: int, S: int) -> str | None:
    options: tuple[str | None, ...] = ("top_left", "bottom_right")
    return draw.choice((None, *options) if L == S else options)


def _ids(draw: Draw, n: int, kind: str) -> Callable[[torch.Generator], torch.Tensor]:
    """Document ids of n positions: sorted runs (empty and one-token documents among them),
    unsorted ids, or every token its own document."""
    pieces = draw.int(1, 6)

    def make(g: torch.Generator) -> torch.Tensor:
        if kind == "unsorted":
            return torch.randint(0, pieces, (n,), generator=g)
        if kind == "singletons":
            return torch.arange(n)
        cuts = torch.randint(0, n + 1, (pieces,), generator=g)  # duplicates: empty documents
        return (torch.arange(n)[:, None] >= cuts[None, :]).sum(-1)

    return make


def _leaf(draw: Draw, B: int, H: int, L: int, S: int) -> MaskSpec:
    kind = draw.choice(
        (
            "causal",
            "sliding",
            "lengths",
            "valid",
            "document",
            "prefix",
            "prefix_lengths",
            "bool",
            "offset",
            "chunked",
            "mod",
            "row_spans",
        )
    )
    align = _align(draw, L, S)
    if kind == "causal":
        return MaskSpec(f"causal({align})", lambda c, g: ak.causal(align=align))
    if kind == "offset":  # a static cache's diagonal, rows with no key among them
        n = draw.int(-3, S + 1)
        return MaskSpec(f"causal(offset={n})", lambda c, g: ak.causal(offset=n))
    if kind == "mod":  # a mask_mod function: no structure, may differ between heads
        period, per_head = draw.int(2, 5), chance(draw, 50)

        def mod(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            return (i * 7 + j * 3 + (h if per_head else 0)) % period != 0

        return MaskSpec(
            f"from_mod(period {period}, per_head={per_head})", lambda c, g: ak.Mask.from_mod(mod)
        )
    if kind == "chunked":
        size = draw.int(1, S + 2)
        return MaskSpec(f"chunked({size}, {align})", lambda c, g: ak.chunked(size, align))
    if kind == "sliding":
        left, right = draw.int(0, S + 2), draw.int(0, 3)  # windows wider than S too
        return MaskSpec(
            f"sliding_window({left}, {right}, {align})",
            lambda c, g: ak.sliding_window(left, right, align=align),
        )
    if kind == "lengths":
        zero = chance(draw, 30)  # batch rows with no key at all

        def lengths(c: Case, g: torch.Generator) -> ak.Mask:
            n = torch.randint(0, S + 1, (B,), generator=g)
            return ak.key_padding(n.masked_fill(n < S // 3, 0) if zero else n)

        return MaskSpec(f"key_padding(lengths{', zeros' if zero else ''})", lengths)
    if kind == "valid":
        style = draw.choice(("random", "left", "none_real"))

        def valid(c: Case, g: torch.Generator) -> ak.Mask:
            if style == "none_real":
                return ak.key_padding(torch.zeros(B, S, dtype=torch.bool))
            if style == "left":
                start = torch.randint(0, S + 1, (B, 1), generator=g)
                # rows may hold no real token: meant (the convention's warning is not for it)
                return ak.from_hf_attention_mask(torch.arange(S)[None] >= start)
            return ak.from_hf_attention_mask(torch.rand(B, S, generator=g) < 0.6)

        return MaskSpec(f"key_padding(valid, {style})", valid)
    if kind == "document":
        style = draw.choice(("sorted", "unsorted", "singletons"))
        q_ids, kv_ids = _ids(draw, L, style), _ids(draw, S, style)
        per_batch = chance(draw, 50)

        def documents(c: Case, g: torch.Generator) -> ak.Mask:
            if L == S and chance_rng(g, 50):
                ids = torch.stack([kv_ids(g) for _ in range(B)]) if per_batch and B else kv_ids(g)
                return ak.document(ids)
            return ak.document(q_ids(g), kv_ids(g))

        return MaskSpec(f"document({style})", documents)
    if kind == "row_spans":  # each row's key interval given as such (varlen_attn's mask)
        per_batch = B > 1 and chance(draw, 50)

        def spans(c: Case, g: torch.Generator) -> ak.Mask:
            shape = (B, L) if per_batch else (L,)
            lo = torch.randint(-1, S + 1, shape, generator=g)
            return row_spans(lo, lo + torch.randint(-1, S + 2, shape, generator=g))  # empty too

        return MaskSpec(f"row_spans(per_batch={per_batch})", spans)
    if kind == "prefix":
        n = draw.int(0, S + 1)
        return MaskSpec(f"prefix_lm({n}, {align})", lambda c, g: ak.prefix_lm(n, align=align))
    if kind == "prefix_lengths":
        return MaskSpec(
            f"prefix_lm(lengths, {align})",
            lambda c, g: ak.prefix_lm(torch.randint(0, S + 1, (B,), generator=g), align=align),
        )
    shape = tuple(draw.choice((full, 1)) for full in (B, H, L, S))[4 - draw.int(0, 4) :]
    density = draw.choice((0.0, 0.3, 0.7, 1.0))
    return MaskSpec(
        f"bool{shape}@{density}",
        lambda c, g: torch.rand(shape, generator=g) < density,
    )


def chance_rng(g: torch.Generator, percent: int) -> bool:
    return int(torch.randint(0, 100, (), generator=g)) < percent


def draw_mask(draw: Draw, B: int, H: int, L: int, S: int, depth: int = 0) -> MaskSpec | None:
    """None, a float bias tensor, or a tree of mask kinds joined by & | ~ (ALiBi by &)."""
    kind = draw.choice(("none", "leaf", "leaf", "and", "or", "not", "float", "alibi"))
    if kind == "none" and depth == 0:
        return None
    if kind == "float" and depth == 0:
        shape = tuple(draw.choice((full, 1)) for full in (B, H, L, S))[4 - draw.int(0, 4) :]
        hidden = draw.choice((0.0, 0.3, 1.0))

        def bias(c: Case, g: torch.Generator) -> torch.Tensor:
            values = torch.randn(shape, generator=g, dtype=torch.float64)
            return values.masked_fill(torch.rand(shape, generator=g) < hidden, -torch.inf)

        return MaskSpec(f"float{shape}@{hidden}", bias, tensor_bias=True)
    if kind in ("and", "or") and depth < 2:
        a, b = (draw_mask(draw, B, H, L, S, depth + 1) for _ in range(2))
        parts = [p for p in (a, b) if p is not None and not p.tensor_bias]
        if kind == "or":
            parts = [p for p in parts if not p.bias]
        if len(parts) == 2:
            op = " & " if kind == "and" else " | "

            def join(c: Case, g: torch.Generator) -> Any:
                left, right = (p.make(c, g) for p in parts)
                return left & right if kind == "and" else left | right

            bias = kind == "and" and any(p.bias for p in parts)
            return MaskSpec(f"({parts[0]}{op}{parts[1]})", join, bias=bias, parts=parts)
    if kind == "not" and depth < 2:
        inner = _leaf(draw, B, H, L, S)
        return MaskSpec(f"~{inner}", lambda c, g: ~ak.masks.as_mask(inner.make(c, g)))
    if kind == "alibi" and depth < 2:
        align = _align(draw, L, S)
        return MaskSpec(f"alibi({align})", lambda c, g: ak.alibi(c.H, align=align), bias=True)
    return _leaf(draw, B, H, L, S)


def draw_case(draw: Draw, *, flex_percent: int = 0) -> Case:
    size = draw.choice(("tiny", "tiny", "small", "small", "medium", "large"))
    top = {"tiny": 6, "small": 40, "medium": 300, "large": 1100}[size]
    L, S = draw.int(0 if chance(draw, 3) else 1, top), draw.int(0 if chance(draw, 3) else 1, top)
    if chance(draw, 30):
        S = L
    Hkv = draw.choice((1, 1, 2, 3))
    H = Hkv * draw.choice((1, 1, 2, 4))
    B = 0 if chance(draw, 2) else draw.int(1, 3 if size != "large" else 1)
    D = draw.choice(HEAD_DIMS)
    Dv = D if chance(draw, 60) else draw.choice(HEAD_DIMS)
    layouts = (draw.choice(LAYOUTS), draw.choice(LAYOUTS), draw.choice(LAYOUTS))
    magnitude = draw.choice((1.0, 1.0, 1.0, 10.0, 1e3, 1e4))
    scale = draw.choice((None, None, None, 0.5, 0.0, -0.3))
    rows = tuple(sorted({draw.int(0, max(L - 1, 0)) for _ in range(3)})) if L else ()
    return Case(
        B=B,
        H=H,
        Hkv=Hkv,
        L=L,
        S=S,
        D=D,
        Dv=Dv,
        dtype=draw.choice(DTYPES),
        layouts=layouts,
        mask=draw_mask(draw, B, H, L, S),
        magnitude=magnitude,
        scale=scale,
        softcap=draw.choice((None, None, None, 5.0)),
        poison=draw.choice((None, float("nan"), float("inf"))),
        seed=draw.int(0, 2**31 - 1),
        rows=rows,
        flex=chance(draw, flex_percent),
        leak=draw.choice((None, None, "k", "v")),  # drawn last: the other fields as before
    )


def with_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as `t` (B, heads, N, d) in another memory layout."""
    if layout == "transposed":  # stored (B, N, heads, d), as a projection gives it
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "last_dim":  # the last dim is not contiguous
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "sliced":  # every dim strided, x[..., ::2] style
        big = t.new_zeros(*t.shape[:2], 2 * t.shape[2], 2 * t.shape[3])
        big[:, :, ::2, ::2] = t
        return big[:, :, ::2, ::2]
    return t.contiguous()


def expanded(t: torch.Tensor) -> torch.Tensor:
    """`t` with one batch row and head broadcast (stride 0): values are those of row 0."""
    return t[:1, :1].expand(t.shape)


@dataclass
class Built:
    """Tensors of a case: clean float64 values, the inputs as given (poisoned), the mask."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    clean: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # float64, unpoisoned
    mask: Any
    visible: torch.Tensor  # (B, H, L, S) float64 truth of what may be attended
    bias: torch.Tensor | None  # (B, H, L, S) float64 additive, or None
    dout: torch.Tensor  # (B, H, L, Dv)
    dlse: torch.Tensor  # (B, H, L)


def build(case: Case) -> Built:
    g = torch.Generator().manual_seed(case.seed)
    c = case
    q = torch.randn(c.B, c.H, c.L, c.D, generator=g, dtype=torch.float64)
    k = torch.randn(c.B, c.Hkv, c.S, c.D, generator=g, dtype=torch.float64)
    v = torch.randn(c.B, c.Hkv, c.S, c.Dv, generator=g, dtype=torch.float64)
    scale = abs(c.scale) if c.scale else c.D**-0.5
    factor = (c.magnitude / (scale * c.D**0.5)) ** 0.5  # scores q·kᵀ·scale of about this size
    q, k = q * factor, k * factor
    q, k, v = (t.to(c.dtype) for t in (q, k, v))  # values rounded to the case's dtype
    q, k, v = (
        expanded(t) if layout == "expanded" else t
        for t, layout in zip((q, k, v), c.layouts, strict=True)
    )
    mask = None if c.mask is None else c.mask.make(c, g)
    visible, bias = _truth_mask(mask, c)
    clean = (q.double(), k.double(), v.double())
    q, k, v = _poisoned(q, k, v, visible, c)
    q, k, v = (
        t if layout == "expanded" else with_layout(t, layout)
        for t, layout in zip((q, k, v), c.layouts, strict=True)
    )
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        mask = mask.to(c.dtype)
        bias = mask.double().expand(c.B, c.H, c.L, c.S)
        visible = bias > -torch.inf
    dout = torch.randn(c.B, c.H, c.L, c.Dv, generator=g, dtype=torch.float64).to(c.dtype)
    dlse = torch.randn(c.B, c.H, c.L, generator=g, dtype=torch.float64)
    return Built(q, k, v, clean, mask, visible, bias, dout, dlse)


def _truth_mask(mask: Any, c: Case) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, H, L, S) visibility and float64 bias of a mask, built independently of backends."""
    full = (c.B, c.H, c.L, c.S)
    if mask is None:
        return torch.ones(full, dtype=torch.bool), None
    if isinstance(mask, torch.Tensor):
        if mask.is_floating_point():
            bias = mask.double().expand(full)
            return bias > -torch.inf, bias
        return mask.expand(full), None
    visible = mask.materialize(*full)
    bias = dense_bias(mask, *full)
    return visible, None if bias is None else bias.double().expand(full)


def _poisoned(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, c: Case
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NaN or Inf in the keys/values no query sees and in queries that see nothing."""
    if c.poison is None or visible.numel() == 0:
        return q, k, v
    rows = visible.any(-1)  # (B, H, L)
    keys = visible.any(-2).view(c.B, c.Hkv, c.H // c.Hkv, c.S).any(2)  # (B, Hkv, S)
    out = []
    for t, seen, layout in zip((q, k, v), (rows, keys, keys), c.layouts, strict=True):
        if layout == "expanded":  # one storage for every row: poisoning one poisons all
            out.append(t)
            continue
        out.append(t.masked_fill(~seen[..., None], c.poison))
    return out[0], out[1], out[2]
