"""Masks as composable predicates: `True` = query `i` may attend to key `j`, everywhere.

A `Mask` is a rule over index tensors `(b, h, i, j)`, not a stored L×S matrix. It is
evaluated by broadcasting `arange`s, so a causal mask over L=S=4 costs a (1, 1, 4, 4)
tensor and a key-padding mask a (B, 1, 1, S) one, and nothing needs to build the full
(B, H, L, S) tensor unless asked to (`materialize`).

Conventions (DESIGN.md §2):
- causal alignment `top_left`: `j <= i`; `bottom_right`: `j <= i + (S - L)`. They agree
  when L == S; when L != S you must choose one, attnkit never guesses.
- `sliding_window(left, right)` is inclusive: a query sees `left + 1 + right` keys.
- other conventions enter only through the converters `from_key_padding_mask`,
  `from_hf_attention_mask` and `from_additive_mask`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from attnkit.errors import MaskError, ShapeContractError

__all__ = [
    "Mask",
    "and_masks",
    "as_mask",
    "causal",
    "document",
    "from_additive_mask",
    "from_hf_attention_mask",
    "from_key_padding_mask",
    "key_padding",
    "or_masks",
    "prefix_lm",
    "sliding_window",
]

Align = Literal["top_left", "bottom_right"]
# (b, h, i, j) index tensors, broadcastable to (B, H, L, S) -> bool tensor
Predicate = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

_ALIGNS = ("top_left", "bottom_right")
ALLOWED, HIDDEN = "■", "·"


class Mask:
    """A visibility rule over `(b, h, i, j)`; compose with `&`, `|`, `~`."""

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        """The rule for a (B, H, L, S) problem, as a function of broadcast index tensors."""
        raise NotImplementedError

    def check(self, B: int, H: int, L: int, S: int) -> None:
        """Raise `ShapeContractError` or `MaskError` if this mask cannot serve (B, H, L, S)."""

    @property
    def batch_size(self) -> int | None:
        """The batch size this mask carries data for, or None if it holds for any batch."""
        return None

    def is_sdpa_causal(self, L: int, S: int) -> bool:
        """True if this mask is exactly SDPA's `is_causal=True` with every key seen.

        That is top-left causal with L >= S: no empty row, no key hidden from all queries.
        """
        return False

    @property
    def head_dependent(self) -> bool:
        """True if different heads see different keys (only a tensor mask can)."""
        return False

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Key span `[lo, hi)` holding every key visible to query rows `first..last`.

        `first`, `last`: (T,) row ranges (of query tiles). Returns `lo`, `hi` of shape
        (B|1, T), computed from the structure alone, never from an L×S tensor. The span
        may be loose (a superset); the tiled backend masks inside it exactly.
        """
        zeros = torch.zeros(1, first.shape[0], dtype=torch.long, device=first.device)
        return zeros, zeros + S

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
        b = torch.arange(B, device=dev).view(B, 1, 1, 1)
        h = torch.arange(H, device=dev).view(1, H, 1, 1)
        i = (torch.arange(L, device=dev) if rows is None else rows.to(dev)).view(1, 1, -1, 1)
        j = (torch.arange(S, device=dev) if cols is None else cols.to(dev)).view(1, 1, 1, -1)
        allowed = self.predicate(B, H, L, S, dev)(b, h, i, j)
        return allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))

    def materialize(
        self, B: int, H: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Tensor:
        """The full bool tensor (B, H, L, S), `True` = may attend (a broadcast view)."""
        return self.dense(B, H, L, S, device).expand(B, H, L, S)

    def draw(self, L: int, S: int | None = None, *, batch: int = 0, head: int = 0) -> str:
        """Text picture of the L×S matrix for one batch row and head: ■ may attend, · hidden."""
        S = L if S is None else S
        B = self.batch_size or 1
        grid = self.materialize(B, head + 1, L, S)[batch, head]  # (L, S)
        return "\n".join(" ".join(ALLOWED if x else HIDDEN for x in row) for row in grid.tolist())

    def describe(self) -> str:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        return f"Mask[{self.describe()}]"

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


# ----------------------------------------------------------------------------- helpers


def _check_align(align: str | None) -> None:
    if align is not None and align not in _ALIGNS:
        raise MaskError(f"align={align!r} is not a causal alignment; use one of {_ALIGNS}.")


def causal_offset(align: str | None, L: int, S: int, who: str = "causal") -> int:
    """How far the diagonal of query `i` shifts right: key `i + offset` is the last visible."""
    if align is None and L != S:
        raise ShapeContractError(
            f"{who} mask with L={L} queries and S={S} keys: the alignment is ambiguous. "
            f"Choose {who}(align='top_left') (key j visible to query i iff j <= i, as SDPA's "
            f"is_causal) or {who}(align='bottom_right') (iff j <= i + S - L, as flash-attention "
            "and KV-cache decoding)."
        )
    return S - L if align == "bottom_right" else 0


def _check_int(name: str, value: object, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
    if value < minimum:
        raise MaskError(
            f"{name}={value} is negative; a window size counts keys, so use {name} >= 0."
        )
    return value


def _check_batch(name: str, got: int, B: int) -> None:
    if got not in (1, B):
        raise ShapeContractError(
            f"{name} holds {got} batch rows but q has B={B}; give one row per batch element "
            "(or a single row to share)."
        )


def check_broadcastable(name: str, shape: tuple[int, ...], target: tuple[int, ...]) -> None:
    """Raise unless a tensor of `shape` broadcasts to `target` = (B, H, L, S)."""
    if len(shape) > 4:
        raise ShapeContractError(
            f"{name} has {len(shape)} dims, shape {shape}; it must broadcast to (B, H, L, S), "
            "so it has at most 4 dims."
        )
    padded = (1,) * (4 - len(shape)) + shape
    for got, want, letter in zip(padded, target, "BHLS", strict=True):
        if got not in (1, want):
            raise ShapeContractError(
                f"{name} of shape {shape} does not broadcast to (B, H, L, S) = {target}: its "
                f"{letter} dim is {got}, expected 1 or {want}. Reshape it (a (B, S) padding "
                "mask becomes (B, 1, 1, S)), or use key_padding(valid) for padding."
            )


def _batch_of(*sizes: int | None) -> int | None:
    known = [s for s in sizes if s is not None and s != 1]
    return max(known) if known else (1 if any(s == 1 for s in sizes) else None)


# ----------------------------------------------------------------------------- constructors


class _Causal(Mask):
    def __init__(self, align: str | None) -> None:
        _check_align(align)
        self.align = align

    def check(self, B: int, H: int, L: int, S: int) -> None:
        causal_offset(self.align, L, S)

    def is_sdpa_causal(self, L: int, S: int) -> bool:
        return L >= S and (L == S or self.align == "top_left")

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        offset = causal_offset(self.align, L, S)
        return torch.zeros_like(first)[None], (last + offset + 1).clamp(0, S)[None]

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        offset = causal_offset(self.align, L, S)
        return lambda b, h, i, j: j <= i + offset

    def describe(self) -> str:
        return "causal()" if self.align is None else f"causal(align={self.align!r})"


def causal(align: Align | None = None) -> Mask:
    """Query `i` may attend to keys up to its own (aligned) position.

    `top_left`: `j <= i`; `bottom_right`: `j <= i + (S - L)`. With L == S both agree and
    `align` may be left out; with L != S it must be given (see DESIGN.md §2).

    >>> print(causal().draw(4))
    ■ · · ·
    ■ ■ · ·
    ■ ■ ■ ·
    ■ ■ ■ ■
    >>> print(causal(align="bottom_right").draw(2, 4))
    ■ ■ ■ ·
    ■ ■ ■ ■
    >>> print(causal(align="top_left").draw(2, 4))
    ■ · · ·
    ■ ■ · ·
    """
    return _Causal(align)


class _SlidingWindow(Mask):
    def __init__(self, left: int, right: int, align: str | None) -> None:
        self.left = _check_int("left", left)
        self.right = _check_int("right", right)
        _check_align(align)
        self.align = align

    def check(self, B: int, H: int, L: int, S: int) -> None:
        causal_offset(self.align, L, S, who="sliding_window")

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        offset = causal_offset(self.align, L, S, who="sliding_window")
        left, right = self.left, self.right
        return lambda b, h, i, j: (j >= i + offset - left) & (j <= i + offset + right)

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        offset = causal_offset(self.align, L, S, who="sliding_window")
        lo = (first + offset - self.left).clamp(0, S)
        return lo[None], (last + offset + self.right + 1).clamp(0, S)[None]

    def describe(self) -> str:
        align = "" if self.align is None else f", align={self.align!r}"
        return f"sliding_window(left={self.left}, right={self.right}{align})"


def sliding_window(left: int, right: int = 0, align: Align | None = None) -> Mask:
    """Query `i` sees keys `[i' - left, i' + right]`, `i'` its aligned position (inclusive).

    A window holds `left + 1 + right` keys (flash-attention's `window_size=(left, right)`;
    transformers' `sliding_window=W` is `left = W - 1`). Alignment as in `causal`.

    >>> print(sliding_window(1).draw(4))
    ■ · · ·
    ■ ■ · ·
    · ■ ■ ·
    · · ■ ■
    >>> print(sliding_window(1, 1).draw(4))
    ■ ■ · ·
    ■ ■ ■ ·
    · ■ ■ ■
    · · ■ ■
    """
    return _SlidingWindow(left, right, align)


class _KeyPadding(Mask):
    def __init__(self, valid: Tensor) -> None:
        if valid.dtype == torch.bool:
            if valid.dim() != 2:
                raise ShapeContractError(
                    f"key_padding(valid) takes a (B, S) bool tensor, got shape {tuple(valid.shape)}"
                    "; for lengths pass a (B,) integer tensor."
                )
        elif not valid.is_floating_point() and valid.dim() == 1:
            if (valid < 0).any():
                raise MaskError(f"key_padding lengths must be >= 0, got {valid.tolist()}.")
        else:
            raise MaskError(
                f"key_padding takes a (B, S) bool tensor (True = real token) or (B,) integer "
                f"lengths, got dtype {valid.dtype} and shape {tuple(valid.shape)}. For 0/1 "
                "masks use from_hf_attention_mask (1 = real) or from_key_padding_mask "
                "(True = ignore)."
            )
        self.valid = valid

    @property
    def is_lengths(self) -> bool:
        return self.valid.dtype != torch.bool

    @property
    def batch_size(self) -> int | None:
        return self.valid.shape[0]

    def check(self, B: int, H: int, L: int, S: int) -> None:
        _check_batch("key_padding", self.valid.shape[0], B)
        if self.is_lengths:
            if (self.valid > S).any():
                raise MaskError(
                    f"key_padding lengths {self.valid.tolist()} exceed S={S} keys; each "
                    "length must lie in [0, S]."
                )
        elif self.valid.shape[1] != S:
            raise ShapeContractError(
                f"key_padding covers {self.valid.shape[1]} keys but k has S={S}; give a "
                "(B, S) mask with one entry per key."
            )

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        valid = self.valid.to(device)
        if self.is_lengths:
            lengths = valid.expand(B)  # (B,)
            return lambda b, h, i, j: j < lengths[b]
        rows = valid.expand(B, S)  # (B, S)
        return lambda b, h, i, j: rows[b, j]

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        valid, T = self.valid.to(first.device), first.shape[0]
        if self.is_lengths:
            hi = valid.view(-1, 1).expand(-1, T)  # (B, T)
            return torch.zeros_like(hi), hi
        position = torch.arange(S, device=first.device)
        lo = torch.where(valid, position, S).amin(-1, keepdim=True)  # (B, 1)
        hi = torch.where(valid, position + 1, 0).amax(-1, keepdim=True)
        return lo.clamp(max=hi).expand(-1, T), hi.expand(-1, T)

    def describe(self) -> str:
        kind = "lengths" if self.is_lengths else "valid"
        return f"key_padding({kind}, B={self.valid.shape[0]})"


def key_padding(valid: Tensor) -> Mask:
    """Hide padded keys. `valid` is (B, S) bool with `True` = real token, or (B,) lengths.

    The same keys are hidden from every query of a batch row:

    >>> print(key_padding(torch.tensor([3])).draw(2, 4))
    ■ ■ ■ ·
    ■ ■ ■ ·
    """
    return _KeyPadding(valid)


class _Document(Mask):
    def __init__(self, q_ids: Tensor, kv_ids: Tensor | None) -> None:
        for name, ids in (("ids", q_ids), ("kv_ids", kv_ids)):
            if ids is None:
                continue
            if ids.is_floating_point() or ids.dtype == torch.bool or ids.dim() not in (1, 2):
                raise MaskError(
                    f"document {name} must be an integer (S,) or (B, S) tensor of document "
                    f"ids, got dtype {ids.dtype} and shape {tuple(ids.shape)}."
                )
        self.q_ids = q_ids if q_ids.dim() == 2 else q_ids.unsqueeze(0)
        self.kv_ids = None if kv_ids is None else (kv_ids if kv_ids.dim() == 2 else kv_ids[None])

    @property
    def batch_size(self) -> int | None:
        return _batch_of(self.q_ids.shape[0], None if self.kv_ids is None else self.kv_ids.shape[0])

    def check(self, B: int, H: int, L: int, S: int) -> None:
        kv_ids = self.q_ids if self.kv_ids is None else self.kv_ids
        _check_batch("document ids", self.q_ids.shape[0], B)
        _check_batch("document kv_ids", kv_ids.shape[0], B)
        if self.kv_ids is None and L != S:
            raise ShapeContractError(
                f"document(ids) with L={L} queries and S={S} keys: one id sequence cannot "
                "label both. Use document(q_ids, kv_ids) with (B, L) and (B, S) ids."
            )
        if self.q_ids.shape[1] != L or kv_ids.shape[1] != S:
            raise ShapeContractError(
                f"document ids have lengths {self.q_ids.shape[1]} (queries) and "
                f"{kv_ids.shape[1]} (keys) but the call has L={L}, S={S}; give one id per "
                "position."
            )

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        q_ids = self.q_ids.to(device).expand(B, L)  # (B, L)
        kv_ids = q_ids if self.kv_ids is None else self.kv_ids.to(device).expand(B, S)  # (B, S)
        return lambda b, h, i, j: q_ids[b, i] == kv_ids[b, j]

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        q_ids = self.q_ids.to(first.device)  # (B|1, L)
        kv_ids = q_ids if self.kv_ids is None else self.kv_ids.to(first.device)  # (B|1, S)
        sorted_ids = bool((q_ids[:, 1:] >= q_ids[:, :-1]).all()) and bool(
            (kv_ids[:, 1:] >= kv_ids[:, :-1]).all()
        )
        if not sorted_ids:  # documents are not contiguous runs: no tight span
            return super().key_bounds(B, L, S, first, last)
        batch = max(q_ids.shape[0], kv_ids.shape[0])
        q_ids, kv_ids = q_ids.expand(batch, L), kv_ids.expand(batch, S).contiguous()
        lo = torch.searchsorted(kv_ids, q_ids[:, first].contiguous(), side="left")
        hi = torch.searchsorted(kv_ids, q_ids[:, last].contiguous(), side="right")
        return lo, hi  # (B|1, T): from the first row's document start to the last's end

    def describe(self) -> str:
        return f"document(B={self.batch_size})"


def document(ids: Tensor, kv_ids: Tensor | None = None) -> Mask:
    """Packed sequences: a query sees only keys of its own document.

    `ids` is (S,) or (B, S) integer document ids; for cross attention pass `(q_ids, kv_ids)`.
    Combine with `causal()` for packed causal language modelling.

    >>> print(document(torch.tensor([0, 0, 1, 1])).draw(4))
    ■ ■ · ·
    ■ ■ · ·
    · · ■ ■
    · · ■ ■
    >>> print((document(torch.tensor([0, 0, 1, 1])) & causal()).draw(4))
    ■ · · ·
    ■ ■ · ·
    · · ■ ·
    · · ■ ■
    """
    return _Document(ids, kv_ids)


class _PrefixLM(Mask):
    def __init__(self, prefix_len: int | Tensor, align: str | None) -> None:
        if isinstance(prefix_len, Tensor):
            if prefix_len.is_floating_point() or prefix_len.dim() != 1:
                raise MaskError(
                    f"prefix_lm takes an int or (B,) integer lengths, got dtype "
                    f"{prefix_len.dtype} and shape {tuple(prefix_len.shape)}."
                )
            if (prefix_len < 0).any():
                raise MaskError(f"prefix_lm lengths must be >= 0, got {prefix_len.tolist()}.")
        else:
            _check_int("prefix_len", prefix_len)
        _check_align(align)
        self.prefix_len = prefix_len
        self.align = align

    @property
    def batch_size(self) -> int | None:
        return self.prefix_len.shape[0] if isinstance(self.prefix_len, Tensor) else None

    def check(self, B: int, H: int, L: int, S: int) -> None:
        causal_offset(self.align, L, S, who="prefix_lm")
        if isinstance(self.prefix_len, Tensor):
            _check_batch("prefix_lm lengths", self.prefix_len.shape[0], B)

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        offset = causal_offset(self.align, L, S, who="prefix_lm")
        n = self.prefix_len
        if isinstance(n, Tensor):
            prefix = n.to(device).expand(B)  # (B,)
            return lambda b, h, i, j: (j < prefix[b]) | (j <= i + offset)
        return lambda b, h, i, j: (j < n) | (j <= i + offset)

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        offset = causal_offset(self.align, L, S, who="prefix_lm")
        n = self.prefix_len
        prefix = n.to(first.device).view(-1, 1) if isinstance(n, Tensor) else torch.tensor([[n]])
        hi = torch.maximum(prefix.to(first.device), (last + offset + 1)[None]).clamp(0, S)
        return torch.zeros_like(hi), hi

    def describe(self) -> str:
        n = self.prefix_len
        return f"prefix_lm({n if isinstance(n, int) else f'lengths, B={n.shape[0]}'})"


def prefix_lm(prefix_len: int | Tensor, align: Align | None = None) -> Mask:
    """Prefix-LM: every query sees the first `prefix_len` keys, and the rest causally.

    `prefix_len` is an int or (B,) lengths; alignment as in `causal`.

    >>> print(prefix_lm(2).draw(4))
    ■ ■ · ·
    ■ ■ · ·
    ■ ■ ■ ·
    ■ ■ ■ ■
    """
    return _PrefixLM(prefix_len, align)


class _TensorMask(Mask):
    def __init__(self, tensor: Tensor) -> None:
        if tensor.dim() > 4:
            check_broadcastable("mask", tuple(tensor.shape), (0, 0, 0, 0))
        self.tensor = tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))

    @property
    def batch_size(self) -> int | None:
        return self.tensor.shape[0]

    def check(self, B: int, H: int, L: int, S: int) -> None:
        check_broadcastable("mask", tuple(self.tensor.shape), (B, H, L, S))

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        t = self.tensor.to(device)  # (B|1, H|1, L|1, S|1)
        zero = torch.zeros((), dtype=torch.long, device=device)

        def pick(idx: Tensor, size: int) -> Tensor:
            return idx if size > 1 else zero

        return lambda b, h, i, j: t[
            pick(b, t.shape[0]), pick(h, t.shape[1]), pick(i, t.shape[2]), pick(j, t.shape[3])
        ]

    @property
    def head_dependent(self) -> bool:
        return self.tensor.shape[1] > 1

    def describe(self) -> str:
        return f"tensor{tuple(self.tensor.shape)}"


