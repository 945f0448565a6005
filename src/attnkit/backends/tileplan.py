"""Tile plans for the `tiled` backend: which keys each block of query rows must see.

The mask's structure (`Mask.key_bounds`) gives, for every tile of query rows and every
batch row, one span of keys `[lo, hi)` that holds all keys the tile may see; no L×S
tensor is built. Spans are rounded to `GRANULE` keys, consecutive tiles with the same span
merge into one block (up to `MAX_ROWS` rows and `MAX_PAIRS` pairs, which bound a block's
mask), and blocks of one batch row and shape form a `Group`: one kernel call, or a few in
chunks of bounded memory. The tile height is chosen per call by the cost model: short
tiles waste fewer pairs, tall tiles use the kernel better.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from attnkit import cost
from attnkit.masks import Mask

__all__ = ["GRANULE", "TILES", "Group", "TilePlan", "best_plan", "plan_tiles", "uniform_step"]

TILES = (64, 128, 256)  # query rows per tile, the candidates `best_plan` weighs
GRANULE = 64  # key spans start and end on multiples of this
MAX_ROWS = 256  # tiles with equal spans merge into blocks of at most this many rows
MAX_PAIRS = 1 << 19  # ... and at most this many pairs (a block's mask: 2 MiB in float32)
MAX_GROUPS = 24  # more distinct block widths than this get bucketed


def uniform_step(starts: tuple[int, ...]) -> int | None:
    """The step s with starts[i] = starts[0] + i·s (s >= 0), or None if there is none."""
    if len(starts) < 2:
        return 0
    step = starts[1] - starts[0]
    ok = step >= 0 and all(b - a == step for a, b in itertools.pairwise(starts))
    return step if ok else None


@dataclass(frozen=True)
class Group:
    """`n` blocks of one batch row, each `rows` queries × `keys` keys."""

    batch: int
    row0: tuple[int, ...]  # first query row of each block
    key0: tuple[int, ...]  # first key of each block
    rows: int
    keys: int

    @property
    def size(self) -> int:
        return len(self.row0)

    @cached_property
    def row_step(self) -> int | None:
        """Block i's rows start at row0[0] + i·step (a strided view), or None."""
        return uniform_step(self.row0)

    @cached_property
    def key_step(self) -> int | None:
        """Block i's keys start at key0[0] + i·step (a strided view, no copy), or None."""
        return uniform_step(self.key0)

    def index(self, which: str) -> Tensor:
        """(n, R) query rows or (n, K) keys of each block (rows may run past L)."""
        starts, size = (self.row0, self.rows) if which == "rows" else (self.key0, self.keys)
        return torch.tensor(starts)[:, None] + torch.arange(size)

    def key_splits(self, width: int) -> Iterator[Group]:
        """The same blocks cut along keys into spans of at most `width` keys."""
        for j in range(0, self.keys, width):
            key0 = tuple(k + j for k in self.key0)
            yield Group(self.batch, self.row0, key0, self.rows, min(width, self.keys - j))

    def chunks(self, blocks: int) -> Iterator[Group]:
        """The same blocks, at most `blocks` at a time (bounds the memory of one call)."""
        for i in range(0, self.size, blocks):
            sl = slice(i, i + blocks)
            yield Group(self.batch, self.row0[sl], self.key0[sl], self.rows, self.keys)


@dataclass(frozen=True)
class TilePlan:
    groups: tuple[Group, ...]
    area: int  # query-key pairs computed per head, over the batch
    tile: int  # query rows per tile

    @property
    def calls(self) -> int:
        return len(self.groups)

    def cost(self, heads: int, group_heads: int) -> float:
        """Estimated time in the units of `cost`: pairs by kernel efficiency, plus calls."""
        pairs = sum(
            cost.tiled_pair(g.rows * group_heads) * g.size * g.rows * g.keys for g in self.groups
        )
        return heads * pairs + cost.TILED_CALL * self.calls


def _bucket(length: Tensor) -> Tensor:
    """Round lengths up to a multiple of a quarter of their power of two (in granules).

    Widths 1..8 granules stay exact; above, at most four widths per octave remain, and
    no block grows by more than a quarter.
    """
    granules = torch.div(length + GRANULE - 1, GRANULE, rounding_mode="floor").clamp(min=1)
    step = (torch.exp2(torch.floor(torch.log2(granules.double()))) / 4).clamp(min=1).long()
    return (granules + step - 1) // step * step * GRANULE


def plan_tiles(mask: Mask | None, B: int, L: int, S: int, tile: int = TILES[1]) -> TilePlan:
    """Blocks of (batch row, query rows, key span) covering every visible pair."""
    n_tiles = math.ceil(L / tile)
    first = torch.arange(n_tiles) * tile
    last = (first + tile).clamp(max=L) - 1
    if mask is None:
        lo, hi = torch.zeros(1, n_tiles, dtype=torch.long), torch.full((1, n_tiles), S)
    else:
        lo, hi = mask.key_bounds(B, L, S, first, last)
    lo, hi = lo.expand(B, n_tiles), hi.expand(B, n_tiles)
    lo = torch.div(lo, GRANULE, rounding_mode="floor") * GRANULE
    hi = torch.where(hi > lo, ((hi + GRANULE - 1) // GRANULE * GRANULE).clamp(max=S), lo)
    if torch.unique(hi - lo).numel() > MAX_GROUPS:
        width = torch.minimum(_bucket(hi - lo), torch.tensor(S))
        lo = torch.where(hi > lo, (hi - width).clamp(min=0), lo)
        hi = torch.where(hi > lo, (lo + width).clamp(max=S), hi)
    return _group(lo, hi, tile, L)


def best_plan(mask: Mask | None, B: int, H: int, Hkv: int, L: int, S: int) -> TilePlan:
    """The plan of least estimated cost over the tile heights in `TILES`."""
    plans = [plan_tiles(mask, B, L, S, tile) for tile in TILES if tile < 2 * L or tile == TILES[0]]
    return min(plans, key=lambda p: p.cost(H, H // Hkv))


def _fits(rows: int, keys: int) -> bool:
    return rows <= MAX_ROWS and rows * keys <= MAX_PAIRS


def _group(lo: Tensor, hi: Tensor, tile: int, L: int) -> TilePlan:
    """Merge runs of tiles with equal spans into blocks, then blocks by batch row and shape."""
    B, n_tiles = lo.shape
    blocks: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    area = 0
    for b in range(B):
        spans = list(zip(lo[b].tolist(), hi[b].tolist(), strict=True))
        t = 0
        while t < n_tiles:
            end = t + 1
            width = spans[t][1] - spans[t][0]
            while end < n_tiles and spans[end] == spans[t] and _fits((end + 1 - t) * tile, width):
                end += 1
            start_key, stop_key = spans[t]
            if stop_key > start_key:
                rows = (end - t) * tile
                blocks.setdefault((b, rows, stop_key - start_key), []).append((t * tile, start_key))
                area += min(rows, L - t * tile) * (stop_key - start_key)
            t = end
    groups = tuple(
        Group(b, tuple(m[0] for m in members), tuple(m[1] for m in members), rows, keys)
        for (b, rows, keys), members in sorted(blocks.items())
    )
    return TilePlan(groups=groups, area=area, tile=tile)
