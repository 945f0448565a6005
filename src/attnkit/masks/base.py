"""The `Mask` protocol: a visibility rule over `(b, h, i, j)`, and its algebra (`&`, `|`, `~`).

A kind writes its `predicate`, `key_spans`, `describe` (and `bias`, `check`, ... where
it has them); the rest derives from those in `structure.py`. The kinds `&`, `|` and `~`
make live in `algebra.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from attnkit.errors import MaskError
from attnkit.masks.checks import integer_mask_error, not_a_mask_error
from attnkit.masks.spans import Spans

__all__ = ["Align", "BiasFn", "Mask", "Predicate", "and_masks", "as_mask", "or_masks"]

Align = Literal["top_left", "bottom_right"]
# (b, h, i, j) index tensors, broadcastable to (B, H, L, S) -> bool tensor
Predicate = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
# (b, h, i, j) index tensors -> float tensor added to the scores
BiasFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

ALLOWED, HIDDEN = "■", "·"


class Mask:
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

    # bool tensor, mask_mod, &, |, ~ -> Mask: `tensor.py` and `algebra.py` fill it, so
    # this module imports no kind
    _wrappers: ClassVar[dict[str, Callable[..., Mask]]] = {}

    def __init__(self) -> None:
        """Masks are made by constructors (`causal`, `key_padding`, ...), not `Mask()`."""

    # ------------------------------------------------------------ what a kind writes

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        """The rule for a (B, H, L, S) problem, as a function of broadcast index tensors."""
        raise NotImplementedError

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        """Each query row's interval of keys `[lo, hi)`, from the structure alone.

        Backends skip the keys outside a row's interval; no L×S tensor is built.

        Args:
            B: batch size of the call.
            L: query length.
            S: key length.
            device: where `lo` and `hi` are made (default None: the CPU).

        Returns:
            `Spans(lo, hi, exact)`, `lo` and `hi` (B|1, L|1) int64 tensors, or None where
            the mask has no such structure. `exact` spans describe the mask completely
            (causal, windows, sorted documents, prefix-LM, lengths, their `&`); others
            are a superset (keys outside are hidden; backends mask inside them exactly).

        Examples:
            >>> spans = ak.sliding_window(1).key_spans(1, 4, 4)
            >>> spans.lo.flatten().tolist(), spans.hi.flatten().tolist(), spans.exact
            ([0, 0, 1, 2], [1, 2, 3, 4], True)
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
        """True if every query row may see every key (no mask needed), as bottom-right causal
        at L = 1; False where unsure. O(1) for the kinds over positions."""
        spans = None if self.tensors() else self.key_spans(1, L, S)
        if spans is None or not spans.exact:
            return False
        return bool((spans.lo == 0).all() and (spans.hi == S).all())

    def _sdpa_causal(self, L: int, S: int) -> bool | None:
        """`structure.is_sdpa_causal` in O(1) where a kind knows it (None: derive it)."""
        return None

    # ------------------------------------------------------------ what every mask has

    def _fields(self) -> dict[str, object]:
        """The public attributes: the value (a `_name` is a kind's memo, never part of it)."""
        return {name: value for name, value in vars(self).items() if name[0] != "_"}

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor this mask holds, its parts' included (the same for its whole life)."""
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
        """The smallest bool tensor broadcastable to (B, H, L, S); `rows` / `cols` restrict
        the query / key positions (the last two dims then have their lengths)."""
        self.check(B, H, L, S)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        b, h, i, j = indices(B, H, L, S, dev, rows, cols)
        allowed = self.predicate(B, H, L, S, dev)(b, h, i, j)
        return allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))

    def materialize(
        self, B: int, H: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Tensor:
        """The mask as a bool tensor, `True` = may attend.

        Args:
            B: batch size.
            H: query heads.
            L: query length.
            S: key length.
            device: where the tensor is made (default None: the CPU).

        Returns:
            (B, H, L, S) bool tensor, a broadcast view of the smallest tensor that holds
            the mask (copy it before writing to it).

        Raises:
            ShapeContractError: sizes the mask cannot serve (a `key_padding` of another
                batch, a causal mask with L != S and no alignment).

        Examples:
            >>> ak.causal().materialize(2, 4, 3, 3).shape
            torch.Size([2, 4, 3, 3])
        """
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
        """FlexAttention's `BlockMask` of this mask, to feed `flex_attention` (on a GPU too).

        The same present and full blocks as `create_block_mask`, from exact key spans in
        O(blocks), else evaluated in row chunks; its `mask_mod` is the predicate (a bias
        such as `alibi` is not: pass it to `flex_attention` as a score_mod).

        Args:
            B: batch size, or None: the mask's own batch (a `key_padding`'s), else 1.
            H: query heads, or None: the mask's own head count, else 1.
            L: query length.
            S: key length.
            block_size: keyword-only, rows and keys a block (default 128, flex's).
            device: keyword-only, where the block mask is made (default None: the CPU).

        Returns:
            A `torch.nn.attention.flex_attention.BlockMask` for (B, H, L, S).

        Examples:
            >>> blocks = ak.causal().to_block_mask(1, 1, 256, 256)
            >>> blocks.shape  # 2×2 blocks of 128: on the diagonal partial, below it full
            (1, 1, 256, 256)
            >>> blocks.kv_num_blocks.flatten().tolist()  # partial blocks, row by row
            [1, 1]
            >>> blocks.full_kv_num_blocks.flatten().tolist()  # full ones
            [0, 1]
        """
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

        Args:
            L: query length (rows).
            S: key length (columns; default None: L).
            batch: keyword-only, the batch row drawn (default 0).
            head: keyword-only, the head drawn (default 0).
            cells: keyword-only, at most this many characters a side (default None: one
                a pair); where L or S is larger, a character stands for a block of
                pairs: ■ every pair may attend, ▪ some, · none.

        Returns:
            L lines (or `cells`) of characters separated by spaces, for `print`.

        Raises:
            ShapeContractError: sizes the mask cannot serve, as `materialize`.

        Examples:
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
        return Mask._wrappers["combine"]("&", (self, as_mask(other)))

    def __rand__(self, other: Tensor) -> Mask:
        return Mask._wrappers["combine"]("&", (as_mask(other), self))

    def __or__(self, other: Mask | Tensor) -> Mask:
        return Mask._wrappers["combine"]("|", (self, as_mask(other)))

    def __ror__(self, other: Tensor) -> Mask:
        return Mask._wrappers["combine"]("|", (as_mask(other), self))

    def __invert__(self) -> Mask:
        return Mask._wrappers["not_"](self)


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
        return Mask._wrappers["tensor"](mask)
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
    return Mask._wrappers["combine"]("&", tuple(as_mask(m) for m in masks))


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
    return Mask._wrappers["combine"]("|", tuple(as_mask(m) for m in masks))
