"""Masks without structure of their own (`masks.base`): bool tensors, `Mask.from_mod`."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from helpers import grid


def test_from_mod_equals_the_built_in_kinds_it_spells():
    ids = torch.tensor([0, 0, 1, 1, 1, 2])
    pairs = [
        (ak.Mask.from_mod(lambda b, h, q, kv: kv <= q), ak.causal()),
        (
            ak.Mask.from_mod(lambda b, h, q, kv: (ids[q] == ids[kv]) & (kv <= q)),
            ak.document(ids) & ak.causal(),
        ),
    ]
    for mod, built_in in pairs:
        assert not mod.head_dependent
        assert torch.equal(mod.materialize(2, 3, 6, 6), built_in.materialize(2, 3, 6, 6))
    assert str(pairs[0][0]) == "from_mod(<lambda>)"


def test_from_mod_per_head_and_per_batch():
    mod = ak.Mask.from_mod(lambda b, h, q, kv: kv <= q + h - b, name="shifted")
    assert mod.head_dependent and str(mod) == "from_mod(shifted)"
    dense = mod.materialize(2, 3, 4, 4)
    for b in range(2):
        for h in range(3):
            assert grid(ak.causal(offset=h - b), 4) == dense[b, h].int().tolist()


def test_from_mod_refuses_what_is_not_a_bool_mask():
    with pytest.raises(TypeError, match="from_mod takes a function"):
        ak.Mask.from_mod(3)  # type: ignore[arg-type]
    with pytest.raises(ak.MaskError, match=r"must return a bool tensor.*got torch.int64"):
        ak.Mask.from_mod(lambda b, h, q, kv: kv - q).materialize(1, 1, 3, 3)


def test_masks_combine_with_bool_tensors_on_either_side():
    t = torch.rand(5, 5) > 0.5
    causal = ak.causal().materialize(1, 1, 5, 5)[0, 0]
    assert torch.equal((ak.causal() & t).materialize(1, 1, 5, 5)[0, 0], causal & t)
    assert torch.equal((t | ak.causal()).materialize(1, 1, 5, 5)[0, 0], causal | t)


def test_tensor_mask_broadcast_error_names_the_dim():
    with pytest.raises(ak.ShapeContractError, match="its S dim is 4"):
        (ak.causal() & torch.ones(3, 4, dtype=torch.bool)).materialize(1, 1, 3, 3)


def test_a_tensor_mask_with_an_empty_dim_materializes_empty():
    """Fuzz seed 101, case 690: a (0, S) bool mask (L = 0) combined with a predicate mask
    indexed its empty query dim at 0 (a size-0 dim was taken for a broadcast one)."""
    from attnkit.masks import as_mask

    every_fourth = ak.Mask.from_mod(lambda b, h, i, j: j % 4 == 0)
    mask = as_mask(torch.ones(1, 2, 1, 1, dtype=torch.bool)) | (
        as_mask(torch.ones(0, 5, dtype=torch.bool)) & every_fourth
    )
    assert mask.materialize(3, 2, 0, 5).shape == (3, 2, 0, 5)
