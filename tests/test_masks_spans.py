"""attnkit.masks.spans: each row's interval of keys, the rows and keys anybody sees from
them, and the hull over ranges of rows, against brute force."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.masks.spans import exact_spans, range_bounds, seen_from_spans, tile_bounds


def _random_spans(B=3, L=40, S=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo = torch.randint(0, S, (B, L), generator=g)
    hi = lo + torch.randint(-3, 12, (B, L), generator=g)  # some empty (hi <= lo)
    return lo, hi.clamp(max=S)


@pytest.mark.parametrize("seed", range(4))
def test_seen_from_spans_is_the_dense_any(seed):
    lo, hi = _random_spans(seed=seed)
    j = torch.arange(50)
    dense = (j >= lo[..., None]) & (j < hi[..., None])  # (B, L, S)
    rows, keys = seen_from_spans(lo, hi, 50)
    assert torch.equal(rows, dense.any(-1)) and torch.equal(keys, dense.any(-2))


@pytest.mark.parametrize("seed", range(4))
def test_range_bounds_is_the_hull_of_the_seen_rows(seed):
    lo, hi = _random_spans(seed=seed)
    g = torch.Generator().manual_seed(seed + 10)
    first = torch.randint(0, 40, (25,), generator=g)
    last = (first + torch.randint(0, 10, (25,), generator=g)).clamp(max=39)
    got_lo, got_hi = range_bounds(lo, hi, first, last)
    for t, (a, b) in enumerate(zip(first.tolist(), last.tolist(), strict=True)):
        for row in range(lo.shape[0]):
            seen = hi[row, a : b + 1] > lo[row, a : b + 1]
            if not seen.any():
                assert (got_lo[row, t], got_hi[row, t]) == (0, 0)
                continue
            assert got_lo[row, t] == lo[row, a : b + 1][seen].min()
            assert got_hi[row, t] == hi[row, a : b + 1][seen].max()


def test_exact_spans_only_where_one_interval_describes_the_mask():
    lo, hi = exact_spans(ak.causal() & ak.sliding_window(2), 1, 6, 6)
    assert lo.tolist() == [[0, 0, 0, 1, 2, 3]] and hi.tolist() == [[1, 2, 3, 4, 5, 6]]
    assert exact_spans(ak.causal() | ak.sliding_window(0, 2), 1, 6, 6) is None  # a hull
    per_head = ak.Mask.from_mod(lambda b, h, i, j: j <= i + h, "per head")
    assert exact_spans(per_head, 1, 6, 6) is None


def test_tile_bounds_without_spans_is_every_key():
    first, last = torch.tensor([0, 4]), torch.tensor([3, 7])
    lo, hi = tile_bounds(None, 8, 11, first, last)
    assert lo.tolist() == [[0, 0]] and hi.tolist() == [[11, 11]]
