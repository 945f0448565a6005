"""The rows and keys nobody sees, zeroed before a kernel (`attnkit.call.visibility`)."""

from __future__ import annotations

import torch

import attnkit as ak
from attnkit.call.visibility import (
    effective_visibility,
    seen_rows_keys,
    zero_unseen,
    zero_unseen_by_visibility,
    zero_unseen_of_call,
)
from attnkit.contracts import normalize_call
from attnkit.masks import structure


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
    assert zero_unseen_by_visibility(q, k, v, torch.ones(1, 1, 2, 2, dtype=torch.bool))[3] is None
    visible = torch.tensor([[True, True], [False, False]]).view(1, 1, 2, 2)
    assert torch.equal(
        zero_unseen_by_visibility(q, k, v, visible)[3], torch.tensor([[[True, False]]])
    )


def test_a_bias_hides_where_it_is_minus_inf():
    bias = torch.tensor([[0.0, -torch.inf]])
    visible = torch.tensor([[True, True]])
    assert torch.equal(effective_visibility(visible, bias), torch.tensor([[True, False]]))
    assert effective_visibility(visible, None) is visible


def test_cleaned_inputs_carry_no_nan_from_keys_nobody_sees():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    k[:, :, 5], v[:, :, 5] = torch.nan, torch.inf  # padding nobody sees
    call = normalize_call(q, k, v, ak.key_padding(torch.tensor([5])))
    q2, k2, v2 = zero_unseen_of_call(call)
    assert torch.isfinite(k2).all() and torch.isfinite(v2).all()
    assert torch.equal(k2[:, :, :5], k[:, :, :5]) and torch.equal(q2, q)


def _prepared_call(q, k, v, mask):
    """The call as `attention()`'s cache prepares it: its derived values kept."""
    from attnkit.call.dispatch import prepared_call

    options = dict(scale=None, softcap=None, dropout_p=0.0, backend="auto", need_lse=False)
    return prepared_call(q, k, v, mask, **options).call(q, k, v, mask)


def test_seen_is_found_once_per_mask_and_size_and_anew_after_an_in_place_change():
    """One home for the rows and keys anybody sees: a repeated call (or an equal mask
    built anew) finds them kept by its prepared call; a mask tensor changed in place is
    looked at again."""
    q, k, v = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 8, 4), torch.randn(2, 2, 8, 4)
    finds: list[int] = []

    def counting(found: tuple[torch.Tensor, torch.Tensor]):
        def find():
            finds.append(1)
            return found

        return find

    window = _prepared_call(
        q, k, v, ak.causal(align="bottom_right") & ak.sliding_window(2, align="bottom_right")
    )
    first = seen_rows_keys(
        window, counting(structure.seen_rows_keys(window.mask, 2, 2, 6, 8))
    )  # then kept
    again = _prepared_call(
        q, k, v, ak.causal(align="bottom_right") & ak.sliding_window(2, align="bottom_right")
    )
    assert seen_rows_keys(again, counting(first)) is first and finds == [1]
    lengths = torch.tensor([8, 3])
    mask = ak.key_padding(lengths)
    keys = seen_rows_keys(_prepared_call(q, k, v, mask))[1]  # (B, 1, S)
    assert torch.equal(keys[1, 0], torch.arange(8) < 3)
    lengths[1] = 5  # in place
    assert torch.equal(seen_rows_keys(_prepared_call(q, k, v, mask))[1][1, 0], torch.arange(8) < 5)
    assert seen_rows_keys(normalize_call(q, k, v, None)) is None  # no mask: everybody sees all


def test_a_backend_may_find_seen_its_own_way_once():
    """`find` (tiled: its plan's blocks) answers a miss; it must equal the structure's."""
    q = k = v = torch.randn(1, 1, 5, 2)
    mask = ak.Mask.from_mod(lambda b, h, i, j: (j == i) & (i != 2), "diagonal but row 2")
    call = normalize_call(q, k, v, mask)
    calls: list[int] = []

    def find():
        calls.append(1)
        return structure.seen_rows_keys(mask, 1, 1, 5, 5)

    rows, keys = seen_rows_keys(call, find)
    assert seen_rows_keys(call, find)[0] is rows and calls == [1]
    want = torch.tensor([True, True, False, True, True])
    assert torch.equal(rows[0, 0], want) and torch.equal(keys[0, 0], want)
