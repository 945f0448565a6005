"""The kinds of mask over positions (`masks.positions`): causal, sliding_window,
chunked, prefix_lm, their alignment and offsets."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from helpers import grid


@pytest.mark.parametrize(("L", "S"), [(3, 3), (2, 5), (5, 2), (1, 4)])
def test_offset_names_each_alignment_and_any_other_diagonal(L, S):
    for make in (
        lambda **kw: ak.causal(**kw),
        lambda **kw: ak.sliding_window(1, 1, **kw),
        lambda **kw: ak.prefix_lm(1, **kw),
        lambda **kw: ak.chunked(2, **kw),
    ):
        assert grid(make(offset=0), L, S) == grid(make(align="top_left"), L, S)
        assert grid(make(offset=S - L), L, S) == grid(make(align="bottom_right"), L, S)
    for n in (-2, 1, 3):  # j <= i + n, wherever that falls
        expected = [[int(j <= i + n) for j in range(S)] for i in range(L)]
        assert grid(ak.causal(offset=n), L, S) == expected


def test_chunked_literal_and_with_causal():
    assert grid(ak.chunked(3), 5) == [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 1],
        [0, 0, 0, 1, 1],
    ]
    # a static cache: 2 queries at positions 4 and 5 of 8 slots, chunks of 3
    got = grid(ak.chunked(3, offset=4) & ak.causal(offset=4), 2, 8)
    assert got == [[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1, 0, 0]]
    assert str(ak.chunked(3, offset=4)) == "chunked(3, offset=4)"
    assert str(ak.causal(offset=-1)) == "causal(offset=-1)"


def test_causal_literal():
    assert grid(ak.causal(), 3) == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize(
    ("align", "expected"),
    [
        ("top_left", [[1, 0, 0, 0], [1, 1, 0, 0]]),
        ("bottom_right", [[1, 1, 1, 0], [1, 1, 1, 1]]),
    ],
)
def test_causal_alignment_when_l_lt_s(align, expected):
    assert grid(ak.causal(align=align), 2, 4) == expected


def test_causal_bottom_right_with_l_gt_s_leaves_first_rows_empty():
    assert grid(ak.causal(align="bottom_right"), 3, 2) == [[0, 0], [1, 0], [1, 1]]


def test_causal_decode_step_sees_every_cached_key():
    assert grid(ak.causal(align="bottom_right"), 1, 5) == [[1, 1, 1, 1, 1]]


def test_causal_never_guesses_alignment():
    with pytest.raises(ak.ShapeContractError, match=r"top_left.*bottom_right"):
        ak.causal().materialize(1, 1, 2, 3)


def test_bad_alignment_name():
    with pytest.raises(ak.MaskError, match="top_left"):
        ak.causal(align="top-left")  # type: ignore[arg-type]


def test_sliding_window_is_inclusive():
    m = ak.sliding_window(2, 1)
    rows = torch.tensor(grid(m, 8))
    assert rows[4].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]  # left + 1 + right = 4 keys
    assert rows.sum(-1).tolist() == [2, 3, 4, 4, 4, 4, 4, 3]


def test_sliding_window_bottom_right():
    assert grid(ak.sliding_window(1, align="bottom_right"), 2, 5) == [
        [0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1],
    ]


def test_negative_window_is_refused():
    with pytest.raises(ak.MaskError, match="left=-1"):
        ak.sliding_window(-1)
    with pytest.raises(ak.MaskError, match="right=-2"):
        ak.sliding_window(1, -2)


def test_prefix_lm_literal_and_batched():
    assert grid(ak.prefix_lm(2), 4)[0] == [1, 1, 0, 0]
    batched = ak.prefix_lm(torch.tensor([1, 3]))
    assert grid(batched, 4, batch=1)[0] == [1, 1, 1, 0]
    assert grid(batched, 4, batch=0)[0] == [1, 0, 0, 0]