class _Combine(Mask):
    def __init__(self, op: str, parts: tuple[Mask, ...]) -> None:
        self.op = op
        self.parts = parts

    @property
    def batch_size(self) -> int | None:
        return _batch_of(*(p.batch_size for p in self.parts))

    def check(self, B: int, H: int, L: int, S: int) -> None:
        for part in self.parts:
            part.check(B, H, L, S)

    @property
    def head_dependent(self) -> bool:
        return any(p.head_dependent for p in self.parts)

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        bounds = [p.key_bounds(B, L, S, first, last) for p in self.parts]
        lo, hi = bounds[0]
        for part_lo, part_hi in bounds[1:]:  # & intersects the spans, | takes their hull
            if self.op == "&":
                lo, hi = torch.maximum(lo, part_lo), torch.minimum(hi, part_hi)
            else:
                lo, hi = torch.minimum(lo, part_lo), torch.maximum(hi, part_hi)
        return lo, hi.clamp(min=lo) if self.op == "&" else hi

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
        self.inner = inner

    @property
    def batch_size(self) -> int | None:
        return self.inner.batch_size

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
        raise MaskError("and_masks needs at least one mask.")
    return _Combine("&", tuple(as_mask(m) for m in masks))


def or_masks(*masks: Mask | Tensor) -> Mask:
    """Keys visible under any mask (FlexAttention's `or_masks`)."""
    if not masks:
        raise MaskError("or_masks needs at least one mask.")
    return _Combine("|", tuple(as_mask(m) for m in masks))


