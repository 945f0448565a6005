"""What backends read from a mask (`masks.structure`, `masks.spans`): key spans, tile
bounds, pair counts, where spans are exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit.backends.tileplan import TILES
from attnkit.masks import as_mask
from attnkit.masks.spans import exact_spans
from attnkit.masks.structure import count_allowed_pairs, key_bounds


@st.composite
def structured_masks(draw, B, L, S):
    align = None if L == S else "bottom_right"
    leaves = [
        ak.causal(align=align),
        ak.sliding_window(draw(st.integers(0, 40)), draw(st.integers(0, 8)), align=align),
        ak.key_padding(torch.tensor([draw(st.integers(0, S)) for _ in range(B)])),
        ak.prefix_lm(draw(st.integers(0, S)), align=align),
        ak.causal(offset=draw(st.integers(-5, S + 2))),
        ak.chunked(draw(st.integers(1, 80)), offset=draw(st.integers(-3, S))),
    ]
    if L == S:
        ids = torch.sort(torch.randint(0, 4, (B, S))).values
        leaves.append(ak.document(ids))
    # bool tensors: one run of keys per row (their spans are read off the tensor), a
    # padding row per batch, and a random one (runs: no spans)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    keys = torch.arange(S)
    start = torch.randint(0, S + 1, (B, 1, L, 1), generator=g)
    width = torch.randint(0, S + 1, (B, 1, L, 1), generator=g)
    lengths = torch.randint(0, S + 1, (B, 1, 1, 1), generator=g)
    leaves += [
        as_mask((keys >= start) & (keys < start + width)),
        as_mask(keys < lengths),
        as_mask(torch.rand(1, 1, L, S, generator=g) > 0.5),
    ]
    picked = draw(st.lists(st.sampled_from(leaves), min_size=1, max_size=3))
    mask = picked[0]
    for other in picked[1:]:
        mask = mask & other if draw(st.booleans()) else mask | other
    return mask


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data(), st.sampled_from([(1, 1), (70, 70), (150, 150), (1, 90), (64, 200), (130, 70)]))
def test_key_bounds_hold_every_visible_key(data, size):
    L, S = size
    B = 2
    mask = data.draw(structured_masks(B, L, S))
    first = torch.arange(0, L, TILES[1])
    last = (first + TILES[1]).clamp(max=L) - 1
    lo, hi = key_bounds(mask, B, L, S, first, last)
    dense = mask.materialize(B, 1, L, S)[:, 0]  # (B, L, S)
    keys = torch.arange(S)
    for t in range(first.shape[0]):
        rows = dense[:, first[t] : last[t] + 1].any(1)  # (B, S) keys seen by the tile
        inside = (keys >= lo[:, t, None]) & (keys < hi[:, t, None])
        assert not (rows & ~inside).any(), f"{mask}: tile {t} sees keys outside its span"


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data(), st.sampled_from([(1, 1), (70, 70), (150, 150), (1, 90), (64, 200), (130, 70)]))
def test_exact_spans_describe_each_row_exactly_and_count_pairs(data, size):
    """Where a mask claims one interval per row, the interval IS the row (and counts pairs)."""
    L, S = size
    B = 2
    mask = data.draw(structured_masks(B, L, S))
    dense = mask.materialize(B, 1, L, S)[:, 0]  # (B, L, S)
    assert count_allowed_pairs(mask, B, 3, L, S) == 3 * int(dense.sum())
    found = exact_spans(mask, B, L, S)
    if found is None:
        return
    keys = torch.arange(S)
    lo, hi = found  # (B|1, L)
    spans = (keys >= lo[..., None]) & (keys < hi[..., None])
    assert torch.equal(spans.expand(B, L, S), dense), f"{mask}: spans differ from the mask"


@pytest.mark.parametrize(
    ("mask", "exact"),
    [
        (ak.causal() & ak.sliding_window(3) & ak.key_padding(torch.tensor([5, 9])), True),
        (ak.key_padding(torch.tensor([[True, True, False], [False, True, True]])), True),
        (ak.key_padding(torch.tensor([[True, False, True], [True, True, True]])), False),
        (ak.document(torch.tensor([0, 0, 1])), True),
        (ak.document(torch.tensor([0, 1, 0])), False),
        (ak.causal() | ak.prefix_lm(1), False),
        (~ak.causal(), False),
        (ak.causal() & torch.ones(3, 3, dtype=torch.bool), True),  # a run per row
        (ak.causal() & torch.tensor([[1, 0, 1], [1, 1, 1], [1, 1, 1]]).bool(), False),
        (as_mask(torch.ones(2, 3, 3, 3, dtype=torch.bool)), False),  # per head
    ],
    ids=str,
)
def test_exact_spans_only_where_each_row_is_one_interval(mask, exact):
    assert (exact_spans(mask, 2, 3, 3) is not None) is exact
