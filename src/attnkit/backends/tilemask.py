"""Which keys the rows of each tiled block see: the op's additive masks, block by block.

From the mask's exact spans where it has them (two (B, L) tensors: each block's local
interval per row, examined once per group: fully visible, one band shared by every
block, or per block), else from its predicate on the block's rows and keys; a
structured bias (`alibi`) is evaluated on the block too. Also the rows and keys
anybody sees where the mask has no exact spans, block by block (`visibility.seen`
keeps them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnkit.backends.tileplan import BlockGroup, TilePlan
from attnkit.masks import Mask
from attnkit.masks.spans import exact_spans

__all__ = ["Dims", "Visibility"]

Dims = tuple[int, int, int, int]  # B, H, L, S


class Visibility:
    """Which keys the rows of each block see: from per-row spans, or from the predicate."""

    def __init__(self, mask: Mask | None, dims: Dims, device: torch.device) -> None:
        B, H, L, S = dims
        self.dims, self.device = dims, device
        self.spans: tuple[Tensor, Tensor] | None = None
        if mask is None:
            zeros = torch.zeros(B, L, dtype=torch.long, device=device)
            self.spans = zeros, zeros + S
        elif (spans := exact_spans(mask, B, L, S, device)) is not None:
            self.spans = spans[0].expand(B, L), spans[1].expand(B, L)  # (B, L)
        else:
            self.predicate = mask.predicate(B, H, L, S, device)
        self.bias = None if mask is None else mask.bias(B, H, L, S, device)
        self._masks: dict[
            tuple[BlockGroup, int, torch.dtype], Callable[[BlockGroup], Tensor | None]
        ] = {}

    def _predicate_block(self, g: BlockGroup) -> Tensor:
        """(n, R, K) visibility by the predicate."""
        L, dev = self.dims[2], self.device
        rows, keys = g.index("rows").to(dev), g.index("keys").to(dev)
        b = torch.tensor(g.batch, device=dev)
        h = torch.zeros((), dtype=torch.long, device=dev)
        visible = self.predicate(b, h, rows.clamp(max=L - 1)[:, :, None], keys[:, None, :])
        # a predicate may return less than the index shape (a tensor mask broadcast over
        # keys or rows): expand it, since masks and seen keys below need every pair
        return ((rows < L)[:, :, None] & visible).expand(g.size, g.rows, g.keys)

    def masks(
        self, group: BlockGroup, G: int, dtype: torch.dtype
    ) -> Callable[[BlockGroup], Tensor | None]:
        """The op's additive mask for each chunk of `group`, visibility plus any bias.

        None for causal runs: the op's `is_causal` is their mask (they carry no bias).
        Remembered per group: a visibility object lives as long as its plan.
        """
        key = (group, G, dtype)
        if key not in self._masks:
            self._masks[key] = self._chunk_masks(group, G, dtype)
        return self._masks[key]

    def _chunk_masks(
        self, group: BlockGroup, G: int, dtype: torch.dtype
    ) -> Callable[[BlockGroup], Tensor | None]:
        if group.causal:
            return lambda g: None
        visibility = self._visibility(group, G, dtype)
        if self.bias is None:
            return visibility

        def with_bias(g: BlockGroup) -> Tensor:
            bias = self._bias_block(g, G).to(dtype)  # (n, Hkv, G·R, K)
            hidden = visibility(g)
            return bias if hidden is None else bias + hidden

        return with_bias

    def _bias_block(self, g: BlockGroup, G: int) -> Tensor:
        """(n, Hkv, G·R, K) structured bias of the blocks, head h = kv·G + g as in GQA."""
        assert self.bias is not None
        _, H, L, _ = self.dims
        n, R, K, dev = g.size, g.rows, g.keys, self.device
        i = g.index("rows").clamp(max=L - 1).to(dev).view(n, 1, 1, R, 1)
        j = g.index("keys").to(dev).view(n, 1, 1, 1, K)
        h = torch.arange(H, device=dev).view(1, H // G, G, 1, 1)
        value = self.bias(torch.tensor(g.batch, device=dev), h, i, j)
        return value.expand(n, H // G, G, R, K).reshape(n, H // G, G * R, K)

    def _visibility(
        self, group: BlockGroup, G: int, dtype: torch.dtype
    ) -> Callable[[BlockGroup], Tensor | None]:
        """The op's additive visibility mask for each chunk of `group`: (n|1, 1, G·R, K).

        With spans the group is examined once: fully visible (no mask), one pattern shared
        by every block (a sliding band: built once), or per block from (n, R) local spans.
        """
        if self.spans is None:
            return lambda g: _additive(_shared_or_all(self._predicate_block(g)), G, dtype)
        L, dev = self.dims[2], self.device
        rows = group.index("rows").to(dev)  # (n, R)
        valid, rows = rows < L, rows.clamp(max=L - 1)
        key0 = torch.tensor(group.key0, device=dev)[:, None]
        lo = torch.where(valid, self.spans[0][group.batch, rows] - key0, group.keys)  # local
        hi = torch.where(valid, self.spans[1][group.batch, rows] - key0, 0)
        if bool((lo <= 0).all()) and bool((hi >= group.keys).all()):
            return lambda g: None
        keys = torch.arange(group.keys, device=dev)
        if bool((lo == lo[:1]).all()) and bool((hi == hi[:1]).all()):
            shared = _additive((keys >= lo[:1, :, None]) & (keys < hi[:1, :, None]), G, dtype)
            return lambda g: shared
        first = {r0: i for i, r0 in enumerate(group.row0)}

        def chunk(g: BlockGroup) -> Tensor | None:
            i = first[g.row0[0]]
            part_lo, part_hi = lo[i : i + g.size, :, None], hi[i : i + g.size, :, None]
            return _additive((keys >= part_lo) & (keys < part_hi), G, dtype)

        return chunk

    def find_seen(
        self, plan: TilePlan, chunk: Callable[[BlockGroup], int]
    ) -> tuple[Tensor, Tensor]:
        """(B, 1, L) rows that see some key and (B, 1, S) keys that some row sees, by the
        predicate on the plan's blocks alone (`chunk`: blocks per evaluation), for a mask
        without exact spans; `visibility.seen` keeps them."""
        B, _, L, S = self.dims
        seen_rows = torch.zeros(B, L, dtype=torch.bool, device=self.device)
        seen_keys = torch.zeros(B, S, dtype=torch.bool, device=self.device)
        for group in plan.groups:
            for g in group.chunks(chunk(group)):
                visible = self._predicate_block(g)  # (n, R, K)
                rows = g.index("rows").clamp(max=L - 1).to(self.device)
                seen_rows[g.batch, rows[visible.any(-1)]] = True
                seen_keys[g.batch, g.index("keys").to(self.device)[visible.any(-2)]] = True
        return seen_rows[:, None], seen_keys[:, None]


def _shared_or_all(visible: Tensor) -> Tensor | None:
    """None if every pair is visible; one (1, R, K) pattern if all blocks agree."""
    if bool(visible.all()):
        return None
    return visible[:1] if bool((visible == visible[:1]).all()) else visible


def _additive(visible: Tensor | None, G: int, dtype: torch.dtype) -> Tensor | None:
    """(n|1, R, K) bool -> the op's additive mask (n|1, 1, G·R, K), rows repeated per head."""
    if visible is None:
        return None
    additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    additive.masked_fill_(~visible, -torch.inf)
    n, K = visible.shape[0], visible.shape[-1]
    return additive[:, None].expand(-1, G, -1, -1).reshape(n, 1, -1, K)
