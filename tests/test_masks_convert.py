"""The converters from other conventions (`masks.convert`): True = may attend."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from helpers import grid


def test_from_key_padding_mask_inverts_polarity():
    ignore = torch.tensor([[False, False, True]])
    assert grid(ak.from_key_padding_mask(ignore), 1, 3) == [[1, 1, 0]]
    with pytest.raises(ak.MaskError, match="True = ignore"):
        ak.from_key_padding_mask(ignore.long())


def test_from_hf_attention_mask():
    hf = torch.tensor([[1, 1, 0]])
    assert grid(ak.from_hf_attention_mask(hf), 1, 3) == [[1, 1, 0]]
    with pytest.raises(ak.MaskError, match="0 and 1"):
        ak.from_hf_attention_mask(torch.tensor([[2, 1]]))


def test_from_hf_attention_mask_takes_the_4d_masks_attention_functions_get():
    visible = (
        ak.causal().materialize(2, 1, 4, 4)
        & torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]).bool()[:, None, None]
    )  # (B, 1, L, S): left padding in batch row 1
    additive = torch.zeros(2, 1, 4, 4).masked_fill(~visible, torch.finfo(torch.float32).min)
    for given in (visible, visible.long(), additive, additive.masked_fill(~visible, -torch.inf)):
        got = ak.from_hf_attention_mask(given)
        assert torch.equal(got.materialize(2, 3, 4, 4), visible.expand(2, 3, 4, 4))
    with pytest.raises(ak.MaskError, match=r"only 0 and 1 values \(1 = may attend\)"):
        ak.from_hf_attention_mask(visible.long() * 2)
    with pytest.raises(ak.MaskError, match=r"4-D \(B, 1\|H, L, S\)"):
        ak.from_hf_attention_mask(visible[0])  # 3-D


def test_from_additive_mask():
    add = torch.tensor([[0.0, -torch.inf], [torch.finfo(torch.float32).min, 0.0]])
    assert grid(ak.from_additive_mask(add), 2) == [[1, 0], [0, 1]]
    with pytest.raises(ak.MaskError, match="bias"):
        ak.from_additive_mask(torch.tensor([[0.0, -1.0]]))


def test_integer_masks_are_refused_with_the_converters_named():
    with pytest.raises(ak.MaskError, match=r"from_hf_attention_mask.*from_key_padding_mask"):
        q = torch.randn(1, 1, 2, 4)
        ak.attention(q, q, q, torch.ones(2, 2, dtype=torch.int64))
