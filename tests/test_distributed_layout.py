"""Ranks to global rows (`attnkit.distributed.layout`): contiguous and zigzag."""

from __future__ import annotations

import pytest

import attnkit as ak
from attnkit.distributed.layout import Layout


def test_zigzag_gives_rank_r_chunks_r_and_2p_minus_1_minus_r():
    lay = Layout.of("zigzag", 3, 12)
    assert [lay.chunks(r) for r in range(3)] == [
        [(0, 2), (10, 12)],
        [(2, 4), (8, 10)],
        [(4, 6), (6, 8)],
    ]
    assert sorted(lay.order().tolist()) == list(range(12))
    assert Layout.of("contiguous", 3, 12).positions(1).tolist() == [4, 5, 6, 7]


def test_a_length_that_does_not_split_names_the_padding():
    with pytest.raises(ak.ShapeContractError, match=r"pad it by 2 position\(s\) to L=12"):
        Layout.of("zigzag", 3, 10)
    with pytest.raises(ValueError, match="layout must be one of"):
        Layout.of("striped", 2, 8)
