"""The seed chapters' vocabulary: their examples and checks, with their bugs fixed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from helpers import small_qkv

# ------------------------------------------------- the first chapter's checks, Q1 to Q5


def test_q1_weights_and_value_aggregation():
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    k = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    v = torch.tensor([[[10.0, 0.0], [0.0, 20.0]]])
    mask = ak.build_causal_mask(2).unsqueeze(0)
    output, weights = ak.scaled_dot_product_attention(q, k, v, mask=mask)
    expected_weights = torch.tensor([[[1.0, 0.0], [0.19557033, 0.80442965]]])

    assert weights.shape == (1, 2, 2)
    assert output.shape == (1, 2, 2)
    assert torch.allclose(weights, expected_weights, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(output, torch.matmul(expected_weights, v), atol=1e-5, rtol=1e-5)


def test_q1_printed_example_runs_and_matches_attention_weights():
    q = torch.tensor([[[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]])
    k = torch.tensor([[[1.0, 2.0, 0.0], [3.0, 0.0, 1.0]]])
    v = torch.tensor([[[10.0, 0.0], [0.0, 20.0]]])
    mask = ak.build_causal_mask(2).unsqueeze(0)
    weights = ak.attention_weights(q, k, mask=mask)
    output, _ = ak.scaled_dot_product_attention(q, k, v, mask=mask)
    scores = (q @ k.mT / math.sqrt(3)).masked_fill(~mask, -torch.inf)
    torch.testing.assert_close(weights, torch.softmax(scores, -1))
    torch.testing.assert_close(output, weights @ v)


def test_q2_causal_padding_masks_and_stable_softmax():
    key_padding_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    self_mask = ak.build_attention_mask(key_padding_mask, query_length=4, causal=True)
    cross_mask = ak.build_attention_mask(key_padding_mask, query_length=2, causal=False)
    scores = torch.tensor([[1.0, 2.0, 3.0], [9.0, 8.0, 7.0]])
    score_mask = torch.tensor([[True, True, False], [False, False, False]])
    probs = ak.masked_softmax(scores, mask=score_mask)

    expected_causal = torch.tensor(
        [
            [True, False, False, False],
            [True, True, False, False],
            [True, True, True, False],
            [True, True, True, True],
        ]
    )
    assert torch.equal(ak.build_causal_mask(4), expected_causal)
    assert self_mask.shape == (2, 1, 4, 4)
    assert cross_mask.shape == (2, 1, 2, 4)
    assert not self_mask[0, 0, 0, 1]
    assert not self_mask[0, 0, 3, 3]
    assert cross_mask[0, 0, 0].tolist() == [True, True, True, False]
    assert torch.allclose(probs[0].sum(), torch.tensor(1.0))
    assert torch.equal(probs[1], torch.zeros(3))
    assert torch.isfinite(probs).all()


def test_q3_self_and_cross_shape_contracts():
    ok = ak.attention_contract_ok
    assert ok((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 32), mode="self")
    assert ok((2, 4, 3, 16), (2, 4, 8, 16), (2, 4, 8, 32), mode="cross")
    assert not ok((2, 4, 3, 16), (2, 4, 8, 16), (2, 4, 7, 32), mode="cross")
    assert not ok((2, 4, 8), (2, 4, 8, 16), (2, 4, 8, 32), mode="self")
    assert not ok((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 32), mode="unknown")
    # the seed's other refusals: sizes that are not positive ints
    assert not ok((2, 4, 0, 16), (2, 4, 0, 16), (2, 4, 0, 32), mode="self")
    assert not ok((2, 4, 8.0, 16), (2, 4, 8, 16), (2, 4, 8, 32), mode="self")


def test_q4_split_merge_and_multi_head_against_sdpa():
    x = torch.arange(24, dtype=torch.float32).reshape(1, 3, 8)
    heads = ak.split_heads(x, num_heads=2)
    assert tuple(heads.shape) == (1, 2, 3, 4)
    assert torch.equal(ak.merge_heads(heads), x)

    x = torch.arange(24, dtype=torch.float32).reshape(1, 3, 8) / 10
    q = ak.split_heads(x, num_heads=2)
    k = ak.split_heads(x + 0.1, num_heads=2)
    v = ak.split_heads(x - 0.2, num_heads=2)
    manual_output, _ = ak.scaled_dot_product_attention(q, k, v)
    reference_output = F.scaled_dot_product_attention(q, k, v)

    assert q.shape == (1, 2, 3, 4)
    assert torch.equal(ak.merge_heads(ak.split_heads(x, 2)), x)
    assert torch.allclose(manual_output, reference_output, atol=1e-6, rtol=1e-6)


def test_q5_quadratic_growth_and_position_blindness():
    short_scores = ak.attention_score_elements(batch_size=2, num_heads=4, seq_len=8)
    long_scores = ak.attention_score_elements(batch_size=2, num_heads=4, seq_len=16)
    tokens = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]])
    permutation = torch.tensor([2, 0, 1])
    output, _ = ak.scaled_dot_product_attention(tokens, tokens, tokens)
    permuted = tokens[:, permutation]
    permuted_output, _ = ak.scaled_dot_product_attention(permuted, permuted, permuted)

    assert long_scores == 4 * short_scores
    assert torch.allclose(permuted_output, output[:, permutation], atol=1e-6)


# ---------------------------------------------------------- fixes beyond the seed's checks


def test_build_causal_mask_is_lower_triangular_bool():
    expected = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    assert torch.equal(ak.build_causal_mask(3), expected)
    assert ak.build_causal_mask(1).tolist() == [[True]]
    assert ak.build_causal_mask(0).shape == (0, 0)


def test_masked_softmax_is_stable_and_exact_on_hidden_entries():
    scores = torch.tensor([[1000.0, 999.0, -1000.0], [3.0, 2.0, 1.0]])
    mask = torch.tensor([[True, True, False], [False, True, True]])
    w = ak.masked_softmax(scores, mask)
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w[0, :2], torch.softmax(torch.tensor([1.0, 0.0]), -1))
    assert w[0, 2].item() == 0.0 and w[1, 0].item() == 0.0
    torch.testing.assert_close(w.sum(-1), torch.ones(2))


def test_masked_softmax_fully_masked_row_gives_zeros_and_finite_gradient():
    scores = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[False] * 4, [True, True, False, False]])
    w = ak.masked_softmax(scores, mask)
    assert w[0].tolist() == [0.0] * 4
    (w * torch.randn(2, 4)).sum().backward()
    assert torch.isfinite(scores.grad).all()
    assert scores.grad[0].tolist() == [0.0] * 4


def test_masked_softmax_half_precision_is_computed_in_float32():
    scores = torch.tensor([[20.0, 19.0, 0.0]], dtype=torch.float16)
    w = ak.masked_softmax(scores)
    assert w.dtype == torch.float16
    expected = torch.softmax(scores.float(), -1).half()
    assert torch.equal(w, expected)


def test_masked_softmax_refuses_integer_masks_naming_the_converter():
    with pytest.raises(ak.MaskError, match="from_hf_attention_mask"):
        ak.masked_softmax(torch.randn(2, 2), torch.ones(2, 2, dtype=torch.long))


def test_scaled_dot_product_attention_returns_output_and_weights():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 5, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 3)
    out, weights = ak.scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 5, 3) and weights.shape == (2, 5, 7)
    torch.testing.assert_close(out, weights @ v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 5))


def test_attention_weights_default_scale_is_inverse_sqrt_d():
    torch.manual_seed(1)
    q, k = torch.randn(3, 16), torch.randn(4, 16)
    expected = torch.softmax(q @ k.T / math.sqrt(16), -1)
    torch.testing.assert_close(ak.attention_weights(q, k), expected)
    torch.testing.assert_close(ak.attention_weights(q, k, scale=1.0), torch.softmax(q @ k.T, -1))


def test_seed_functions_accept_mask_objects():
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    out, weights = ak.scaled_dot_product_attention(q, k, v, ak.causal())
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert (weights.triu(1) == 0).all()


def test_build_attention_mask_combines_padding_and_causal():
    real = torch.tensor([[True, True, True], [True, True, False]])  # (B, S)
    mask = ak.build_attention_mask(real, 3, causal=True)
    assert mask.shape == (2, 1, 3, 3)
    assert mask[1, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 0]]
    no_causal = ak.build_attention_mask(real, 2, causal=False)
    assert no_causal.shape == (2, 1, 2, 3)
    assert no_causal[1, 0].int().tolist() == [[1, 1, 0], [1, 1, 0]]


def test_build_attention_mask_causal_with_l_ne_s_points_to_alignment():
    with pytest.raises(ak.ShapeContractError, match="align='bottom_right'"):
        ak.build_attention_mask(torch.ones(2, 5, dtype=torch.bool), 3, causal=True)


def test_build_attention_mask_refuses_integers():
    with pytest.raises(ak.MaskError, match="ambiguous"):
        ak.build_attention_mask(torch.ones(2, 5, dtype=torch.long), 5, causal=False)


def test_attention_score_elements_grows_quadratically():
    assert ak.attention_score_elements(2, 4, 10) == 2 * 4 * 10 * 10
    assert ak.attention_score_elements(2, 4, 10, key_len=3) == 2 * 4 * 10 * 3
    assert ak.attention_score_elements(1, 1, 2048) == 4 * ak.attention_score_elements(1, 1, 1024)


class TestSingleHeadAttention:
    """The second chapter's module: its examples and `test_single_head_full`."""

    def setup_method(self):
        torch.manual_seed(0)
        self.attn = ak.SingleHeadAttention(16, 8)
        self.x = torch.randn(2, 6, 16)

    def test_the_chapters_shape_example(self):
        B, T, C = 2, 4, 8
        attn = ak.SingleHeadAttention(C, 8)
        x = torch.randn(B, T, C)
        out, weights = attn(x)
        assert out.shape == (2, 4, 8) and weights.shape == (2, 4, 4)
        torch.testing.assert_close(weights.sum(dim=-1), torch.ones(B, T))
        assert weights.min() >= 0 and weights.max() <= 1

    def test_the_chapters_causal_demo_with_a_float_mask(self):
        T = 5
        causal_mask = torch.tril(torch.ones(T, T))  # the seed's create_causal_mask: 1/0 floats
        attn = ak.SingleHeadAttention(n_embed=8, head_dim=8, causal=False)
        out, weights = attn(torch.randn(1, T, 8), mask=causal_mask)
        assert out.shape == (1, T, 8)
        assert weights[0].triu(diagonal=1).sum().item() == 0.0
        torch.testing.assert_close(weights.sum(-1), torch.ones(1, T))

    def test_single_head_full(self):
        B, T, C = 2, 6, 16
        model = ak.SingleHeadAttention(n_embed=C, head_dim=C)
        x = torch.randn(B, T, C)
        padding_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])
        out, weights = model(x, attention_mask=padding_mask)
        assert out.shape == (B, T, C)
        assert weights.shape == (B, T, T)
        for b in range(B):
            for t in range(T):
                if not padding_mask[b][t]:
                    continue
                row = weights[b][t]
                assert (row[t + 1 :] == 0).all()  # the seed checked row[T:], always empty
                assert (row[~padding_mask[b].bool()] == 0).all()  # exact: no 1e-6 clamp

    def test_seed_parameters_and_checkpoint_load(self):
        seed_state = {
            "q_proj.weight": torch.randn(8, 16),
            "k_proj.weight": torch.randn(8, 16),
            "v_proj.weight": torch.randn(8, 16),
            "proj.weight": torch.randn(16, 8),
            "proj.bias": torch.randn(16),
        }
        self.attn.load_state_dict(seed_state)  # strict: same names and shapes
        out, weights = self.attn(self.x)
        a = self.attn
        v = a.v_proj(self.x)  # the seed called self.v_proj(x(x)); values are v_proj(x)
        torch.testing.assert_close(out, a.proj(weights @ v))

    def test_float_zero_one_attention_mask_works_and_other_values_are_refused(self):
        as_float = torch.tensor([[1.0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
        out_float, w_float = self.attn(self.x, attention_mask=as_float)
        out_bool, w_bool = self.attn(self.x, attention_mask=as_float.bool())
        torch.testing.assert_close(out_float, out_bool)
        torch.testing.assert_close(w_float, w_bool)
        with pytest.raises(ak.MaskError, match="only 0 and 1"):
            self.attn(self.x, attention_mask=as_float * 0.5)

    def test_future_weights_are_exactly_zero(self):
        _, weights = self.attn(self.x)
        T = weights.shape[-1]
        for t in range(T):
            future = weights[:, t, t + 1 :]
            assert future.numel() == 2 * (T - t - 1)
            assert (future == 0).all()

    def test_fully_masked_row_gives_zeros_and_finite_gradients(self):
        mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
        x = self.x.clone().requires_grad_()
        out, weights = self.attn(x, attention_mask=mask)
        assert (weights[0, 0] == 0).all()  # query 0 sees only key 0, which is padding
        torch.testing.assert_close(out[0, 0], self.attn.proj.bias)  # zero values, projected
        out.sum().backward()
        assert torch.isfinite(x.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in self.attn.parameters())

    def test_non_causal_matches_torch(self):
        attn = ak.SingleHeadAttention(16, 8, causal=False)
        out, _ = attn(self.x)
        q, k, v = attn.q_proj(self.x), attn.k_proj(self.x), attn.v_proj(self.x)
        torch.testing.assert_close(out, attn.proj(F.scaled_dot_product_attention(q, k, v)))

    def test_bad_attention_mask_shape_is_refused(self):
        with pytest.raises(ak.ShapeContractError, match=r"\(B, L\)"):
            self.attn(self.x, attention_mask=torch.ones(2, 5))


def test_seed_functions_add_the_alibi_bias_over_the_heads_of_q():
    q, k, _ = small_qkv(B=2, H=4, Hkv=4, L=5, S=5)
    mask = ak.alibi(4) & ak.causal()
    weights = ak.attention_weights(q, k, mask)
    torch.testing.assert_close(weights, ak.attention_probs(q, k, mask), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(weights, ak.attention_weights(q, k, ak.causal()))
    one = ak.attention_weights(q[:, :1], k[:, :1], ak.alibi(1))  # was silently bias-free
    assert not torch.allclose(one, ak.attention_weights(q[:, :1], k[:, :1]))


def test_seed_functions_put_a_batch_mask_on_the_batch_of_three_dim_inputs():
    q, k, _ = small_qkv(B=1, H=2, Hkv=2, L=5, S=5)
    q3, k3 = q[0], k[0]  # (B=2, L, D)
    docs = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    weights = ak.attention_weights(q3, k3, ak.document(docs))
    for b in range(2):
        visible = docs[b][:, None] == docs[b][None, :]
        want = ak.attention_weights(q3[b], k3[b], visible)
        torch.testing.assert_close(weights[b], want)
