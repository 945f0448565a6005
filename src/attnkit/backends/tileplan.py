"""Tile plans for the `tiled` backend: which keys each block of query rows must see.

The mask's key spans (`Mask.key_spans`, their hull over a tile: `masks.spans`) give,
for every tile of query rows and every batch row, one span of keys `[lo, hi)` that
holds all keys the tile may see; no L×S tensor is built. Spans are rounded to
`GRANULE` keys, consecutive tiles with the same span merge into one block (up to
`MAX_ROWS` rows and `MAX_PAIRS` pairs, which bound a block's mask), and blocks of one
batch row and shape form a `BlockGroup`: one kernel call, or a few in chunks of bounded
memory. The tile height is chosen per call by the cost model: short tiles waste fewer
pairs, tall tiles use the kernel better.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch import Tensor

from attnkit.backends.tilecost import pair_cost
from attnkit.masks import Mask
from attnkit.masks.spans import Spans, tile_bounds

__all__ = [
    "BAND_MIN",
    "GRANULE",
    "TILES",
    "BlockGroup",
    "Segments",
    "TilePlan",
    "best_plan",
    "plan_tiles",
    "uniform_step",
]

TILES = (64, 128, 256)  # query rows per tile, the candidates `best_plan` weighs
GRANULE = 64  # key spans start and end on multiples of this
MAX_ROWS = 256  # tiles with equal spans merge into blocks of at most this many rows
MAX_PAIRS = 1 << 19  # ... and at most this many pairs (a block's mask: 2 MiB in float32)
SEGMENT_MIN = 16  # causal runs this long run whole, as one is_causal block
MAX_GROUPS = 24  # more distinct block widths than this get bucketed
BAND_MIN = 768  # from this many query rows on, the CPU flash op splits queries by 256


def uniform_step(starts: tuple[int, ...]) -> int | None:
    """The step s with starts[i] = starts[0] + i·s (s >= 0), or None if there is none."""
    if len(starts) < 2:
        return 0
    step = starts[1] - starts[0]
    ok = step >= 0 and all(b - a == step for a, b in itertools.pairwise(starts))
    return step if ok else None


@dataclass(frozen=True)
class BlockGroup:
    """`n` blocks of one batch row, each `rows` queries × `keys` keys."""

    batch: int
    row0: tuple[int, ...]  # first query row of each block
    key0: tuple[int, ...]  # first key of each block
    rows: int
    keys: int
    causal: bool = False  # rows == keys and row m sees keys 0..m (the op's is_causal)
    merge: bool = False  # the rows hold a partial result already: merge by log-sum-exp

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

    def bands(self, height: int) -> Iterator[BlockGroup]:
        """The same pairs in bands of `height` to 2·`height` query rows (bounds a call's
        output and keeps its rows many enough for the op's coarse query split).

        A causal run becomes, per band, a causal square on the diagonal and then, below
        it, the fully visible rectangle of the band's earlier keys; that rectangle has
        `merge` set: its rows already hold the square's partial result. Other groups
        are cut by rows only.
        """
        count = self.rows // height  # bands of height..2·height rows: no short tail
        if count <= 1:
            yield self
            return
        cuts = [i * self.rows // count for i in range(count + 1)]
        for a, end in itertools.pairwise(cuts):
            n = end - a
            row0 = tuple(r + a for r in self.row0)
            if not self.causal:
                yield replace(self, row0=row0, rows=n)
                continue
            yield BlockGroup(self.batch, row0, tuple(k + a for k in self.key0), n, n, causal=True)
            if a > 0:
                yield BlockGroup(self.batch, row0, self.key0, n, a, merge=True)

    def pieces(self, width: int) -> Iterator[BlockGroup]:
        """The same pairs in blocks of under 2·`width` rows and keys (for a backward pass,
        which takes the global log-sum-exp and so may cut a row's keys anywhere)."""
        for band in self.bands(width):
            if band.causal:
                yield band
                continue
            for j in range(0, band.keys, width):
                key0 = tuple(k + j for k in band.key0)
                yield replace(band, key0=key0, keys=min(width, band.keys - j), merge=False)

    def chunks(self, blocks: int) -> Iterator[BlockGroup]:
        """The same blocks, at most `blocks` at a time (bounds the memory of one call)."""
        for i in range(0, self.size, blocks):
            sl = slice(i, i + blocks)
            yield replace(self, row0=self.row0[sl], key0=self.key0[sl])


@dataclass(frozen=True)
class TilePlan:
    groups: tuple[BlockGroup, ...]
    area: int  # query-key pairs computed per head, over the batch
    covered: int  # query rows (over the batch) that lie in some block
    tile: int  # query rows per tile

    @property
    def calls(self) -> int:
        return len(self.groups)

    def cost(self, heads: int, group_heads: int, priced: dict[str, float]) -> float:
        """Estimated time in the units of `cost` (with tiled's factors `priced`): pairs by
        kernel efficiency, plus calls."""
        pairs = sum(
            g.size
            * (
                priced["causal"] * g.rows * (g.rows + _query_split(g.rows)) / 2
                if g.causal
                else pair_cost(g.rows * group_heads, priced) * g.rows * g.keys
            )
            for g in self.groups
        )
        return heads * pairs + priced["call"] * self.calls


def _query_split(rows: int) -> int:
    """Query rows per inner block of PyTorch's CPU flash kernel: with `is_causal` it
    computes keys up to the end of each such block, so about rows·(rows + split)/2 pairs."""
    return 256 if rows >= BAND_MIN else 64 if rows >= 192 else 32


def _bucket(length: Tensor) -> Tensor:
    """Round lengths up to a multiple of a quarter of their power of two (in granules).

    Widths 1..8 granules stay exact; above, at most four widths per octave remain, and
    no block grows by more than a quarter.
    """
    granules = torch.div(length + GRANULE - 1, GRANULE, rounding_mode="floor").clamp(min=1)
    step = (torch.exp2(torch.floor(torch.log2(granules.double()))) / 4).clamp(min=1).long()
    return (granules + step - 1) // step * step * GRANULE


def plan_tiles(
    mask: Mask | None,
    B: int,
    L: int,
    S: int,
    tile: int = TILES[1],
    segments: Segments | None = None,
    *,
    spans: Spans | None = None,
) -> TilePlan:
    """Blocks of (batch row, query rows, key span) covering every visible pair.

    With `segments` (exact per-row spans and the causal runs found in them), each run is
    one causal block and the tiles cover the other rows, their spans from the rows'.
    `spans`: the mask's `key_spans`, where the caller has them (None: asked here).
    """
    n_tiles = math.ceil(L / tile)
    first = torch.arange(n_tiles) * tile
    row0, rows = first.expand(B, n_tiles), torch.full((B, n_tiles), tile)
    if segments is not None:
        # runs at least a tile long: then the rows a tile keeps are one interval
        segments = Segments(
            segments.lo,
            segments.hi,
            [[run for run in runs if run[2] >= tile] for runs in segments.runs],
        )
        row0, rows, lo, hi = _tiles_around(segments, B, L, S, tile)
    elif mask is None:
        lo, hi = torch.zeros(1, n_tiles, dtype=torch.long), torch.full((1, n_tiles), S)
    else:
        spans = mask.key_spans(B, L, S) if spans is None else spans
        lo, hi = tile_bounds(spans, L, S, first, (first + tile).clamp(max=L) - 1)
    lo, hi = lo.expand(B, n_tiles), hi.expand(B, n_tiles)
    lo = torch.div(lo, GRANULE, rounding_mode="floor") * GRANULE
    hi = torch.where(hi > lo, ((hi + GRANULE - 1) // GRANULE * GRANULE).clamp(max=S), lo)
    if torch.unique(hi - lo).numel() > MAX_GROUPS:
        width = torch.minimum(_bucket(hi - lo), torch.tensor(S))
        lo = torch.where(hi > lo, (hi - width).clamp(min=0), lo)
        hi = torch.where(hi > lo, (lo + width).clamp(max=S), hi)
    runs = [] if segments is None else segments.runs
    return _group(row0, rows, lo, hi, tile, L, runs)


@dataclass(frozen=True)
class Segments:
    """Exact per-row spans (B, L) and the long causal runs in them, per batch row."""

    lo: Tensor
    hi: Tensor
    runs: list[list[tuple[int, int, int, int]]]  # (first row, first key, length, offset)

    @staticmethod
    def find(mask: Mask, B: int, L: int, S: int, *, spans: Spans | None = None) -> Segments | None:
        """Rows r..e-1 where row i sees exactly keys c..c+offset+(i-r): a causal square
        (one `is_causal` call) after `offset` keys that every row sees (one plain call,
        merged by log-sum-exp). Prefix-LM and bottom-right causal rows have an offset.

        Only runs of at least `SEGMENT_MIN` rows count (there the op uses its large
        query blocks); None if the mask has no exact spans or no such run. `spans`: its
        `key_spans`, where the caller has them.
        """
        spans = mask.key_spans(B, L, S) if spans is None else spans
        if mask.has_bias or mask.head_dependent or spans is None or not spans.exact:
            return None
        index = torch.arange(L)
        lo, hi = spans.lo.expand(B, L), spans.hi.expand(B, L)
        shift = hi - index  # constant along a causal run, as the first key is
        change = torch.ones(B, L, dtype=torch.bool)
        change[:, 1:] = (lo[:, 1:] != lo[:, :-1]) | (shift[:, 1:] != shift[:, :-1])
        runs: list[list[tuple[int, int, int, int]]] = []
        for b in range(B):
            starts = torch.nonzero(change[b])[:, 0]
            length = torch.diff(starts, append=torch.tensor([L]))
            offset = hi[b, starts] - lo[b, starts] - 1
            ok = (length >= SEGMENT_MIN) & (offset >= 0)
            first, key, count, offset = starts[ok], lo[b, starts[ok]], length[ok], offset[ok]
            row = zip(first.tolist(), key.tolist(), count.tolist(), offset.tolist(), strict=True)
            runs.append(list(row))
        return Segments(lo, hi, runs) if any(runs) else None


def _tiles_around(
    segments: Segments, B: int, L: int, S: int, tile: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(B, n_tiles) first row, row count and key span of each tile's rows outside the runs.

    Runs are at least a tile long, so the rows a tile keeps are one interval.
    """
    n_tiles = math.ceil(L / tile)
    keep = torch.ones(B, n_tiles * tile, dtype=torch.bool)
    keep[:, L:] = False
    for b, runs in enumerate(segments.runs):
        for r, _, length, _ in runs:
            keep[b, r : r + length] = False
    pad = n_tiles * tile - L
    lo = torch.nn.functional.pad(segments.lo, (0, pad), value=S)
    hi = torch.nn.functional.pad(segments.hi, (0, pad), value=0)
    keep = keep.view(B, n_tiles, tile)
    lo = torch.where(keep, lo.view(B, n_tiles, tile), S).amin(-1)
    hi = torch.where(keep, hi.view(B, n_tiles, tile), 0).amax(-1).clamp(min=lo)
    row0 = torch.arange(n_tiles) * tile + keep.long().argmax(-1)  # first kept row
    return row0, keep.sum(-1), lo.clamp(max=S), hi


def best_plan(
    mask: Mask | None,
    B: int,
    H: int,
    Hkv: int,
    L: int,
    S: int,
    priced: dict[str, float],
) -> TilePlan:
    """The plan of least estimated cost over the tile heights in `TILES`, with and
    without causal runs as whole blocks, priced with tiled's factors `priced` (as the
    call's cost table has them)."""
    tiles = [tile for tile in TILES if tile < 2 * L or tile == TILES[0]]
    spans = None if mask is None else mask.key_spans(B, L, S)  # read once for every height
    plans = [plan_tiles(mask, B, L, S, tile, spans=spans) for tile in tiles]
    segments = None if mask is None else Segments.find(mask, B, L, S, spans=spans)
    if segments is not None:
        plans += [plan_tiles(mask, B, L, S, tile, segments, spans=spans) for tile in tiles]
    return min(plans, key=lambda p: p.cost(H, H // Hkv, priced))


def _merging_last(item: tuple[tuple[int, int, int, bool, bool], object]) -> tuple[object, ...]:
    (b, n, k, causal, merge), _ = item
    return merge, b, n, k, causal


def _fits(rows: int, keys: int) -> bool:
    return rows <= MAX_ROWS and rows * keys <= MAX_PAIRS


def _group(
    row0: Tensor,
    rows: Tensor,
    lo: Tensor,
    hi: Tensor,
    tile: int,
    L: int,
    runs: list[list[tuple[int, int, int, int]]],
) -> TilePlan:
    """Merge runs of whole tiles with equal spans into blocks; group blocks by batch row
    and shape; add the causal runs as blocks of their own (a causal square, then the
    rectangle of its offset keys, merged into the square's rows: those groups last)."""
    B, n_tiles = lo.shape
    blocks: dict[tuple[int, int, int, bool, bool], list[tuple[int, int]]] = {}
    area = covered = 0
    for b in range(B):
        starts, counts = row0[b].tolist(), rows[b].tolist()
        spans = list(zip(lo[b].tolist(), hi[b].tolist(), strict=True))
        t = 0
        while t < n_tiles:
            end, (start_key, stop_key) = t + 1, spans[t]
            width = stop_key - start_key
            while (
                end < n_tiles
                and spans[end] == spans[t]
                and counts[end - 1] == tile == counts[end]
                and _fits((end + 1 - t) * tile, width)
            ):
                end += 1
            if width > 0 and counts[t] > 0:
                n = sum(counts[t:end])
                blocks.setdefault((b, n, width, False, False), []).append((starts[t], start_key))
                area += min(n, L - starts[t]) * width
                covered += min(n, L - starts[t])
            t = end
        for r, c, length, offset in runs[b] if runs else ():
            blocks.setdefault((b, length, length, True, False), []).append((r, c + offset))
            if offset:
                blocks.setdefault((b, length, offset, False, True), []).append((r, c))
            area += length * (length + 1) // 2 + length * offset
            covered += length
    groups = tuple(
        BlockGroup(b, tuple(m[0] for m in group), tuple(m[1] for m in group), n, k, causal, merge)
        for (b, n, k, causal, merge), group in sorted(blocks.items(), key=_merging_last)
    )
    return TilePlan(groups=groups, area=area, covered=covered, tile=tile)
