"""The `Mask` protocol: a visibility rule over `(b, h, i, j)`, and its algebra (`&`, `|`, `~`).

`True` = query `i` may attend to key `j`, everywhere. A kind of mask writes three
things: its `predicate` (the rule on broadcast index tensors), its `key_spans` (each
row's interval of keys, where it has one) and its `describe`; a mask that adds to the
scores (`alibi`) writes `bias` too. Everything backends read beyond that (the rows and
keys anybody sees, tile bounds, pair counts, whether it is SDPA's own causal mask)
derives from those in `structure.py`. A `Mask` is evaluated by broadcasting `arange`s,
so nothing builds the full (B, H, L, S) tensor unless asked to (`materialize`).
The kinds live in `positions.py` and `tokens.py`, tensor and `from_mod` masks in
`tensor.py`, ALiBi in `biases.py`, the converters in `convert.py`.

A kind that holds data also writes `check`, `batch_size`, `num_heads` and
`head_dependent`. `Mask` has 16 public names: those, `has_bias`, `sees_all` (derived
from the spans of a mask holding no tensors; the kinds over positions answer in O(1),
since a decoding step asks it every call), `tensors`, `dense`, `materialize`, `draw`,
`to_block_mask` and `from_mod`. `&` intersects the parts' spans row by row (exact if
every part is); `|` takes their hull (a superset).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from attnkit.errors import MaskError
from attnkit.masks.checks import batch_of, integer_mask_error
from attnkit.masks.spans import Spans

__all__ = ["Align", "BiasFn", "Mask", "Predicate", "and_masks", "as_mask", "or_masks"]

Align = Literal["top_left", "bottom_right"]
# (b, h, i, j) index tensors, broadcastable to (B, H, L, S) -> bool tensor
Predicate = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
# (b, h, i, j) index tensors -> float tensor added to the scores
BiasFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

ALLOWED, HIDDEN = "■", "·"


class Mask:
    """A visibility rule over `(b, h, i, j)`; compose with `&`, `|`, `~`."""

    # what makes a Mask of what is not one ("tensor": a bool tensor, for `as_mask` and
    # the operators; "mod": a mask_mod function, for `from_mod`): `tensor.py` fills it
    # when the package loads, so this module imports no kind
    _wrappers: ClassVar[dict[str, Callable[..., Mask]]] = {}
    # every kind by its class name, as it is defined (how `masks.spec` decodes a kind)
    _kinds: ClassVar[dict[str, type[Mask]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Mask._kinds[cls.__name__] = cls

    # ------------------------------------------------------------ what a kind writes

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        """The rule for a (B, H, L, S) problem, as a function of broadcast index tensors."""
        raise NotImplementedError

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        """Each query row's interval of keys `[lo, hi)`, (B|1, L|1), computed from the
        structure alone (never from an L×S tensor), or None where there is none.

        `exact` spans describe the mask completely (causal, sliding window, sorted
        documents, prefix-LM, length padding and their `&`); others are a superset
        (the keys outside are hidden; the backends mask inside them exactly).
        """
        return None

    def describe(self) -> str:
        raise NotImplementedError

    def check(self, B: int, H: int, L: int, S: int) -> None:
        """Raise `ShapeContractError` or `MaskError` if this mask cannot serve (B, H, L, S)."""

    def bias(self, B: int, H: int, L: int, S: int, device: torch.device) -> BiasFn | None:
        """The additive score bias as a function of broadcast (b, h, i, j), or None."""
        return None

    @property
    def has_bias(self) -> bool:
        """True if this mask also adds a structured bias to the scores (e.g. `alibi`)."""
        return False

    @property
    def batch_size(self) -> int | None:
        """The batch size this mask carries data for, or None if it holds for any batch."""
        return None

    @property
    def num_heads(self) -> int | None:
        """The query-head count this mask is built for (`alibi`'s slopes), or None if any."""
        return None

    @property
    def head_dependent(self) -> bool:
        """True if different heads see different keys (only a tensor mask can)."""
        return False

    def sees_all(self, L: int, S: int) -> bool:
        """True if every query row may see every key (no mask needed), from the structure
        alone: bottom-right causal at L = 1 (a decoding step), a window as wide as the
        keys. From the spans of a mask that holds no tensors (the kinds over positions
        answer in O(1): the decoding hot path asks it every step); False where unsure."""
        if self.tensors():
            return False
        spans = self.key_spans(1, L, S)
        return (
            spans is not None
            and spans.exact
            and bool((spans.lo == 0).all() and (spans.hi == S).all())
        )

    def _sdpa_causal(self, L: int, S: int) -> bool | None:
        """`structure.is_sdpa_causal` in O(1) where a kind knows it (None: derive it)."""
        return None

    # ------------------------------------------------------------ what every mask has

    def _fields(self) -> dict[str, object]:
        """The fields that make this mask's value: its public attributes (a name that
        starts with `_` is what a kind remembers about itself, never part of the value:
        the caller's tensor a tensor mask was made from, a probe's answer)."""
        return {name: value for name, value in vars(self).items() if name[0] != "_"}

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor this mask holds, its parts' included (a mask is a value: the
        same tensors for its whole life; caches key on their identity and version)."""
        every: list[Tensor] = []
        for value in self._fields().values():
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, Tensor):
                    every.append(item)
                elif isinstance(item, Mask):
                    every.extend(item.tensors())
        return tuple(every)

    def dense(
        self,
        B: int,
        H: int,
        L: int,
        S: int,
        device: torch.device | str | None = None,
        rows: Tensor | None = None,
        cols: Tensor | None = None,
    ) -> Tensor:
        """Evaluate to the smallest bool tensor broadcastable to (B, H, L, S).

        `rows` / `cols` restrict the query / key positions (the last two dims then have
        their lengths).
        """
        self.check(B, H, L, S)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        b, h, i, j = indices(B, H, L, S, dev, rows, cols)
        allowed = self.predicate(B, H, L, S, dev)(b, h, i, j)
        return allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))

    def materialize(
        self, B: int, H: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Tensor:
        """The full bool tensor (B, H, L, S), `True` = may attend (a broadcast view)."""
        return self.dense(B, H, L, S, device).expand(B, H, L, S)

    def to_block_mask(
        self,
        B: int | None,
        H: int | None,
        L: int,
        S: int,
        *,
        block_size: int = 128,
        device: torch.device | str | None = None,
    ) -> Any:
        """FlexAttention's `BlockMask` of this mask for (B, H, L, S), the way to feed an
        attnkit mask to `flex_attention` (on a GPU too): the same present and full
        blocks as `create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=block_size)`,
        built from the key spans in O(blocks) where they are exact, else evaluated in
        row chunks; its `mask_mod` is this mask's predicate (a bias such as `alibi` is
        not part of it: pass it as a score_mod). B or H None, as FlexAttention takes them:
        the mask's own batch size and head count, 1 where it holds for any (flex
        broadcasts a dim of 1)."""
        from attnkit.masks.blocks import block_mask

        B = (self.batch_size or 1) if B is None else B
        H = (self.num_heads or 1) if H is None else H
        return block_mask(self, B, H, L, S, block_size=block_size, device=device)

    def draw(
        self,
        L: int,
        S: int | None = None,
        *,
        batch: int = 0,
        head: int = 0,
        cells: int | None = None,
    ) -> str:
        """Text picture of the L×S matrix for one batch row and head: ■ may attend, · hidden.

        `cells`: at most this many characters a side; where L or S is larger, each
        character stands for a block of pairs: ■ every pair may attend, ▪ some, · none
        (`masks.picture.block_text`).

        >>> print(ak.causal().draw(3))
        ■ · ·
        ■ ■ ·
        ■ ■ ■
        >>> print(ak.causal().draw(8, cells=4))
        ▪ · · ·
        ■ ▪ · ·
        ■ ■ ▪ ·
        ■ ■ ■ ▪
        """
        S = L if S is None else S
        if cells is not None and max(L, S) > cells:
            from attnkit.masks.picture import block_text

            return block_text(self, L, S, batch=batch, head=head, cells=cells)
        B = self.batch_size or 1
        grid = self.materialize(B, self.num_heads or head + 1, L, S)[batch, head]  # (L, S)
        return "\n".join(" ".join(ALLOWED if x else HIDDEN for x in row) for row in grid.tolist())

    @staticmethod
    def from_mod(fn: Predicate, name: str | None = None) -> Mask:
        """A mask from any `fn(b, h, q_idx, kv_idx) -> bool` (FlexAttention's `mask_mod`).

        `fn` is called with broadcast index tensors (b: (B,1,1,1), h: (1,H,1,1), q_idx:
        (1,1,L,1), kv_idx: (1,1,1,S), or row/column subsets of them), so it must use
        tensor operations only, as a mask_mod for FlexAttention must. It has no structure
        attnkit can read: backends evaluate it (flex natively, the others block by block
        or as a dense mask). Prefer a built-in kind where one fits.

        >>> print(Mask.from_mod(lambda b, h, i, j: (j <= i) & ((i - j) % 2 == 0)).draw(3))
        ■ · ·
        · ■ ·
        ■ · ■
        """
        return Mask._wrappers["mod"](fn, name)

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        return f"Mask[{self.describe()}]"

    def _repr_html_(self) -> str:
        """What a notebook shows: the description and a drawing (`masks.picture`)."""
        from attnkit.masks.picture import mask_html

        return mask_html(self)

    def __and__(self, other: Mask | Tensor) -> Mask:
        return _Combine("&", (self, as_mask(other)))

    def __rand__(self, other: Tensor) -> Mask:
        return _Combine("&", (as_mask(other), self))

    def __or__(self, other: Mask | Tensor) -> Mask:
        return _Combine("|", (self, as_mask(other)))

    def __ror__(self, other: Tensor) -> Mask:
        return _Combine("|", (as_mask(other), self))

    def __invert__(self) -> Mask:
        return _Not(self)


def indices(
    B: int, H: int, L: int, S: int, dev: torch.device, rows: Tensor | None, cols: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcast (b, h, i, j) index tensors over (B, H, L|R, S|C)."""
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1)
    i = (torch.arange(L, device=dev) if rows is None else rows.to(dev)).view(1, 1, -1, 1)
    j = (torch.arange(S, device=dev) if cols is None else cols.to(dev)).view(1, 1, 1, -1)
    return b, h, i, j


