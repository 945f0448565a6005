"""The kinds of mask read from per-token tensors (`masks.tokens`): key_padding,
document."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from helpers import grid


def test_a_padding_mask_of_the_other_convention_warns_naming_both():
    """PyTorch's key_padding_mask (True = padding) read as attnkit's (True = real token):
    the rows without padding hide every key."""
    torch_style = torch.tensor([[False, False, False], [False, False, True]])
    words = r"row\(s\) \[0\].*True = real token.*True = padding.*~mask"
    with pytest.warns(ak.MaskConventionWarning, match=words):
        mask = ak.key_padding(torch_style)
    q = torch.randn(2, 1, 3, 4)
    assert torch.equal(ak.attention(q, q, q, mask)[0], torch.zeros(1, 3, 4))  # what it means


@pytest.mark.parametrize(
    "valid",
    [
        [[True, True, False], [True, False, False]],  # every row keeps a key
        [[False, False, False], [False, False, False]],  # every row empty: no other reading
    ],
)
def test_a_padding_mask_that_reads_one_way_only_is_quiet(valid, recwarn):
    ak.key_padding(torch.tensor(valid))
    ak.key_padding(torch.tensor([0, 3]))  # lengths: no convention to misread
    ak.from_key_padding_mask(torch.tensor([[False, False], [True, True]]))  # named: meant
    assert not [w for w in recwarn if w.category is ak.MaskConventionWarning]


def test_key_padding_bool_and_lengths_agree():
    valid = torch.tensor([[True, True, False], [True, False, False]])
    lengths = torch.tensor([2, 1])
    a = ak.key_padding(valid).materialize(2, 1, 2, 3)
    b = ak.key_padding(lengths).materialize(2, 1, 2, 3)
    assert torch.equal(a, b)
    assert a[1, 0].int().tolist() == [[1, 0, 0], [1, 0, 0]]


@pytest.mark.parametrize("lengths", [[-1, 2], [2, 4]])
def test_bad_lengths_are_refused(lengths):
    with pytest.raises(ak.MaskError, match="lengths"):
        ak.key_padding(torch.tensor(lengths)).materialize(2, 1, 3, 3)


def test_key_padding_batch_and_length_mismatch():
    with pytest.raises(ak.ShapeContractError, match="B=3"):
        ak.key_padding(torch.tensor([1, 2])).materialize(3, 1, 2, 2)
    with pytest.raises(ak.ShapeContractError, match="S=4"):
        ak.key_padding(torch.ones(1, 3, dtype=torch.bool)).materialize(1, 1, 4, 4)


def test_document_literal_and_cross():
    ids = torch.tensor([0, 0, 1, 1, 1])
    assert grid(ak.document(ids), 5)[2] == [0, 0, 1, 1, 1]
    cross = ak.document(torch.tensor([1, 0]), torch.tensor([0, 1, 1]))
    assert grid(cross, 2, 3) == [[0, 1, 1], [1, 0, 0]]


def test_document_with_l_ne_s_needs_both_ids():
    with pytest.raises(ak.ShapeContractError, match="document\\(q_ids, kv_ids\\)"):
        ak.document(torch.tensor([0, 0, 1])).materialize(1, 1, 2, 3)


def test_document_refuses_float_ids():
    with pytest.raises(ak.MaskError, match="integer"):
        ak.document(torch.tensor([0.0, 1.0]))