# ----------------------------------------------------------------------------- conversions


def integer_mask_error(name: str, dtype: torch.dtype) -> MaskError:
    return MaskError(
        f"{name} has dtype {dtype}: integer masks are ambiguous (1 means 'real token' in "
        "Hugging Face but 'ignore' in other code), so attnkit refuses them. Convert "
        "explicitly: from_hf_attention_mask(m) if 1 = real token, "
        "from_key_padding_mask(m.bool()) if 1 = padding, or m.bool() if 1 = may attend."
    )


def as_mask(mask: Mask | Tensor) -> Mask:
    """A `Mask` from a `Mask` or a bool tensor (broadcastable to (B, H, L, S))."""
    if isinstance(mask, Mask):
        return mask
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a Mask or a bool tensor, got {type(mask).__name__}.")
    if mask.dtype == torch.bool:
        return _TensorMask(mask)
    if mask.is_floating_point():
        raise MaskError(
            f"mask has dtype {mask.dtype}: a float tensor is an additive bias (0 keeps, -inf "
            "removes) and cannot be combined with &, |, ~. Pass it alone as mask=, or turn "
            "it into a visibility mask with from_additive_mask(m)."
        )
    raise integer_mask_error("mask", mask.dtype)


def from_key_padding_mask(key_padding_mask: Tensor) -> Mask:
    """From `nn.MultiheadAttention`'s `key_padding_mask`: (B, S) bool, `True` = ignore."""
    if key_padding_mask.dtype != torch.bool or key_padding_mask.dim() != 2:
        raise MaskError(
            "from_key_padding_mask takes nn.MultiheadAttention's (B, S) bool mask "
            f"(True = ignore), got dtype {key_padding_mask.dtype} and shape "
            f"{tuple(key_padding_mask.shape)}."
        )
    return _KeyPadding(~key_padding_mask)


