"""attnkit.masks.spec: a mask as a string and its tensors, and back, as masks cross the
compiled op's boundary."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.masks.spec import decode, encodable, encode
from attnkit.masks.structure import value_key

MASKS = [
    None,
    ak.causal(align="bottom_right"),
    ak.causal() & ak.sliding_window(3, 1),
    ~ak.chunked(4) | ak.prefix_lm(2),
    ak.key_padding(torch.tensor([7, 3])) & ak.causal(),
    ak.document(torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])),
    torch.rand(8, 8, generator=torch.Generator().manual_seed(0)) > 0.5,
    ak.alibi(4) & ak.causal(),
]


@pytest.mark.parametrize("mask", MASKS)
def test_a_decoded_mask_is_the_mask(mask):
    tensors: list[torch.Tensor] = []
    spec = encode(mask, tensors)
    assert isinstance(spec, str) and encodable(mask)
    back = decode(spec, tensors)
    if mask is None:
        assert back is None
        return
    want = ak.masks.as_mask(mask).materialize(2, 4, 8, 8)
    assert torch.equal(ak.masks.as_mask(back).materialize(2, 4, 8, 8), want)
    # decoded again: another object of the same value (its prepared call is found again)
    assert value_key(decode(spec, tensors), []) == value_key(back, [])


def test_a_function_cannot_cross():
    mask = ak.Mask.from_mod(lambda b, h, i, j: j <= i, "mine") & ak.causal()
    assert not encodable(mask)


def test_numbers_that_json_spells_otherwise_cross_exactly():
    mask = ak.alibi(2) & ak.causal(offset=-3) & ak.prefix_lm(0)
    tensors: list[torch.Tensor] = []
    back = decode(encode(mask, tensors), tensors)
    assert back.describe() == mask.describe()
    assert value_key(back, []) == value_key(mask, [])  # -3 stays an int, 0 is not False
