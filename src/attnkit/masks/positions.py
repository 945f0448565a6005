"""The kinds of mask over positions: causal, sliding window, chunked, prefix-LM.

Each constructor draws its matrix (■ may attend, · hidden) and states its alignment.
Conventions (the Design page, §2): causal alignment `top_left` is `j <= i`, `bottom_right` is
`j <= i + (S - L)`; they agree when L == S and must be chosen when L != S, attnkit never
guesses; `offset=n` (`j <= i + n`) places the queries anywhere else (a static cache).
`sliding_window(left, right)` is inclusive: a query sees `left + 1 + right` keys.
Each row sees one interval of keys, so their spans are exact, and `sees_all` is O(1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.errors import MaskError
from attnkit.masks.base import Align, Mask, Predicate
from attnkit.masks.checks import (
    causal_offset,
    check_align,
    check_batch,
    check_count,
    check_offset,
)
from attnkit.masks.spans import Spans

__all__ = ["causal", "chunked", "prefix_lm", "sliding_window"]


class _Positional(Mask):
    """A mask over positions whose queries sit at `i + shift` among the keys: the shift
    is 0 (top_left), S - L (bottom_right) or an explicit offset; with L != S and neither
    given it raises (attnkit never guesses)."""

    constructor = "causal"
    align: str | None
    offset: int | None

    def _place(self, align: str | None, offset: int | None) -> None:
        check_align(align)
        self.offset = check_offset(align, offset)
        self.align = align

    def shift(self, L: int, S: int) -> int:
        return causal_offset(self.align, L, S, constructor=self.constructor, offset=self.offset)

    def check(self, B: int, H: int, L: int, S: int) -> None:
        self.shift(L, S)

    def _sdpa_causal(self, L: int, S: int) -> bool | None:
        return False  # a window, a chunk or a prefix: not SDPA's causal mask (O(1))

    def _spans(self, lo: Tensor, hi: Tensor, S: int) -> Spans:
        """Exact spans (1|B, L) from each row's bounds, clipped to the S keys."""
        lo = lo.clamp(0, S)
        return Spans(lo, hi.clamp(0, S).clamp(min=lo), exact=True)

    @staticmethod
    def _rows(L: int, device: torch.device | str | None) -> Tensor:
        return torch.arange(L, device=device or "cpu")[None]  # (1, L)

    def _placement(self) -> str:
        """`, align=...` / `, offset=...` for `describe` (empty when neither was given)."""
        if self.offset is not None:
            return f", offset={self.offset}"
        return "" if self.align is None else f", align={self.align!r}"


class _Causal(_Positional):
    def __init__(self, align: str | None, offset: int | None = None) -> None:
        self._place(align, offset)

    def _sdpa_causal(self, L: int, S: int) -> bool | None:
        return L >= S and self.shift(L, S) == 0

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        hi = self._rows(L, device) + self.shift(L, S) + 1
        return self._spans(torch.zeros_like(hi), hi, S)

    def sees_all(self, L: int, S: int) -> bool:
        return self.shift(L, S) >= S - 1  # row 0 sees the last key

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        offset = self.shift(L, S)
        return lambda b, h, i, j: j <= i + offset

    def describe(self) -> str:
        return f"causal({self._placement().removeprefix(', ')})"


def causal(align: Align | None = None, *, offset: int | None = None) -> Mask:
    """Query `i` may attend to keys up to its own (aligned) position.

    With L == S both alignments agree and `align` may be left out; with L != S it must
    be given: attnkit never guesses ([Design §2][2-semantics-that-never-change]).

    Args:
        align: `"top_left"`: key `j` visible to query `i` iff `j <= i` (SDPA's
            `is_causal`); `"bottom_right"`: iff `j <= i + (S - L)` (flash-attention's
            convention, the one for KV-cache decoding). Default None: only for L == S.
        offset: keyword-only int `n`: key `j` visible iff `j <= i + n`, for any L and
            S (a static cache's prefill: the queries start at position `n` among S
            slots; a negative `n` hides the first rows' keys). Default None; exclusive
            with `align`.

    Returns:
        A `Mask` holding no tensors: it fits any (B, H, L, S) and combines with `&`,
        `|`, `~`.

    Raises:
        MaskError: `align` is neither alignment, or both `align` and `offset` are given.
        TypeError: `offset` is not an int.
        ShapeContractError: when the mask meets a call (or `draw`) with L != S and
            neither `align` nor `offset`.

    Examples:
        >>> import attnkit as ak
        >>> print(ak.causal().draw(4))
        ■ · · ·
        ■ ■ · ·
        ■ ■ ■ ·
        ■ ■ ■ ■
        >>> print(ak.causal(align="bottom_right").draw(2, 4))  # 2 new queries, 4 keys
        ■ ■ ■ ·
        ■ ■ ■ ■
        >>> print(ak.causal(align="top_left").draw(2, 4))
        ■ · · ·
        ■ ■ · ·
        >>> print(ak.causal(offset=1).draw(2, 4))
        ■ ■ · ·
        ■ ■ ■ ·
        >>> ak.causal().draw(2, 4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        attnkit.errors.ShapeContractError: causal mask with L=2 queries and S=4 keys: ...
    """
    return _Causal(align, offset)


