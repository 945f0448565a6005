"""Ranks agree before traffic (`distributed.agree`): the fingerprint of a call."""

from __future__ import annotations

import torch

import attnkit as ak


def test_the_agreement_fingerprint_sees_any_one_value_and_ignores_layout():
    from attnkit.distributed.agree import describe

    ids = torch.arange(48).view(2, 24) // 5
    base = describe(ak.document(ids), contents=True)
    assert describe(ak.document(ids.t().contiguous().t()), contents=True) == base
    for where in [(0, 0), (1, 23), (1, 7)]:
        changed = ids.clone()
        changed[where] += 1
        assert describe(ak.document(changed), contents=True) != base, where
    x = torch.randn(3, 5)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.bool):
        y = x.to(dtype)
        z = y.clone()
        z[2, 4] = ~z[2, 4] if dtype == torch.bool else -z[2, 4]
        assert describe(y, contents=True) != describe(z, contents=True), dtype
        assert describe(y) == describe(z)  # without contents: shape, dtype, device only
