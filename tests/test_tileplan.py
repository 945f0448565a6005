"""Tiled's block plans (`attnkit.backends.tileplan`): bands, documents and causal runs
computed, the pairs no row sees skipped, each pair held once.
"""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.backends.tileplan import GRANULE, TILES, plan_tiles

TILE = TILES[1]


def test_sliding_window_plan_computes_only_the_band_with_strided_windows():
    L = S = 4096
    plan = plan_tiles(ak.sliding_window(255), 1, L, S)
    assert plan.area <= L * (256 + TILE + 2 * GRANULE)  # the band, not L×S
    assert plan.calls <= 6
    assert all(g.key_step is not None for g in plan.groups)  # key windows are views


def test_documents_plan_skips_pairs_across_documents():
    S = 4096
    plan = plan_tiles(ak.document(torch.arange(S) * 8 // S) & ak.causal(), 1, S, S)
    assert plan.area < 0.1 * S * S


@pytest.mark.parametrize("height", [1, 7, 64, 150, 151])
def test_bands_and_pieces_of_a_causal_run_hold_each_pair_once(height):
    """Bands: causal squares, then rectangles marked to merge; pieces also cut keys."""
    from attnkit.backends.tileplan import BlockGroup

    run = BlockGroup(0, (10, 400), (10, 400), 150, 150, causal=True)
    for parts in (list(run.bands(height)), list(run.pieces(height))):
        count = torch.zeros(2, 150, 150, dtype=torch.long)  # per block: (row, key) hits
        for part in parts:
            assert part.rows < 2 * height and (part.causal or part.keys <= height or part.merge)
            assert part.rows >= min(height, 150)  # no short tail band
            rows = part.index("rows") - torch.tensor(run.row0)[:, None]  # (n, R) local
            keys = part.index("keys") - torch.tensor(run.key0)[:, None]
            hit = torch.ones(part.rows, part.keys, dtype=torch.long)
            if part.causal:
                hit = hit.tril()
            for i in range(2):
                count[i, rows[i, :, None], keys[i, None, :]] += hit
        assert torch.equal(count, torch.ones(150, 150, dtype=torch.long).tril().expand(2, -1, -1))
    bands = list(run.bands(height))
    assert [b.merge for b in bands] == [not b.causal for b in bands]


def test_causal_runs_are_found_where_rows_see_their_run_causally():
    from attnkit.backends.tilecost import FACTORS
    from attnkit.backends.tileplan import Segments, best_plan

    L = 4096
    band = Segments.find(ak.sliding_window(255), 1, L, L)
    assert band is not None and band.runs == [[(0, 0, 256, 0)]]  # until the window is full
    found = Segments.find(ak.causal() & ak.key_padding(torch.tensor([L])), 1, L, L)
    assert found is not None and found.runs == [[(0, 0, L, 0)]]
    docs = ak.document(torch.arange(L) // 1024) & ak.causal()
    assert (
        sum(
            g.size
            for g in best_plan(docs, 1, 8, 8, L, L, FACTORS.built_in("avx2")).groups
            if g.causal
        )
        == 4
    )
    prefix = Segments.find(ak.prefix_lm(1000), 1, L, L)  # row 999 on: causal after 999 keys
    assert prefix is not None and prefix.runs == [[(999, 0, L - 999, 999)]]
    decode = Segments.find(ak.causal(align="bottom_right"), 1, 100, L)
    assert decode is not None and decode.runs == [[(0, 0, 100, L - 100)]]


@pytest.mark.parametrize("tile", TILES)
def test_runs_shorter_than_a_tile_stay_in_the_tiles(tile):
    """A short causal run inside a tall tile must not split the tile's rows in two."""
    from attnkit.backends.tileplan import Segments

    ids = torch.tensor([0] * 70 + [1] * 13 + [2] * 150 + [3] * 67)
    mask = ak.document(ids) & ak.causal() & ak.key_padding(torch.tensor([300, 250]))
    plan = plan_tiles(mask, 2, 300, 300, tile, Segments.find(mask, 2, 300, 300))
    rows = torch.zeros(2, 300, dtype=torch.int)
    for g in plan.groups:
        for r in g.row0:
            rows[g.batch, r : r + g.rows] += 1
    assert (rows == 1).all(), "every row in exactly one block"