class _SlidingWindow(_Positional):
    constructor = "sliding_window"

    def __init__(self, left: int, right: int, align: str | None, offset: int | None) -> None:
        self.left = check_count("left", left)
        self.right = check_count("right", right)
        self._place(align, offset)

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        offset, left, right = self.shift(L, S), self.left, self.right
        return lambda b, h, i, j: (j >= i + offset - left) & (j <= i + offset + right)

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        at = self._rows(L, device) + self.shift(L, S)  # (1, L): each row's aligned position
        return self._spans(at - self.left, at + self.right + 1, S)

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

    A window holds `left + 1 + right` keys (flash-attention's `window_size=(left,
    right)`; transformers' `sliding_window=W` is `left = W - 1`).

    Args:
        left: int >= 0, keys before the query's own position it may see.
        right: int >= 0, keys after it (default 0: a causal window).
        align: `"top_left"` or `"bottom_right"`, as in `causal` (default None: only for
            L == S).
        offset: keyword-only int, `i' = i + offset`, as in `causal` (default None).

    Returns:
        A `Mask` holding no tensors; each row sees one interval of keys.

    Raises:
        MaskError: `left` or `right` negative, an unknown `align`, or both `align` and
            `offset`.
        TypeError: `left`, `right` or `offset` not an int.

    Examples:
        >>> import attnkit as ak
        >>> print(ak.sliding_window(1).draw(4))
        ■ · · ·
        ■ ■ · ·
        · ■ ■ ·
        · · ■ ■
        >>> print(ak.sliding_window(1, 1).draw(4))
        ■ ■ · ·
        ■ ■ ■ ·
        · ■ ■ ■
        · · ■ ■
    """
    return _SlidingWindow(left, right, align, offset)


class _Chunked(_Positional):
    constructor = "chunked"

    def __init__(self, size: int, align: str | None, offset: int | None) -> None:
        self.size = check_count("size", size, minimum=1)
        self._place(align, offset)

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        offset, size = self.shift(L, S), self.size
        return lambda b, h, i, j: torch.div(i + offset, size, rounding_mode="floor") == (j // size)

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        at = self._rows(L, device) + self.shift(L, S)
        lo = torch.div(at, self.size, rounding_mode="floor") * self.size  # its chunk's start
        return self._spans(lo, lo + self.size, S)

    def sees_all(self, L: int, S: int) -> bool:
        offset = self.shift(L, S)  # every query in chunk 0, and chunk 0 holds every key
        return offset >= 0 and L - 1 + offset < self.size and S <= self.size

    def describe(self) -> str:
        return f"chunked({self.size}{self._placement()})"


def chunked(size: int, align: Align | None = None, *, offset: int | None = None) -> Mask:
    """Chunked attention: query `i` sees the keys of its own chunk of `size` positions,
    `j // size == i' // size` (`i'` its aligned position, as in `causal`).

    Args:
        size: int >= 1, positions per chunk.
        align: `"top_left"` or `"bottom_right"`, as in `causal` (default None: only for
            L == S).
        offset: keyword-only int, `i' = i + offset`, as in `causal` (default None).

    Returns:
        A `Mask` holding no tensors. `& causal()` gives chunked causal attention
        (Llama 4's local layers).

    Raises:
        MaskError: `size` < 1, an unknown `align`, or both `align` and `offset`.
        TypeError: `size` or `offset` not an int.

    Examples:
        >>> import attnkit as ak
        >>> print(ak.chunked(2).draw(4))
        ■ ■ · ·
        ■ ■ · ·
        · · ■ ■
        · · ■ ■
        >>> print((ak.chunked(2) & ak.causal()).draw(4))
        ■ · · ·
        ■ ■ · ·
        · · ■ ·
        · · ■ ■
    """
    return _Chunked(size, align, offset)


class _PrefixLM(_Positional):
    constructor = "prefix_lm"

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
            check_count("prefix_len", prefix_len)
        self._place(align, offset)
        self.prefix_len = prefix_len

    @property
    def batch_size(self) -> int | None:
        return self.prefix_len.shape[0] if isinstance(self.prefix_len, Tensor) else None

    def check(self, B: int, H: int, L: int, S: int) -> None:
        self.shift(L, S)
        if isinstance(self.prefix_len, Tensor):
            check_batch("prefix_lm lengths", self.prefix_len.shape[0], B)

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        offset = self.shift(L, S)
        n = self.prefix_len
        if isinstance(n, Tensor):
            prefix = n.to(device).expand(B).contiguous()  # (B,), compact as key_padding's
            return lambda b, h, i, j: (j < prefix[b]) | (j <= i + offset)
        return lambda b, h, i, j: (j < n) | (j <= i + offset)

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        n = self.prefix_len
        prefix = n.to(device or "cpu").view(-1, 1) if isinstance(n, Tensor) else n  # (B, 1)
        hi = torch.maximum(self._rows(L, device) + self.shift(L, S) + 1, torch.as_tensor(prefix))
        return self._spans(torch.zeros_like(hi), hi, S)  # (B|1, L)

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

    Args:
        prefix_len: int >= 0, or a (B,) integer tensor of one length per batch row.
        align: `"top_left"` or `"bottom_right"` for the causal part, as in `causal`
            (default None: only for L == S).
        offset: keyword-only int, as in `causal` (default None).

    Returns:
        A `Mask`; with (B,) lengths it serves calls of batch B (or 1).

    Raises:
        MaskError: a negative length, or lengths not a (B,) integer tensor.

    Examples:
        >>> import attnkit as ak
        >>> print(ak.prefix_lm(2).draw(4))
        ■ ■ · ·
        ■ ■ · ·
        ■ ■ ■ ·
        ■ ■ ■ ■
        >>> print(ak.prefix_lm(torch.tensor([0, 3])).draw(4, batch=1))  # row 1: 3
        ■ ■ ■ ·
        ■ ■ ■ ·
        ■ ■ ■ ·
        ■ ■ ■ ■
    """
    return _PrefixLM(prefix_len, align, offset)
