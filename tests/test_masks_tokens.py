"""The kinds of mask read from per-token tensors (`masks.tokens`): key_padding,
document."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from helpers import grid


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