def from_hf_attention_mask(attention_mask: Tensor) -> Mask:
    """From a Hugging Face `attention_mask`: (B, S) of 1 = real token, 0 = padding."""
    if attention_mask.dim() != 2 or attention_mask.is_floating_point():
        raise MaskError(
            "from_hf_attention_mask takes a (B, S) integer or bool tensor of 1 = real token, "
            f"got dtype {attention_mask.dtype} and shape {tuple(attention_mask.shape)}."
        )
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise MaskError("from_hf_attention_mask expects only 0 and 1 values.")
    return _KeyPadding(attention_mask != 0)


def from_additive_mask(additive_mask: Tensor) -> Mask:
    """From an additive float mask whose entries are 0 (keep) or -inf (remove).

    Very negative entries (at or below the dtype's minimum, as transformers writes them)
    also count as removed. Any other value is a bias, not a mask: pass that tensor
    directly as `mask=` instead.
    """
    if not additive_mask.is_floating_point():
        raise MaskError(
            f"from_additive_mask takes a float tensor, got dtype {additive_mask.dtype}."
        )
    removed = additive_mask <= torch.finfo(additive_mask.dtype).min
    if not ((additive_mask == 0) | removed).all():
        raise MaskError(
            "from_additive_mask: the mask holds values other than 0 and -inf, so it is a "
            "bias, not a visibility mask; pass the float tensor itself as mask= to add it."
        )
    return _TensorMask(~removed)
