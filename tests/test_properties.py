"""Invariants, checked on random shapes and masks with hypothesis."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)  # same examples in CI


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 3))
    L, S = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    D = draw(st.sampled_from([1, 3, 8]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g) * draw(st.sampled_from([0.1, 1.0, 30.0]))
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    mask = torch.rand(B, 1, L, S, generator=g) < draw(st.floats(0.0, 1.0))
    return q, k, v, mask


@SETTINGS
@given(problems())
def test_rows_sum_to_one_or_zero_and_hidden_weights_are_exactly_zero(problem):
    q, k, _, mask = problem
    w = ak.attention_probs(q, k, mask)
    sums = w.sum(-1)
    sees = mask.expand_as(w).any(-1)
    torch.testing.assert_close(sums[sees], torch.ones_like(sums[sees]))
    assert (sums[~sees] == 0).all()
    assert (w.masked_select(~mask.expand_as(w)) == 0).all()
    assert (w >= 0).all()


@SETTINGS
@given(problems())
def test_backends_agree(problem):
    q, k, v, mask = problem
    ref, ref_lse = ak.attention_with_lse(q, k, v, mask, backend="reference")
    fused, fused_lse = ak.attention_with_lse(q, k, v, mask, backend="sdpa")
    torch.testing.assert_close(fused, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fused_lse, ref_lse, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(
        ak.attention(q, k, v, mask, backend="sdpa"), ref, atol=2e-5, rtol=1e-4
    )


@SETTINGS
@given(problems(), st.randoms(use_true_random=False))
def test_permutation_equivariance_without_positions(problem, rnd):
    q, k, v, _ = problem
    L, S = q.shape[2], k.shape[2]
    q_perm = torch.tensor(rnd.sample(range(L), L))
    kv_perm = torch.tensor(rnd.sample(range(S), S))
    out = ak.attention(q, k, v)
    # permuting queries permutes the output; permuting key/value pairs changes nothing
    moved = ak.attention(q[:, :, q_perm], k[:, :, kv_perm], v[:, :, kv_perm])
    torch.testing.assert_close(moved, out[:, :, q_perm], atol=1e-5, rtol=1e-5)


@SETTINGS
@given(st.integers(1, 12), st.integers(1, 12), st.integers(0, 5), st.integers(0, 5))
def test_sliding_window_and_causal_compose_like_index_arithmetic(L, S, left, right):
    i = torch.arange(L)[:, None] + (S - L)
    j = torch.arange(S)[None, :]
    expected = (j >= i - left) & (j <= i + right) & (j <= i)
    m = ak.sliding_window(left, right, align="bottom_right") & ak.causal(align="bottom_right")
    assert torch.equal(m.materialize(1, 1, L, S)[0, 0], expected)
