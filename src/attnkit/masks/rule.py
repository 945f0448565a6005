"""What a mask is below its algebra: the rule over `(b, h, i, j)` a kind writes
(`predicate`, `key_spans`, `describe`, and `bias`, `check`, ... where it has them) and
what every mask derives from it (`dense`, `materialize`, `draw`, `to_block_mask`; the
rest in `structure.py`). `Mask` (`base.py`) adds the algebra (`&`, `|`, `~`) and the
kinds it makes; every mask is a `MaskRule`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from attnkit.masks.spans import Spans

__all__ = ["Align", "BiasFn", "MaskRule", "Predicate", "indices"]

Align = Literal["top_left", "bottom_right"]
# (b, h, i, j) index tensors, broadcastable to (B, H, L, S) -> bool tensor
Predicate = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
# (b, h, i, j) index tensors -> float tensor added to the scores
BiasFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

ALLOWED, HIDDEN = "■", "·"


class MaskRule:
    """The rule half of `Mask`: what a kind writes, and what every mask derives from it."""

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
                elif isinstance(item, MaskRule):
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

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        return f"Mask[{self.describe()}]"

    def _repr_html_(self) -> str:
        """What a notebook shows: the description and a drawing (`masks.picture`)."""
        from attnkit.masks.picture import mask_html

        return mask_html(self)


def indices(
    B: int, H: int, L: int, S: int, dev: torch.device, rows: Tensor | None, cols: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcast (b, h, i, j) index tensors over (B, H, L|R, S|C)."""
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1)
    i = (torch.arange(L, device=dev) if rows is None else rows.to(dev)).view(1, 1, -1, 1)
    j = (torch.arange(S, device=dev) if cols is None else cols.to(dev)).view(1, 1, 1, -1)
    return b, h, i, j