def as_mask(mask: object) -> Mask:
    """A `Mask` from a `Mask` or a bool tensor (broadcastable to (B, H, L, S))."""
    if isinstance(mask, Mask):
        return mask
    if not isinstance(mask, Tensor):
        raise _not_a_mask(mask)
    if mask.dtype == torch.bool:
        return Mask._wrappers["tensor"](mask)
    if mask.is_floating_point():
        raise MaskError(
            f"mask has dtype {mask.dtype}: a float tensor is an additive bias (0 keeps, -inf "
            "removes) and cannot be combined with &, |, ~. Pass it alone as mask=, or turn "
            "it into a visibility mask with from_additive_mask(m)."
        )
    raise integer_mask_error("mask", mask.dtype)


def _not_a_mask(mask: object) -> TypeError:
    """What to do with something that is no mask: FlexAttention's pieces name from_mod."""
    kind = type(mask).__name__
    rule = "(fn(b, h, q_idx, kv_idx) -> bool, True = may attend)"
    if kind == "BlockMask":
        return TypeError(
            "mask is a BlockMask; attnkit takes its predicate and builds its own blocks: "
            f"mask=Mask.from_mod(block_mask.mask_mod) {rule}."
        )
    if callable(mask):
        return TypeError(f"mask is a function; wrap it as mask=Mask.from_mod(fn) {rule}.")
    return TypeError(
        f"mask must be a Mask, a bool tensor (True = may attend) or, alone, a float tensor "
        f"(added to the scores), got {kind}."
    )


