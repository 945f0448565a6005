"""The Mask protocol and its algebra (`masks.base`): drawings, `&`, `|`, `~`, dense and
materialize, descriptions."""

from __future__ import annotations

import doctest

import pytest
import torch

import attnkit as ak
import attnkit.masks.base
import attnkit.masks.positions
import attnkit.masks.tokens


def test_docstring_drawings_are_the_real_masks():
    flags = doctest.NORMALIZE_WHITESPACE
    names = {"causal": ak.causal, "torch": torch}  # the examples combine kinds of both files
    result = doctest.testmod(attnkit.masks.positions, optionflags=flags, extraglobs=names)
    assert result.attempted >= 8 and result.failed == 0
    result = doctest.testmod(attnkit.masks.tokens, optionflags=flags, extraglobs=names)
    assert result.attempted >= 4 and result.failed == 0
    result = doctest.testmod(attnkit.masks.base, optionflags=flags, extraglobs={"ak": ak})
    assert result.attempted >= 1 and result.failed == 0


def test_algebra_matches_tensor_logic():
    a, b = ak.causal(), ak.sliding_window(1, 1)
    ta, tb = a.materialize(1, 1, 5, 5), b.materialize(1, 1, 5, 5)
    assert torch.equal((a & b).materialize(1, 1, 5, 5), ta & tb)
    assert torch.equal((a | b).materialize(1, 1, 5, 5), ta | tb)
    assert torch.equal((~a).materialize(1, 1, 5, 5), ~ta)
    assert torch.equal(ak.and_masks(a, b, ~a).materialize(1, 1, 5, 5), ta & tb & ~ta)
    assert torch.equal(ak.or_masks(a, b).materialize(1, 1, 5, 5), ta | tb)


def test_float_tensor_cannot_join_the_algebra():
    with pytest.raises(ak.MaskError, match="additive bias"):
        _ = ak.causal() & torch.zeros(3, 3)


def test_dense_is_minimal_and_materialize_is_full():
    m = ak.causal() & ak.key_padding(torch.tensor([3, 2]))
    assert m.dense(2, 4, 3, 3).shape == (2, 1, 3, 3)
    assert ak.causal().dense(2, 4, 3, 3).shape == (1, 1, 3, 3)
    assert m.materialize(2, 4, 3, 3).shape == (2, 4, 3, 3)


def test_descriptions_read_well():
    m = (ak.causal() & ak.sliding_window(3)) | ak.prefix_lm(2)
    assert str(m) == "((causal() & sliding_window(left=3, right=0)) | prefix_lm(2))"
    assert "key_padding" in str(ak.key_padding(torch.tensor([1])))


def test_draw_marks_allowed_and_hidden():
    assert ak.causal().draw(2) == "■ ·\n■ ■"
