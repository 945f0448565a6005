"""The `Mask`: a visibility rule over `(b, h, i, j)` (`rule.py`) and its algebra, with
the kinds the algebra makes, which must live beside it: `a & b`, `a | b` (`Combined`),
`~a` (`_Not`), a bool tensor (`_TensorMask`) and a `mask_mod` function (`_ModMask`).

`&` intersects the parts' key spans row by row (exact where every part's are), `|` takes
their hull (a superset); a bias such as `alibi` combines by `&` only.

A bool tensor broadcastable to (B, H, L, S) is accepted wherever a `Mask` is
(`as_mask`); where each row's True entries form one run its spans are read from it
(`masks.intervals`, once per wrapper and version of the tensor), so a (B, 1, L, S)
padded causal mask from a framework runs as fast as the structured kind it is.
`Mask.from_mod(fn)` wraps any FlexAttention-style `fn(b, h, q_idx, kv_idx) -> bool`:
it has no structure (flex runs it natively, `sdpa` and `reference` evaluate it densely,
`tiled` block by block unless it differs between heads, probed once by calling it on
two heads); inside `torch.compile` such a call runs eagerly (a graph break). A bool
tensor given as the mask is found again by the caller's tensor object
(`given_tensor`), so a mask tensor passed again is planned once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.errors import MaskError
from attnkit.masks.checks import (
    batch_of,
    check_broadcastable,
    integer_mask_error,
    not_a_mask_error,
)
from attnkit.masks.intervals import row_intervals
from attnkit.masks.rule import Align, BiasFn, MaskRule, Predicate, indices
from attnkit.masks.spans import Spans

__all__ = [
    "Align",
    "BiasFn",
    "Combined",
    "Mask",
    "Predicate",
    "and_masks",
    "as_mask",
    "conjuncts",
    "given_tensor",
    "indices",
    "or_masks",
]


class Mask(MaskRule):
    """A visibility rule over `(b, h, i, j)`: `True` = query `i` may attend to key `j`.

    A rule on broadcast index tensors, not a stored L×S matrix. Compose with `&` (both),
    `|` (either), `~` (not); a bool tensor joins as a mask. `materialize`, `draw`,
    `key_spans` and `to_block_mask` show it; `from_mod` wraps any FlexAttention mask_mod.

    Examples:
        >>> m = ak.causal() & ~ak.sliding_window(0)  # earlier keys, not its own
        >>> print(m.draw(3))
        · · ·
        ■ · ·
        ■ ■ ·
    """

    @staticmethod
    def from_mod(fn: Predicate, name: str | None = None) -> Mask:
        """A mask from any `fn(b, h, q_idx, kv_idx) -> bool` (FlexAttention's `mask_mod`).

        `fn` gets broadcast index tensors (b: (B,1,1,1), h: (1,H,1,1), q_idx: (1,1,L,1),
        kv_idx: (1,1,1,S), or subsets), so tensor operations only, as FlexAttention's. It
        has no structure attnkit can read (backends evaluate it block by block or dense):
        prefer a built-in kind where one fits.

        Args:
            fn: the predicate, `True` = may attend.
            name: how `str(mask)` and `explain` describe it (default None: the
                function's name).

        Returns:
            A `Mask` evaluating `fn`; it combines with `&`, `|`, `~` like any other.

        Examples:
            >>> every_other = ak.Mask.from_mod(lambda b, h, i, j: (j <= i) & ((i - j) % 2 == 0))
            >>> print(every_other.draw(3))
            ■ · ·
            · ■ ·
            ■ · ■
        """
        return _ModMask(fn, name)

    def __and__(self, other: Mask | Tensor) -> Mask:
        return Combined("&", (self, as_mask(other)))

    def __rand__(self, other: Tensor) -> Mask:
        return Combined("&", (as_mask(other), self))

    def __or__(self, other: Mask | Tensor) -> Mask:
        return Combined("|", (self, as_mask(other)))

    def __ror__(self, other: Tensor) -> Mask:
        return Combined("|", (as_mask(other), self))

    def __invert__(self) -> Mask:
        return _Not(self)


def as_mask(mask: object) -> Mask:
    """A `Mask` from a `Mask` (as it is) or a bool tensor (`True` = may attend).

    Args:
        mask: a `Mask`, or a bool tensor broadcastable to (B, H, L, S).

    Returns:
        A `Mask`; a tensor's is dense, with no structure for backends to skip by.

    Raises:
        MaskError: a float tensor (a bias: pass it alone as `mask=`) or an integer one.
        TypeError: anything else, naming `Mask.from_mod` for a function or `BlockMask`.

    Examples:
        >>> ak.masks.as_mask(torch.tensor([[True, False]])).materialize(1, 2, 3, 2).shape
        torch.Size([1, 2, 3, 2])
    """
    if isinstance(mask, Mask):
        return mask
    if not isinstance(mask, Tensor):
        raise not_a_mask_error(mask)
    if mask.dtype == torch.bool:
        return _TensorMask(mask)
    if mask.is_floating_point():
        raise MaskError(
            f"mask has dtype {mask.dtype}: a float tensor is an additive bias (0 keeps, -inf "
            "removes) and cannot be combined with &, |, ~. Pass it alone as mask=, or turn "
            "it into a visibility mask with from_additive_mask(m)."
        )
    raise integer_mask_error("mask", mask.dtype)


def and_masks(*masks: Mask | Tensor) -> Mask:
    """Keys visible under every mask: `a & b & ...` (FlexAttention's `and_masks`).

    Args:
        *masks: one or more `Mask`s or bool tensors broadcastable to (B, H, L, S).

    Returns:
        A `Mask`; its key spans are exact where every part's are.

    Raises:
        MaskError: no mask given, or a float or integer tensor among them.

    Examples:
        >>> print(ak.and_masks(ak.causal(), ak.sliding_window(1)).draw(3))
        ■ · ·
        ■ ■ ·
        · ■ ■
    """
    if not masks:
        raise MaskError("and_masks needs at least one mask, e.g. and_masks(causal(), mask).")
    return Combined("&", tuple(as_mask(m) for m in masks))


def or_masks(*masks: Mask | Tensor) -> Mask:
    """Keys visible under any mask: `a | b | ...` (FlexAttention's `or_masks`).

    Args:
        *masks: one or more `Mask`s or bool tensors broadcastable to (B, H, L, S).

    Returns:
        A `Mask`; its key spans are a superset (the hull of the parts').

    Raises:
        MaskError: no mask given, a float or integer tensor, or a bias (`alibi`).

    Examples:
        >>> sink = ak.key_padding(torch.tensor([1]))  # key 0 only, as StreamingLLM's sink
        >>> print(ak.or_masks(ak.sliding_window(0), sink).draw(3))
        ■ · ·
        ■ ■ ·
        ■ · ■
    """
    if not masks:
        raise MaskError("or_masks needs at least one mask, e.g. or_masks(prefix_lm(4), mask).")
    return Combined("|", tuple(as_mask(m) for m in masks))


def conjuncts(mask: Mask) -> list[Mask]:
    """The parts nested `&`s join (`[mask]` when it is not an `&`)."""
    if isinstance(mask, Combined) and mask.op == "&":
        return [leaf for part in mask.parts for leaf in conjuncts(part)]
    return [mask]


class Combined(Mask):
    """`a & b` (`op` "&": a pair may attend where every part lets it, their biases
    added) or `a | b` (`op` "|": where any part lets it; no bias), over `parts`. Public
    for what builds on an `&` (a mask shaped for transformers); `and_masks` and
    `or_masks` make one."""

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
        """`&` intersects the parts' intervals row by row, `|` takes their hull."""
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


# what `&`, `|`, `and_masks`, `or_masks` and `~` make


class _TensorMask(Mask):
    def __init__(self, tensor: Tensor) -> None:
        # the caller's tensor: `as_mask` wraps it anew at every call (and may copy it),
        # so what lasts as long as the caller's mask (a prepared call) is found by it
        self._given = tensor
        self._intervals: tuple[object, tuple[Tensor, Tensor] | None] | None = None
        if tensor.dim() > 4:
            check_broadcastable("mask", tuple(tensor.shape), (0, 0, 0, 0))
        if tensor.dim() < 4:
            tensor = tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))
        # an expanded dim (stride 0) holds one value: keep size 1 there, and one compact
        # copy (compiled kernels that index the mask take dense tensors only)
        if 0 in tensor.stride() or not tensor.is_contiguous():
            index = tuple(slice(0, 1) if st == 0 else slice(None) for st in tensor.stride())
            tensor = tensor[index].contiguous()
        self.tensor = tensor  # (B|1, H|1, L|1, S|1): the caller's own where it can be

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        """Each row's one run of visible keys, or None where a row holds more than one or
        the heads differ (found once per version of the tensor)."""
        if self.head_dependent:
            return None
        read = (self.tensor._version, S)
        memo = getattr(self, "_intervals", None)  # absent where the compiled op decoded it
        if memo is None or memo[0] != read:
            memo = self._intervals = (read, row_intervals(self.tensor, S))  # (B|1, L|1) each
        intervals = memo[1]
        if intervals is None:
            return None
        lo, hi = (t.to(device or "cpu") for t in intervals)
        return Spans(lo, hi, exact=True)

    @property
    def batch_size(self) -> int | None:
        return self.tensor.shape[0]

    def check(self, B: int, H: int, L: int, S: int) -> None:
        check_broadcastable("mask", tuple(self.tensor.shape), (B, H, L, S))

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        t = self.tensor.to(device)  # (B|1, H|1, L|1, S|1)
        zero = torch.zeros((), dtype=torch.long, device=device)

        def pick(idx: Tensor, size: int) -> Tensor:  # a size-1 dim broadcasts; 0 stays empty
            return zero if size == 1 else idx

        return lambda b, h, i, j: t[
            pick(b, t.shape[0]), pick(h, t.shape[1]), pick(i, t.shape[2]), pick(j, t.shape[3])
        ]

    @property
    def head_dependent(self) -> bool:
        return self.tensor.shape[1] > 1

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
        if rows is not None or cols is not None:
            return super().dense(B, H, L, S, device, rows, cols)
        self.check(B, H, L, S)
        return self.tensor.to(device or "cpu")  # itself: no gather of a copy

    def describe(self) -> str:
        return f"tensor{tuple(self.tensor.shape)}"


class _ModMask(Mask):
    def __init__(self, fn: Predicate, name: str | None) -> None:
        if not callable(fn):
            raise TypeError(
                f"Mask.from_mod takes a function (b, h, q_idx, kv_idx) -> bool, "
                f"got {type(fn).__name__}."
            )
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self._per_head: bool | None = None

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        fn, name = self.fn, self.name

        def checked(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            out = fn(b, h, i, j)
            if not isinstance(out, Tensor) or out.dtype != torch.bool:
                got = out.dtype if isinstance(out, Tensor) else type(out).__name__
                raise MaskError(
                    f"mask_mod {name} must return a bool tensor (True = may attend), got "
                    f"{got}; compare indices, e.g. lambda b, h, q, kv: kv <= q."
                )
            return out

        return checked

    @property
    def head_dependent(self) -> bool:
        """Probed once on two heads: an output without a head dim cannot depend on h."""
        if self._per_head is None:
            zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
            heads = torch.arange(2).view(1, 2, 1, 1)
            try:
                out = self.fn(zero, heads, zero, zero)
                self._per_head = not (
                    isinstance(out, Tensor) and out.dim() == 4 and out.shape[1] == 1
                )
            except Exception:  # the real call raises its own error; be safe here
                self._per_head = True
        return self._per_head

    def describe(self) -> str:
        return f"from_mod({self.name})"


def given_tensor(mask: Mask) -> Tensor | None:
    """The caller's tensor a tensor mask was made from by `as_mask` (None for others and
    for a mask decoded inside the compiled op, which holds the op's tensor itself).

    `as_mask` wraps a tensor anew at every call; the prepared calls that should last as
    long as the caller's mask are found by this tensor, not by the wrapper."""
    return getattr(mask, "_given", None) if type(mask) is _TensorMask else None


# what `as_mask` (and so `&`, `|` with a tensor) and `Mask.from_mod` make