class _Combine(Mask):
    def __init__(self, op: str, parts: tuple[Mask, ...]) -> None:
        if op == "|" and any(p.has_bias for p in parts):
            raise MaskError(
                "a bias (such as alibi) adds to the scores; it combines with masks by `&` "
                "only, e.g. causal() & alibi(8)."
            )
        self.op = op
        self.parts = parts

    @property
    def has_bias(self) -> bool:
        return any(p.has_bias for p in self.parts)

    def bias(self, B: int, H: int, L: int, S: int, device: torch.device) -> BiasFn | None:
        fns = [f for p in self.parts if (f := p.bias(B, H, L, S, device)) is not None]
        if not fns:
            return None
        return lambda b, h, i, j: sum((f(b, h, i, j) for f in fns[1:]), fns[0](b, h, i, j))

    @property
    def batch_size(self) -> int | None:
        return batch_of(*(p.batch_size for p in self.parts))

    @property
    def num_heads(self) -> int | None:
        return next((n for p in self.parts if (n := p.num_heads) is not None), None)

    def check(self, B: int, H: int, L: int, S: int) -> None:
        for part in self.parts:
            part.check(B, H, L, S)

    @property
    def head_dependent(self) -> bool:
        return any(p.head_dependent for p in self.parts)

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        """`&` intersects the parts' intervals row by row (exact if every part is; a part
        without spans leaves a superset), `|` takes their hull (a superset)."""
        spans = [p.key_spans(B, L, S, device) for p in self.parts]
        known = [s for s in spans if s is not None]
        if not known or (self.op == "|" and len(known) < len(spans)):
            return None
        lo, hi = known[0].lo, known[0].hi
        pick_lo, pick_hi = (
            (torch.maximum, torch.minimum) if self.op == "&" else (torch.minimum, torch.maximum)
        )
        for part in known[1:]:
            lo, hi = pick_lo(lo, part.lo), pick_hi(hi, part.hi)
        exact = self.op == "&" and len(known) == len(spans) and all(s.exact for s in known)
        return Spans(lo, hi.clamp(min=lo) if self.op == "&" else hi, exact)

    def sees_all(self, L: int, S: int) -> bool:
        answers = (p.sees_all(L, S) for p in self.parts)
        return all(answers) if self.op == "&" else any(answers)

    def _sdpa_causal(self, L: int, S: int) -> bool | None:
        """`&` of SDPA's causal mask with masks that hide nothing is that mask."""
        if self.op != "&" or self.has_bias:
            return False
        causal = [p._sdpa_causal(L, S) for p in self.parts]
        if any(c is None for c in causal):
            return None  # a part without an O(1) answer: derive from the spans
        rest = all(c or p.sees_all(L, S) for c, p in zip(causal, self.parts, strict=True))
        return any(causal) and rest

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        preds = [p.predicate(B, H, L, S, device) for p in self.parts]
        combine = torch.logical_and if self.op == "&" else torch.logical_or

        def pred(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            out = preds[0](b, h, i, j)
            for p in preds[1:]:
                out = combine(out, p(b, h, i, j))
            return out

        return pred

    def describe(self) -> str:
        return "(" + f" {self.op} ".join(p.describe() for p in self.parts) + ")"


class _Not(Mask):
    def __init__(self, inner: Mask) -> None:
        if inner.has_bias:
            raise MaskError("~ of a bias (such as alibi) has no meaning; negate masks only.")
        self.inner = inner

    @property
    def batch_size(self) -> int | None:
        return self.inner.batch_size

    @property
    def num_heads(self) -> int | None:
        return self.inner.num_heads

    def check(self, B: int, H: int, L: int, S: int) -> None:
        self.inner.check(B, H, L, S)

    @property
    def head_dependent(self) -> bool:
        return self.inner.head_dependent

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        inner = self.inner.predicate(B, H, L, S, device)
        return lambda b, h, i, j: ~inner(b, h, i, j)

    def describe(self) -> str:
        return f"~{self.inner.describe()}"


def and_masks(*masks: Mask | Tensor) -> Mask:
    """Keys visible under every mask (FlexAttention's `and_masks`)."""
    if not masks:
        raise MaskError("and_masks needs at least one mask, e.g. and_masks(causal(), mask).")
    return _Combine("&", tuple(as_mask(m) for m in masks))


def or_masks(*masks: Mask | Tensor) -> Mask:
    """Keys visible under any mask (FlexAttention's `or_masks`)."""
    if not masks:
        raise MaskError("or_masks needs at least one mask, e.g. or_masks(prefix_lm(4), mask).")
    return _Combine("|", tuple(as_mask(m) for m in masks))
