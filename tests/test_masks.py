"""Masks: literal small cases, the algebra, alignment, converters and their errors."""

from __future__ import annotations

import doctest

import pytest
import torch

import attnkit as ak
import attnkit.masks.base
import attnkit.masks.positions
import attnkit.masks.tokens


def grid(mask: ak.Mask, L: int, S: int | None = None, batch: int = 0) -> list[list[int]]:
    S = L if S is None else S
    B = mask.batch_size or 1
    return mask.materialize(B, 1, L, S)[batch, 0].int().tolist()


def test_docstring_drawings_are_the_real_masks():
    flags = doctest.NORMALIZE_WHITESPACE
    names = {"causal": ak.causal, "torch": torch}  # the examples combine kinds of both files
    result = doctest.testmod(attnkit.masks.positions, optionflags=flags, extraglobs=names)
    assert result.attempted >= 8 and result.failed == 0
    result = doctest.testmod(attnkit.masks.tokens, optionflags=flags, extraglobs=names)
    assert result.attempted >= 4 and result.failed == 0
    result = doctest.testmod(attnkit.masks.base, optionflags=flags)
    assert result.attempted >= 1 and result.failed == 0


@pytest.mark.parametrize(("L", "S"), [(3, 3), (2, 5), (5, 2), (1, 4)])
def test_offset_names_each_alignment_and_any_other_diagonal(L, S):
    for make in (
        lambda **kw: ak.causal(**kw),
        lambda **kw: ak.sliding_window(1, 1, **kw),
        lambda **kw: ak.prefix_lm(1, **kw),
        lambda **kw: ak.chunked(2, **kw),
    ):
        assert grid(make(offset=0), L, S) == grid(make(align="top_left"), L, S)
        assert grid(make(offset=S - L), L, S) == grid(make(align="bottom_right"), L, S)
    for n in (-2, 1, 3):  # j <= i + n, wherever that falls
        expected = [[int(j <= i + n) for j in range(S)] for i in range(L)]
        assert grid(ak.causal(offset=n), L, S) == expected


def test_chunked_literal_and_with_causal():
    assert grid(ak.chunked(3), 5) == [
        [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]
    ]  # fmt: skip
    # a static cache: 2 queries at positions 4 and 5 of 8 slots, chunks of 3
    got = grid(ak.chunked(3, offset=4) & ak.causal(offset=4), 2, 8)
    assert got == [[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1, 0, 0]]
    assert str(ak.chunked(3, offset=4)) == "chunked(3, offset=4)"
    assert str(ak.causal(offset=-1)) == "causal(offset=-1)"


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


def test_causal_literal():
    assert grid(ak.causal(), 3) == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize(
    ("align", "expected"),
    [
        ("top_left", [[1, 0, 0, 0], [1, 1, 0, 0]]),
        ("bottom_right", [[1, 1, 1, 0], [1, 1, 1, 1]]),
    ],
)
def test_causal_alignment_when_l_lt_s(align, expected):
    assert grid(ak.causal(align=align), 2, 4) == expected


def test_causal_bottom_right_with_l_gt_s_leaves_first_rows_empty():
    assert grid(ak.causal(align="bottom_right"), 3, 2) == [[0, 0], [1, 0], [1, 1]]


def test_causal_decode_step_sees_every_cached_key():
    assert grid(ak.causal(align="bottom_right"), 1, 5) == [[1, 1, 1, 1, 1]]


def test_causal_never_guesses_alignment():
    with pytest.raises(ak.ShapeContractError, match=r"top_left.*bottom_right"):
        ak.causal().materialize(1, 1, 2, 3)


def test_bad_alignment_name():
    with pytest.raises(ak.MaskError, match="top_left"):
        ak.causal(align="top-left")  # type: ignore[arg-type]


def test_sliding_window_is_inclusive():
    m = ak.sliding_window(2, 1)
    rows = torch.tensor(grid(m, 8))
    assert rows[4].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]  # left + 1 + right = 4 keys
    assert rows.sum(-1).tolist() == [2, 3, 4, 4, 4, 4, 4, 3]


def test_sliding_window_bottom_right():
    assert grid(ak.sliding_window(1, align="bottom_right"), 2, 5) == [
        [0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1],
    ]


def test_negative_window_is_refused():
    with pytest.raises(ak.MaskError, match="left=-1"):
        ak.sliding_window(-1)
    with pytest.raises(ak.MaskError, match="right=-2"):
        ak.sliding_window(1, -2)


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


def test_prefix_lm_literal_and_batched():
    assert grid(ak.prefix_lm(2), 4)[0] == [1, 1, 0, 0]
    batched = ak.prefix_lm(torch.tensor([1, 3]))
    assert grid(batched, 4, batch=1)[0] == [1, 1, 1, 0]
    assert grid(batched, 4, batch=0)[0] == [1, 0, 0, 0]


def test_algebra_matches_tensor_logic():
    a, b = ak.causal(), ak.sliding_window(1, 1)
    ta, tb = a.materialize(1, 1, 5, 5), b.materialize(1, 1, 5, 5)
    assert torch.equal((a & b).materialize(1, 1, 5, 5), ta & tb)
    assert torch.equal((a | b).materialize(1, 1, 5, 5), ta | tb)
    assert torch.equal((~a).materialize(1, 1, 5, 5), ~ta)
    assert torch.equal(ak.and_masks(a, b, ~a).materialize(1, 1, 5, 5), ta & tb & ~ta)
    assert torch.equal(ak.or_masks(a, b).materialize(1, 1, 5, 5), ta | tb)


def test_masks_combine_with_bool_tensors_on_either_side():
    t = torch.rand(5, 5) > 0.5
    causal = ak.causal().materialize(1, 1, 5, 5)[0, 0]
    assert torch.equal((ak.causal() & t).materialize(1, 1, 5, 5)[0, 0], causal & t)
    assert torch.equal((t | ak.causal()).materialize(1, 1, 5, 5)[0, 0], causal | t)


def test_float_tensor_cannot_join_the_algebra():
    with pytest.raises(ak.MaskError, match="additive bias"):
        _ = ak.causal() & torch.zeros(3, 3)


def test_dense_is_minimal_and_materialize_is_full():
    m = ak.causal() & ak.key_padding(torch.tensor([3, 2]))
    assert m.dense(2, 4, 3, 3).shape == (2, 1, 3, 3)
    assert ak.causal().dense(2, 4, 3, 3).shape == (1, 1, 3, 3)
    assert m.materialize(2, 4, 3, 3).shape == (2, 4, 3, 3)


def test_tensor_mask_broadcast_error_names_the_dim():
    with pytest.raises(ak.ShapeContractError, match="its S dim is 4"):
        (ak.causal() & torch.ones(3, 4, dtype=torch.bool)).materialize(1, 1, 3, 3)


def test_descriptions_read_well():
    m = (ak.causal() & ak.sliding_window(3)) | ak.prefix_lm(2)
    assert str(m) == "((causal() & sliding_window(left=3, right=0)) | prefix_lm(2))"
    assert "key_padding" in str(ak.key_padding(torch.tensor([1])))


def test_draw_marks_allowed_and_hidden():
    assert ak.causal().draw(2) == "■ ·\n■ ■"


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


def test_draw_of_a_mask_with_alibi_shows_its_visibility():
    assert (ak.alibi(4) & ak.causal()).draw(2) == "■ ·\n■ ■"
