"""The kinds of mask: causal, sliding window, chunked, key padding, documents, prefix-LM.

Each constructor draws its matrix (■ may attend, · hidden) and states its alignment.
Conventions (DESIGN.md §2): causal alignment `top_left` is `j <= i`, `bottom_right` is
`j <= i + (S - L)`; they agree when L == S and must be chosen when L != S, attnkit never
guesses; `offset=n` (`j <= i + n`) places the queries anywhere else (a static cache).
`sliding_window(left, right)` is inclusive: a query sees `left + 1 + right` keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.errors import MaskError, ShapeContractError
from attnkit.masks.base import (
    Align,
    Mask,
    Predicate,
    _batch_of,
    _check_align,
    _check_batch,
    _check_int,
    _check_offset,
    causal_offset,
)

__all__ = [
    "causal",
    "chunked",
    "document",
    "key_padding",
    "prefix_lm",
    "row_spans",
    "sliding_window",
]


class _Positional(Mask):
    """A mask over positions whose queries sit at `i + shift` among the keys: the shift
    is 0 (top_left), S - L (bottom_right) or an explicit offset; with L != S and neither
    given it raises (attnkit never guesses)."""

    who = "causal"
    align: str | None
    offset: int | None

    def _place(self, align: str | None, offset: int | None) -> None:
        _check_align(align)
        self.offset = _check_offset(align, offset)
        self.align = align

    def shift(self, L: int, S: int) -> int:
        return causal_offset(self.align, L, S, who=self.who, offset=self.offset)

    def check(self, B: int, H: int, L: int, S: int) -> None:
        self.shift(L, S)

    def _placement(self) -> str:
        """`, align=...` / `, offset=...` for `describe` (empty when neither was given)."""
        if self.offset is not None:
            return f", offset={self.offset}"
        return "" if self.align is None else f", align={self.align!r}"


class _Causal(_Positional):
    def __init__(self, align: str | None, offset: int | None = None) -> None:
        self._place(align, offset)

    def is_sdpa_causal(self, L: int, S: int) -> bool:
        return L >= S and self.shift(L, S) == 0

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        hi = (last + self.shift(L, S) + 1).clamp(0, S)[None]
        return torch.zeros_like(hi), hi

    def exact_spans(self, B: int, L: int, S: int) -> bool:
        return True

    def sees_all(self, L: int, S: int) -> bool:
        return self.shift(L, S) >= S - 1  # row 0 sees the last key

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        offset = self.shift(L, S)
        return lambda b, h, i, j: j <= i + offset

    def describe(self) -> str:
        return f"causal({self._placement().removeprefix(', ')})"


def causal(align: Align | None = None, *, offset: int | None = None) -> Mask:
    """Query `i` may attend to keys up to its own (aligned) position.

    `top_left`: `j <= i`; `bottom_right`: `j <= i + (S - L)`. With L == S both agree and
    `align` may be left out; with L != S it must be given (see DESIGN.md §2). `offset=n`
    instead: `j <= i + n` for any L and S (a static cache's prefill: the queries start at
    position n among S cache slots; a negative n hides the first rows' keys entirely).

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
    >>> print(causal(offset=1).draw(2, 4))
    ■ ■ · ·
    ■ ■ ■ ·
    """
    return _Causal(align, offset)


class _SlidingWindow(_Positional):
    who = "sliding_window"

    def __init__(self, left: int, right: int, align: str | None, offset: int | None) -> None:
        self.left = _check_int("left", left)
        self.right = _check_int("right", right)
        self._place(align, offset)

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        offset, left, right = self.shift(L, S), self.left, self.right
        return lambda b, h, i, j: (j >= i + offset - left) & (j <= i + offset + right)

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        offset = self.shift(L, S)
        lo = (first + offset - self.left).clamp(0, S)
        return lo[None], (last + offset + self.right + 1).clamp(0, S)[None]

    def exact_spans(self, B: int, L: int, S: int) -> bool:
        return True

    def sees_all(self, L: int, S: int) -> bool:
        offset = self.shift(L, S)
        # the last row still sees key 0, the first row already sees key S - 1
        return L - 1 + offset - self.left <= 0 and offset + self.right >= S - 1

    def describe(self) -> str:
        return f"sliding_window(left={self.left}, right={self.right}{self._placement()})"


def sliding_window(
    left: int, right: int = 0, align: Align | None = None, *, offset: int | None = None
) -> Mask:
    """Query `i` sees keys `[i' - left, i' + right]`, `i'` its aligned position (inclusive).

    A window holds `left + 1 + right` keys (flash-attention's `window_size=(left, right)`;
    transformers' `sliding_window=W` is `left = W - 1`). Alignment and `offset` (`i' = i +
    offset`) as in `causal`.

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
    return _SlidingWindow(left, right, align, offset)


class _Chunked(_Positional):
    who = "chunked"

    def __init__(self, size: int, align: str | None, offset: int | None) -> None:
        self.size = _check_int("size", size, minimum=1)
        self._place(align, offset)

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        offset, size = self.shift(L, S), self.size
        return lambda b, h, i, j: torch.div(i + offset, size, rounding_mode="floor") == (j // size)

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        offset, size = self.shift(L, S), self.size
        lo = torch.div(first + offset, size, rounding_mode="floor") * size
        hi = (torch.div(last + offset, size, rounding_mode="floor") + 1) * size
        return lo.clamp(0, S)[None], hi.clamp(0, S)[None]

    def exact_spans(self, B: int, L: int, S: int) -> bool:
        return True

    def sees_all(self, L: int, S: int) -> bool:
        offset = self.shift(L, S)  # every query in chunk 0, and chunk 0 holds every key
        return offset >= 0 and L - 1 + offset < self.size and S <= self.size

    def describe(self) -> str:
        return f"chunked({self.size}{self._placement()})"


def chunked(size: int, align: Align | None = None, *, offset: int | None = None) -> Mask:
    """Chunked attention: query `i` sees the keys of its own chunk of `size` positions,
    `j // size == i' // size` (`i'` its aligned position, as in `causal`).

    Combine with `causal()` for chunked causal attention (Llama 4's local layers):

    >>> print(chunked(2).draw(4))
    ■ ■ · ·
    ■ ■ · ·
    · · ■ ■
    · · ■ ■
    >>> print((chunked(2) & causal()).draw(4))
    ■ · · ·
    ■ ■ · ·
    · · ■ ·
    · · ■ ■
    """
    return _Chunked(size, align, offset)


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
                raise MaskError(
                    f"key_padding lengths must be >= 0 (real keys per batch row), got "
                    f"{valid.tolist()}."
                )
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
            # compact copies: FlexAttention's compiler cannot lower a captured stride-0
            # view (an InductorError on lengths of one row broadcast over the batch)
            lengths = valid.expand(B).contiguous()  # (B,)
            return lambda b, h, i, j: j < lengths[b]
        rows = valid.expand(B, S).contiguous()  # (B, S)
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

    def exact_spans(self, B: int, L: int, S: int) -> bool:
        """Lengths always; a bool mask when each row's real tokens are one run."""
        if self.is_lengths:
            return True
        row = torch.zeros(1, dtype=torch.long)
        lo, hi = self.key_bounds(B, L, S, row, row)  # (B, 1): the first and last real token
        position = torch.arange(S)
        return bool((self.valid.cpu() == ((position >= lo) & (position < hi))).all())

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
        q_ids = self.q_ids.to(device).expand(B, L).contiguous()  # (B, L), compact as above
        kv_ids = q_ids if self.kv_ids is None else self.kv_ids.to(device).expand(B, S)
        kv_ids = kv_ids.contiguous()  # (B, S)
        return lambda b, h, i, j: q_ids[b, i] == kv_ids[b, j]

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        q_ids = self.q_ids.to(first.device)  # (B|1, L)
        kv_ids = q_ids if self.kv_ids is None else self.kv_ids.to(first.device)  # (B|1, S)
        if not self._sorted():  # documents are not contiguous runs: no tight span
            return super().key_bounds(B, L, S, first, last)
        batch = max(q_ids.shape[0], kv_ids.shape[0])
        q_ids, kv_ids = q_ids.expand(batch, L), kv_ids.expand(batch, S).contiguous()
        lo = torch.searchsorted(kv_ids, q_ids[:, first].contiguous(), side="left")
        hi = torch.searchsorted(kv_ids, q_ids[:, last].contiguous(), side="right")
        return lo, hi  # (B|1, T): from the first row's document start to the last's end

    def _sorted(self) -> bool:
        kv_ids = self.q_ids if self.kv_ids is None else self.kv_ids
        return all(bool((ids[:, 1:] >= ids[:, :-1]).all()) for ids in (self.q_ids, kv_ids))

    def exact_spans(self, B: int, L: int, S: int) -> bool:
        return self._sorted()

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


class _PrefixLM(_Positional):
    who = "prefix_lm"

    def __init__(
        self, prefix_len: int | Tensor, align: str | None, offset: int | None = None
    ) -> None:
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
        self._place(align, offset)
        self.prefix_len = prefix_len

    @property
    def batch_size(self) -> int | None:
        return self.prefix_len.shape[0] if isinstance(self.prefix_len, Tensor) else None

    def check(self, B: int, H: int, L: int, S: int) -> None:
        self.shift(L, S)
        if isinstance(self.prefix_len, Tensor):
            _check_batch("prefix_lm lengths", self.prefix_len.shape[0], B)

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        offset = self.shift(L, S)
        n = self.prefix_len
        if isinstance(n, Tensor):
            prefix = n.to(device).expand(B).contiguous()  # (B,), compact as key_padding's
            return lambda b, h, i, j: (j < prefix[b]) | (j <= i + offset)
        return lambda b, h, i, j: (j < n) | (j <= i + offset)

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        offset = self.shift(L, S)
        n = self.prefix_len
        prefix = n.to(first.device).view(-1, 1) if isinstance(n, Tensor) else torch.tensor([[n]])
        hi = torch.maximum(prefix.to(first.device), (last + offset + 1)[None]).clamp(0, S)
        return torch.zeros_like(hi), hi

    def exact_spans(self, B: int, L: int, S: int) -> bool:
        return True

    def sees_all(self, L: int, S: int) -> bool:
        n = self.prefix_len
        prefix_all = isinstance(n, int) and n >= S
        return prefix_all or self.shift(L, S) >= S - 1

    def describe(self) -> str:
        n = self.prefix_len
        size = n if isinstance(n, int) else f"lengths, B={n.shape[0]}"
        return f"prefix_lm({size}{self._placement()})"


def prefix_lm(
    prefix_len: int | Tensor, align: Align | None = None, *, offset: int | None = None
) -> Mask:
    """Prefix-LM: every query sees the first `prefix_len` keys, and the rest causally.

    `prefix_len` is an int or (B,) lengths; alignment and `offset` as in `causal`.

    >>> print(prefix_lm(2).draw(4))
    ■ ■ · ·
    ■ ■ · ·
    ■ ■ ■ ·
    ■ ■ ■ ■
    """
    return _PrefixLM(prefix_len, align, offset)


class _RowSpans(Mask):
    def __init__(self, lo: Tensor, hi: Tensor) -> None:
        for name, t in (("lo", lo), ("hi", hi)):
            if t.is_floating_point() or t.dtype == torch.bool or t.dim() not in (1, 2):
                raise MaskError(
                    f"row_spans {name} must be an integer (L,) or (B, L) tensor of key "
                    f"positions, got dtype {t.dtype} and shape {tuple(t.shape)}."
                )
        if lo.shape != hi.shape:
            raise MaskError(
                f"row_spans lo and hi need one shape, got {tuple(lo.shape)} and {tuple(hi.shape)}."
            )
        lo, hi = (t.long() if t.dim() == 2 else t.long()[None] for t in (lo, hi))
        empty = hi <= lo
        self.lo = torch.where(empty, 0, lo)  # (B|1, L); a row that sees nothing: [0, 0)
        self.hi = torch.where(empty, 0, hi)

    @property
    def batch_size(self) -> int | None:
        return self.lo.shape[0]

    def check(self, B: int, H: int, L: int, S: int) -> None:
        _check_batch("row_spans", self.lo.shape[0], B)
        if self.lo.shape[1] != L:
            raise ShapeContractError(
                f"row_spans has spans for {self.lo.shape[1]} query rows but the call has "
                f"L={L}; give one span per query row."
            )

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        lo, hi = (t.to(device).expand(B, L).contiguous() for t in (self.lo, self.hi))
        return lambda b, h, i, j: (j >= lo[b, i]) & (j < hi[b, i])

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        from attnkit.masks.intervals import range_bounds

        lo, hi = (t.to(first.device).clamp(0, S) for t in (self.lo, self.hi))
        return range_bounds(lo, hi, first, last)

    def exact_spans(self, B: int, L: int, S: int) -> bool:
        return True

    def describe(self) -> str:
        return f"row_spans(B={self.batch_size})"


def row_spans(lo: Tensor, hi: Tensor) -> Mask:
    """Query row i sees exactly the keys lo[i] <= j < hi[i]: any mask of one key interval
    per row, given as its intervals ((L,) or (B, L) integer tensors; hi <= lo: the row
    sees nothing). Packed sequences with per-sequence windows (`attnkit.varlen_attn`)
    are such a mask.

    >>> print(row_spans(torch.tensor([0, 0, 1]), torch.tensor([1, 3, 2])).draw(3))
    ■ · ·
    ■ ■ ■
    · ■ ·
    """
    return _RowSpans(lo, hi)
