"""The rows and keys nobody sees, zeroed before a kernel (`attnkit.visibility`)."""

from __future__ import annotations

import torch

import attnkit as ak
from attnkit.contracts import normalize_call
from attnkit.visibility import cleaned, effective_visibility, hide_unseen, zero_unseen


def test_zero_unseen_zeroes_rows_and_gqa_keys_nobody_sees():
    q, k, v = torch.ones(1, 4, 3, 2), torch.ones(1, 2, 5, 2), torch.ones(1, 2, 5, 3)
    rows = torch.tensor([True, False, True]).view(1, 1, 3)  # row 1 sees nothing
    cols = torch.zeros(1, 4, 5, dtype=torch.bool)  # per query head
    cols[0, 1, 0] = True  # query head 1 (K/V head 0) sees key 0
    cols[0, 2, 4] = True  # query head 2 (K/V head 1) sees key 4
    q, k, v = zero_unseen(q, k, v, rows, cols)
    assert torch.equal(q[0, :, 1], torch.zeros(4, 2)) and bool(q[0, :, 0].all())
    seen = torch.tensor([[1.0, 0, 0, 0, 0], [0, 0, 0, 0, 1]])  # (Hkv, S)
    assert torch.equal(k[0, :, :, 0], seen) and torch.equal(v[0, :, :, 0], seen)


def test_hide_unseen_reports_rows_only_where_some_row_sees_nothing():
    q = k = v = torch.ones(1, 1, 2, 2)
    assert hide_unseen(q, k, v, torch.ones(1, 1, 2, 2, dtype=torch.bool))[3] is None
    visible = torch.tensor([[True, True], [False, False]]).view(1, 1, 2, 2)
    assert torch.equal(hide_unseen(q, k, v, visible)[3], torch.tensor([[[True, False]]]))


def test_a_bias_hides_where_it_is_minus_inf():
    bias = torch.tensor([[0.0, -torch.inf]])
    visible = torch.tensor([[True, True]])
    assert torch.equal(effective_visibility(visible, bias), torch.tensor([[True, False]]))
    assert effective_visibility(visible, None) is visible


def test_cleaned_inputs_carry_no_nan_from_keys_nobody_sees():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    k[:, :, 5], v[:, :, 5] = torch.nan, torch.inf  # padding nobody sees
    call = normalize_call(q, k, v, ak.key_padding(torch.tensor([5])))
    q2, k2, v2 = cleaned(call)
    assert torch.isfinite(k2).all() and torch.isfinite(v2).all()
    assert torch.equal(k2[:, :, :5], k[:, :, :5]) and torch.equal(q2, q)
