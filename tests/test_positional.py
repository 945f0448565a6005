"""Rotary position embedding (`attnkit.kv.positional`)."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak


def test_rope_scores_depend_only_on_relative_position():
    rope = ak.RotaryEmbedding(16)
    q, k = torch.randn(16), torch.randn(16)

    def score(m, n):
        qm = rope.rotate(q.view(1, 1, 1, 16), offset=m)
        kn = rope.rotate(k.view(1, 1, 1, 16), offset=n)
        return (qm * kn).sum()

    torch.testing.assert_close(score(3, 1), score(10, 8))
    torch.testing.assert_close(score(0, 5), score(20, 25))
    assert not torch.allclose(score(3, 1), score(3, 2))
    with pytest.raises(ak.ShapeContractError, match="even"):
        ak.RotaryEmbedding(15)
