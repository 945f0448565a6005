"""Heads: split/merge round trips and GQA grouping."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.heads import repeat_kv


def test_split_heads_gives_contiguous_slices():
    x = torch.arange(2 * 3 * 8, dtype=torch.float32).view(2, 3, 8)
    heads = ak.split_heads(x, 4)
    assert heads.shape == (2, 4, 3, 2)
    assert torch.equal(heads[1, 2, 0], x[1, 0, 4:6])
    assert torch.equal(ak.merge_heads(heads), x)


def test_split_heads_refuses_indivisible_embedding():
    with pytest.raises(ak.ShapeContractError, match="E=10 is not divisible by num_heads=4"):
        ak.split_heads(torch.randn(1, 2, 10), 4)


def test_split_and_merge_check_rank():
    with pytest.raises(ak.ShapeContractError, match=r"\(B, L, E\)"):
        ak.split_heads(torch.randn(2, 10), 2)
    with pytest.raises(ak.ShapeContractError, match=r"\(B, H, L, Dh\)"):
        ak.merge_heads(torch.randn(2, 10, 3))


def test_repeat_kv_maps_query_head_h_to_kv_head_h_div_g():
    kv = torch.arange(2).float().view(1, 2, 1, 1)  # K/V head index as the value
    rep = repeat_kv(kv, 3)
    assert rep.flatten().tolist() == [0, 0, 0, 1, 1, 1]
