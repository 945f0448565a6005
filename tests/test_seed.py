"""The seed chapters' vocabulary: their examples and checks, with their bugs fixed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attnkit as ak


def test_build_causal_mask_is_lower_triangular_bool():
    expected = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    assert torch.equal(ak.build_causal_mask(3), expected)
    assert ak.build_causal_mask(1).tolist() == [[True]]


def test_two_by_two_causal_example_reproduces_the_seed_weights():
    q = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    k = torch.tensor([[1.0, 0.0], [1.0, 2.0]])
    weights = ak.attention_weights(q, k, ak.build_causal_mask(2))
    expected = torch.tensor([[1.0, 0.0], [0.19557033, 0.80442965]])
    torch.testing.assert_close(weights, expected, atol=1e-7, rtol=0)
    assert weights[0, 1].item() == 0.0  # hidden, exactly


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
    def setup_method(self):
        torch.manual_seed(0)
        self.attn = ak.SingleHeadAttention(16, 8)
        self.x = torch.randn(2, 6, 16)

    def test_shapes_and_value_projection(self):
        out, weights = self.attn(self.x)
        assert out.shape == (2, 6, 8) and weights.shape == (2, 6, 6)
        # the seed called self.v_proj(x(x)); values are v_proj(x)
        torch.testing.assert_close(out, weights @ self.attn.v_proj(self.x))

    def test_future_weights_are_exactly_zero(self):
        _, weights = self.attn(self.x)
        T = weights.shape[-1]
        for t in range(T):  # the seed looped over row[T:], which is always empty
            future = weights[:, t, t + 1 :]
            assert future.numel() == 2 * (T - t - 1)
            assert (future == 0).all()

    def test_padded_keys_are_exactly_zero_not_clamped(self):
        mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
        _, weights = self.attn(self.x, attention_mask=mask)
        assert (weights[0, :, 4:] == 0).all()
        assert weights.min() >= 0 and (weights == 0).sum() > 0  # no 1e-6 floor

    def test_fully_masked_row_gives_zeros_and_finite_gradients(self):
        mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
        x = self.x.clone().requires_grad_()
        out, weights = self.attn(x, attention_mask=mask)
        assert (out[0, 0] == 0).all() and (weights[0, 0] == 0).all()  # query 0 sees only key 0
        out.sum().backward()
        assert torch.isfinite(x.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in self.attn.parameters())

    def test_non_causal_matches_torch(self):
        attn = ak.SingleHeadAttention(16, 8, causal=False)
        out, _ = attn(self.x)
        q, k, v = attn.q_proj(self.x), attn.k_proj(self.x), attn.v_proj(self.x)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))

    def test_bad_attention_mask_shape_is_refused(self):
        with pytest.raises(ak.ShapeContractError, match=r"\(B, L\)"):
            self.attn(self.x, attention_mask=torch.ones(2, 5))
