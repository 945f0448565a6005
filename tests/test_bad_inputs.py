"""The bad-input matrix: every public entry point fed what a user gets wrong.

Each bad call raises a typed error (`ShapeContractError`, `MaskError`, `ValueError`,
`TypeError`) whose message names the argument, what was expected and what to do; each
unusual but valid call (strided layouts, broadcast masks, B = 0) gives the right result.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attnkit as ak

SCE, ME = ak.ShapeContractError, ak.MaskError


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


q, k, v = t(2, 4, 5, 8), t(2, 2, 5, 8), t(2, 2, 5, 8)
k7, v7 = t(2, 2, 7, 8), t(2, 2, 7, 8)
ones = torch.ones


def cache_then(k2, v2):
    cache = ak.KVCache()
    cache.append(t(1, 2, 3, 4), t(1, 2, 3, 4))
    return cache.append(k2, v2)


# (id, call, error type, what the message must say: the argument, the expectation, the fix)
BAD = [
    # attention: tensors, shapes, dtypes, devices
    (
        "q-not-tensor",
        lambda: ak.attention(q.tolist(), k, v),
        TypeError,
        r"q must be a torch.Tensor",
    ),
    (
        "q-integer",
        lambda: ak.attention(q.long(), k, v),
        TypeError,
        r"q has dtype.*Convert with \.float",
    ),
    (
        "dtype-mix",
        lambda: ak.attention(q, k.double(), v),
        TypeError,
        r"q is torch.float32, k is torch.float64.*cast",
    ),
    ("q-3d", lambda: ak.attention(q[0], k, v), SCE, r"q must have 4 dims.*split_heads"),
    ("batch", lambda: ak.attention(q[:1], k, v), SCE, r"q has B=1, k has B=2.*same batch"),
    ("head-dim", lambda: ak.attention(q, k[..., :4], v), SCE, r"q has D=8 but k has D=4.*project"),
    ("kv-length", lambda: ak.attention(q, k, v[:, :, :4]), SCE, r"k has S=5 keys but v has S=4"),
    ("gqa", lambda: ak.attention(t(2, 3, 5, 8), k, v), SCE, r"H=3 .* Hkv=2 .*\(e\.g\. Hkv in"),
    ("kv-heads", lambda: ak.attention(q, k, v[:, :1]), SCE, r"k has Hkv=2 heads but v has 1"),
    (
        "dtype-mix-is-runtime-error",
        lambda: ak.attention(q, k.double(), v),
        RuntimeError,
        r"dtype mismatch",
    ),
    (
        "device",
        lambda: ak.attention(q, k.to("meta"), v),
        SCE,
        r"k is on meta .* k\.to\(q\.device\)",
    ),
    # attention: masks
    (
        "mask-int",
        lambda: ak.attention(q, k, v, ones(5, 5, dtype=torch.long)),
        ME,
        r"mask has dtype torch.int64.*from_hf_attention_mask",
    ),
    (
        "mask-shape",
        lambda: ak.attention(q, k, v, ones(3, 5, dtype=torch.bool)),
        SCE,
        r"mask of shape .*its L dim is 3, expected 1 or 5",
    ),
    (
        "mask-5d",
        lambda: ak.attention(q, k, v, ones(1, 2, 4, 5, 5, dtype=torch.bool)),
        SCE,
        r"mask has 5 dims.*at most 4",
    ),
    (
        "mask-list",
        lambda: ak.attention(q, k, v, [[True]]),
        TypeError,
        r"mask must be a Mask, a bool tensor .* float tensor",
    ),
    (
        "mask-function",
        lambda: ak.attention(q, k, v, lambda b, h, i, j: i >= j),
        TypeError,
        r"function; wrap it as mask=Mask\.from_mod\(fn\)",
    ),
    (
        "mask-keep-as-float",
        lambda: ak.attention(q, k, v, torch.tril(ones(5, 5))),
        ME,
        r"only 0s and 1s.*m\.bool\(\).*from_additive_mask",
    ),
    (
        "mask-float-plus-inf",
        lambda: ak.attention(q, k, v, torch.zeros(5, 5).fill_diagonal_(math.inf)),
        ME,
        r"holds \+inf.*m\.bool\(\).*from_additive_mask",
    ),
    (
        "mask-float-nan",
        lambda: ak.attention(q, k, v, torch.zeros(5, 5).fill_diagonal_(math.nan)),
        ME,
        r"holds NaN.*from_additive_mask",
    ),
    (
        "mask-causal-bias-size",
        lambda: ak.attention(q, k, v, causal_upper_left(5, 6)),
        SCE,
        r"CausalBias was made for L=5 queries and S=6 keys",
    ),
    (
        "mask-device",
        lambda: ak.attention(q, k, v, ones(5, 5, dtype=torch.bool, device="meta")),
        SCE,
        r"mask is on meta",
    ),
    (
        "causal-l-ne-s",
        lambda: ak.attention(q, k7, v7, ak.causal()),
        SCE,
        r"L=5 queries and S=7 keys.*align='top_left'.*align='bottom_right'",
    ),
    (
        "sliding-l-ne-s",
        lambda: ak.attention(q, k7, v7, ak.sliding_window(2)),
        SCE,
        r"sliding_window\(align=",
    ),
    ("prefix-l-ne-s", lambda: ak.attention(q, k7, v7, ak.prefix_lm(2)), SCE, r"prefix_lm\(align="),
    # attention: options
    (
        "scale-nan",
        lambda: ak.attention(q, k, v, scale=math.nan),
        ValueError,
        r"scale must be a finite number",
    ),
    (
        "scale-str",
        lambda: ak.attention(q, k, v, scale="0.1"),
        TypeError,
        r"scale must be a float, got str",
    ),
    (
        "scale-str-head-dim-zero",
        lambda: ak.attention(q[..., :0], k[..., :0], v, scale="0.1"),
        TypeError,
        r"scale must be a float, got str",
    ),
    (
        "scale-tensor",
        lambda: ak.attention(q, k, v, scale=torch.tensor(0.1)),
        TypeError,
        r"scale must be a float, got Tensor",
    ),
    (
        "softcap-zero",
        lambda: ak.attention(q, k, v, softcap=0.0),
        ValueError,
        r"softcap must be > 0",
    ),
    (
        "softcap-inf",
        lambda: ak.attention(q, k, v, softcap=math.inf),
        ValueError,
        r"softcap must be a finite",
    ),
    (
        "dropout-one",
        lambda: ak.attention(q, k, v, dropout_p=1.0),
        ValueError,
        r"dropout_p must lie in \[0, 1\)",
    ),
    (
        "dropout-negative",
        lambda: ak.attention(q, k, v, dropout_p=-0.1),
        ValueError,
        r"dropout_p must lie in \[0, 1\)",
    ),
    (
        "backend-unknown",
        lambda: ak.attention(q, k, v, backend="flash3"),
        ValueError,
        r"unknown backend 'flash3'; choose one of",
    ),
    (
        "backend-refuses",
        lambda: ak.attention(q, k, v, softcap=5.0, backend="sdpa"),
        ValueError,
        r"'sdpa' cannot serve.*softcap.*backend='auto'",
    ),
    (
        "tiled-bias",
        lambda: ak.attention(q, k, v, t(5, 5), backend="tiled"),
        ValueError,
        r"'tiled' cannot serve.*alibi\(\)",
    ),
    (
        "tiled-dv",
        lambda: ak.attention(q, k, t(2, 2, 5, 4), backend="tiled"),
        ValueError,
        r"D == Dv \(got D=8, Dv=4\)",
    ),
    # attention_with_lse, attention_probs, explain
    (
        "lse-backend",
        lambda: ak.attention_with_lse(q, k, v, backend="nope"),
        ValueError,
        r"unknown backend 'nope'",
    ),
    (
        "lse-dropout-sdpa",
        lambda: ak.attention_with_lse(q, k, v, dropout_p=0.5, backend="sdpa"),
        ValueError,
        r"log-sum-exp has no dropout",
    ),
    (
        "lse-shape",
        lambda: ak.attention_with_lse(q, k, v[:, :, :3]),
        SCE,
        r"k has S=5 keys but v has S=3",
    ),
    (
        "probs-row-high",
        lambda: ak.attention_probs(q, k, rows=[5]),
        SCE,
        r"rows \[5\] fall outside the L=5 query positions \[0, 4\]",
    ),
    (
        "probs-row-negative",
        lambda: ak.attention_probs(q, k, rows=[-1]),
        SCE,
        r"rows \[-1\] fall outside",
    ),
    (
        "probs-row-float",
        lambda: ak.attention_probs(q, k, rows=[0.5]),
        TypeError,
        r"rows must be integer query positions",
    ),
    (
        "probs-mask",
        lambda: ak.attention_probs(q, k, ones(3, 5, dtype=torch.bool)),
        SCE,
        r"its L dim is 3",
    ),
    (
        "explain-backend",
        lambda: ak.explain(q, k, v, backend="x"),
        ValueError,
        r"unknown backend 'x'",
    ),
    (
        "explain-mask-batch",
        lambda: ak.explain(q, k, v, ak.key_padding(torch.tensor([5, 5, 5]))),
        SCE,
        r"key_padding holds 3 batch rows but q has B=2",
    ),
    # mask constructors
    (
        "lengths-negative",
        lambda: ak.key_padding(torch.tensor([-1, 3])),
        ME,
        r"key_padding lengths must be >= 0",
    ),
    (
        "padding-float",
        lambda: ak.key_padding(ones(2, 5)),
        ME,
        r"key_padding takes a \(B, S\) bool.*from_hf_attention_mask",
    ),
    (
        "padding-1d-bool",
        lambda: ak.key_padding(ones(5, dtype=torch.bool)),
        SCE,
        r"\(B, S\) bool tensor, got shape \(5,\); for lengths",
    ),
    (
        "lengths-beyond-s",
        lambda: ak.attention(q, k, v, ak.key_padding(torch.tensor([6, 3]))),
        ME,
        r"exceed S=5 keys; each length must lie in \[0, S\]",
    ),
    (
        "padding-batch",
        lambda: ak.attention(q, k, v, ak.key_padding(torch.tensor([1, 2, 3]))),
        SCE,
        r"give one row per batch element",
    ),
    (
        "padding-width",
        lambda: ak.attention(q, k, v, ak.key_padding(ones(2, 4, dtype=torch.bool))),
        SCE,
        r"covers 4 keys but k has S=5",
    ),
    ("window-negative", lambda: ak.sliding_window(-1), ME, r"left=-1 is negative.*left >= 0"),
    ("window-float", lambda: ak.sliding_window(2.5), TypeError, r"left must be an int"),
    (
        "window-align",
        lambda: ak.sliding_window(2, align="left"),
        ME,
        r"align='left' is not a causal alignment; use one of",
    ),
    (
        "causal-align",
        lambda: ak.causal(align="center"),
        ME,
        r"align='center'.*'top_left', 'bottom_right'",
    ),
    (
        "document-float",
        lambda: ak.document(ones(5)),
        ME,
        r"document ids must be an integer \(S,\) or \(B, S\)",
    ),
    ("document-3d", lambda: ak.document(ones(1, 1, 5, dtype=torch.long)), ME, r"shape \(1, 1, 5\)"),
    (
        "document-l-ne-s",
        lambda: ak.attention(t(2, 4, 3, 8), k, v, ak.document(torch.zeros(5, dtype=torch.long))),
        SCE,
        r"document\(q_ids, kv_ids\)",
    ),
    (
        "document-length",
        lambda: ak.attention(q, k, v, ak.document(torch.zeros(4, dtype=torch.long))),
        SCE,
        r"one id per position",
    ),
    ("prefix-negative", lambda: ak.prefix_lm(-2), ME, r"prefix_len=-2 is negative"),
    (
        "prefix-float",
        lambda: ak.prefix_lm(ones(2)),
        ME,
        r"prefix_lm takes an int or \(B,\) integer lengths",
    ),
    (
        "prefix-batch",
        lambda: ak.attention(q, k, v, ak.prefix_lm(torch.tensor([1, 2, 3]))),
        SCE,
        r"prefix_lm lengths holds 3 batch rows",
    ),
    (
        "alibi-heads",
        lambda: ak.attention(q, k, v, ak.alibi(3)),
        SCE,
        r"alibi has 3 slopes.*alibi\(4\)",
    ),
    ("alibi-or", lambda: ak.causal() | ak.alibi(4), ME, r"by `&` only, e\.g\. causal\(\) & alibi"),
    ("alibi-not", lambda: ~ak.alibi(4), ME, r"negate masks only"),
    ("alibi-zero-heads", lambda: ak.alibi(0), ValueError, r"num_heads must be >= 1"),
    ("and-nothing", lambda: ak.and_masks(), ME, r"and_masks needs at least one mask, e\.g\."),
    ("or-nothing", lambda: ak.or_masks(), ME, r"or_masks needs at least one mask, e\.g\."),
    (
        "combine-float",
        lambda: ak.causal() & torch.zeros(5, 5),
        ME,
        r"float tensor is an additive bias.*from_additive_mask",
    ),
    (
        "combine-int",
        lambda: ak.causal() & ones(5, 5, dtype=torch.long),
        ME,
        r"integer masks are ambiguous",
    ),
    (
        "combine-list",
        lambda: ak.causal() & [1],
        TypeError,
        r"mask must be a Mask, a bool tensor .* got list",
    ),
    (
        "draw-ambiguous",
        lambda: ak.causal().draw(2, 5),
        SCE,
        r"alignment is ambiguous.*causal\(offset=n\)",
    ),
    (
        "offset-and-align",
        lambda: ak.causal("bottom_right", offset=2),
        ME,
        r"give align='bottom_right' or offset=2, not both",
    ),
    ("offset-float", lambda: ak.sliding_window(2, offset=1.5), TypeError, r"offset must be an int"),
    ("chunked-zero", lambda: ak.chunked(0), ME, r"size=0"),
    (
        "chunked-l-ne-s",
        lambda: ak.attention(t(2, 4, 3, 8), k, v, ak.chunked(2)),
        SCE,
        r"chunked\(align='top_left'\)",
    ),
    # converters
    (
        "from-kp-float",
        lambda: ak.from_key_padding_mask(torch.zeros(2, 5)),
        ME,
        r"\(B, S\) bool mask \(True = ignore\)",
    ),
    (
        "from-kp-3d",
        lambda: ak.from_key_padding_mask(torch.zeros(2, 1, 5, dtype=torch.bool)),
        ME,
        r"shape \(2, 1, 5\)",
    ),
    (
        "from-hf-float",
        lambda: ak.from_hf_attention_mask(ones(2, 5)),
        ME,
        r"integer or bool tensor of 1 = real token",
    ),
    (
        "from-hf-values",
        lambda: ak.from_hf_attention_mask(torch.tensor([[0, 2]])),
        ME,
        r"only 0 and 1.*key_padding\(m > 0\)",
    ),
    (
        "from-additive-int",
        lambda: ak.from_additive_mask(torch.zeros(2, 5, dtype=torch.long)),
        ME,
        r"takes a float tensor.*pass it directly",
    ),
    (
        "from-additive-bias",
        lambda: ak.from_additive_mask(t(2, 5)),
        ME,
        r"bias, not a visibility mask; pass the float tensor itself",
    ),
    # modules
    (
        "mha-embed",
        lambda: ak.MultiHeadAttention(30, 4),
        ValueError,
        r"embed_dim=30 is not divisible by num_heads=4",
    ),
    (
        "mha-kv-heads",
        lambda: ak.MultiHeadAttention(32, 4, num_kv_heads=3),
        ValueError,
        r"num_heads=4 is not divisible by num_kv_heads=3",
    ),
    (
        "mha-dropout",
        lambda: ak.MultiHeadAttention(32, 4, dropout=1.5),
        ValueError,
        r"dropout must lie in \[0, 1\)",
    ),
    (
        "mha-backend",
        lambda: ak.MultiHeadAttention(32, 4, backend="fast"),
        ValueError,
        r"unknown backend 'fast'",
    ),
    (
        "mha-input-width",
        lambda: ak.MultiHeadAttention(32, 4)(t(2, 5, 16)),
        SCE,
        r"query must be \(B, length, 32\).*embed_dim=32",
    ),
    (
        "mha-input-2d",
        lambda: ak.MultiHeadAttention(32, 4)(t(5, 32)),
        SCE,
        r"query must be \(B, length, 32\) \(batch first\), got shape \(5, 32\)",
    ),
    (
        "mha-kdim",
        lambda: ak.MultiHeadAttention(32, 4, kdim=12)(t(2, 5, 32), t(2, 7, 32)),
        SCE,
        r"key must be \(B, length, 12\).*kdim=12",
    ),
    (
        "mha-kv-length",
        lambda: ak.MultiHeadAttention(32, 4)(t(2, 5, 32), t(2, 7, 32), t(2, 6, 32)),
        SCE,
        r"key and value one length S",
    ),
    (
        "mha-batch",
        lambda: ak.MultiHeadAttention(32, 4)(t(2, 5, 32), t(3, 7, 32)),
        SCE,
        r"one batch size B",
    ),
    (
        "mha-to-torch-gqa",
        lambda: ak.MultiHeadAttention(32, 4, num_kv_heads=2).to_torch(),
        ValueError,
        r"no GQA/MQA",
    ),
    (
        "mha-from-torch-bias-kv",
        lambda: ak.MultiHeadAttention.from_torch(nn.MultiheadAttention(32, 4, add_bias_kv=True)),
        ValueError,
        r"add_bias_kv and add_zero_attn",
    ),
    (
        "sha-embed",
        lambda: ak.SingleHeadAttention(0, 8),
        ValueError,
        r"n_embed and head_dim must be >= 1",
    ),
    (
        "sha-x",
        lambda: ak.SingleHeadAttention(16, 8)(t(2, 6, 12)),
        SCE,
        r"x must be \(B, T, n_embed=16\)",
    ),
    (
        "sha-mask-shape",
        lambda: ak.SingleHeadAttention(16, 8)(t(2, 6, 16), attention_mask=ones(2, 5)),
        SCE,
        r"attention_mask must be \(B, L\) = \(2, 6\)",
    ),
    (
        "sha-mask-values",
        lambda: ak.SingleHeadAttention(16, 8)(t(2, 6, 16), attention_mask=torch.full((2, 6), 0.5)),
        ME,
        r"only 0 and 1",
    ),
    (
        "sha-seed-mask-shape",
        lambda: ak.SingleHeadAttention(16, 8)(t(2, 6, 16), mask=ones(5, 5)),
        SCE,
        r"mask must be \(T, T\) or \(B, T, T\)",
    ),
    # KV cache, RoPE
    (
        "cache-lengths",
        lambda: ak.KVCache().append(t(1, 2, 3, 4), t(1, 2, 2, 4)),
        SCE,
        r"must agree on \(B, Hkv, n\)",
    ),
    (
        "cache-batch",
        lambda: ak.KVCache().append(t(1, 2, 3, 4), t(2, 2, 3, 4)),
        SCE,
        r"must agree on \(B, Hkv, n\)",
    ),
    (
        "cache-rank",
        lambda: ak.KVCache().append(t(2, 3, 4), t(2, 3, 4)),
        SCE,
        r"takes k \(B, Hkv, n, D\).*split_heads",
    ),
    (
        "cache-dtype",
        lambda: ak.KVCache().append(t(1, 2, 3, 4), t(1, 2, 3, 4).double()),
        TypeError,
        r"one dtype and device",
    ),
    (
        "cache-heads-later",
        lambda: cache_then(t(1, 3, 1, 4), t(1, 3, 1, 4)),
        SCE,
        r"holds \(B, Hkv\)=\(1, 2\).*one cache per layer",
    ),
    (
        "cache-crop",
        lambda: ak.KVCache().crop(3),
        ValueError,
        r"crop length must be an int in \[0, 0\]",
    ),
    ("rope-odd", lambda: ak.RotaryEmbedding(15), SCE, r"head_dim=15 must be even"),
    (
        "rope-width",
        lambda: ak.RotaryEmbedding(16).rotate(t(1, 1, 3, 8)),
        SCE,
        r"built for head_dim=16, got x with last dim 8",
    ),
    # seed vocabulary
    (
        "causal-mask-negative",
        lambda: ak.build_causal_mask(-1),
        ValueError,
        r"seq_len must be an int >= 0, got -1",
    ),
    ("causal-mask-float", lambda: ak.build_causal_mask(2.5), ValueError, r"seq_len must be an int"),
    (
        "softmax-mask-shape",
        lambda: ak.masked_softmax(t(2, 3), ones(3, 3, dtype=torch.bool)),
        SCE,
        r"mask of shape \(3, 3\) does not broadcast to scores of shape \(2, 3\)",
    ),
    (
        "softmax-mask-int",
        lambda: ak.masked_softmax(t(2, 3), ones(2, 3, dtype=torch.long)),
        ME,
        r"from_hf_attention_mask",
    ),
    (
        "weights-head-dim",
        lambda: ak.attention_weights(t(3, 4), t(3, 5)),
        SCE,
        r"q has D=4 but k has D=5",
    ),
    (
        "weights-rank",
        lambda: ak.attention_weights(t(3, 4), t(2, 3, 4)),
        SCE,
        r"\(L, D\), \(B, L, D\) or \(B, H, L, D\)",
    ),
    (
        "seed-sdpa-values",
        lambda: ak.scaled_dot_product_attention(t(3, 4), t(3, 4), t(2, 4)),
        SCE,
        r"v needs one value per key",
    ),
    (
        "build-mask-float",
        lambda: ak.build_attention_mask(ones(2, 5), 5, True),
        ME,
        r"key_padding_mask must be bool.*m\.bool\(\)",
    ),
    (
        "build-mask-1d",
        lambda: ak.build_attention_mask(ones(5, dtype=torch.bool), 5, True),
        SCE,
        r"key_padding_mask must be \(B, S\)",
    ),
    (
        "build-mask-causal",
        lambda: ak.build_attention_mask(ones(2, 5, dtype=torch.bool), 3, True),
        SCE,
        r"align='bottom_right'",
    ),
    (
        "contract-mode",
        lambda: ak.check_attention_contract((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1), "both"),
        ValueError,
        r"mode must be one of \('self', 'cross'\)",
    ),
    (
        "contract-size",
        lambda: ak.check_attention_contract((1, 1, 0, 1), (1, 1, 1, 1), (1, 1, 1, 1), "cross"),
        SCE,
        r"q has shape \(1, 1, 0, 1\); every size must be an int >= 1",
    ),
    (
        "score-elements",
        lambda: ak.attention_score_elements(-1, 2, 3),
        ValueError,
        r"batch_size must be an int >= 0, got -1",
    ),
    (
        "split-heads",
        lambda: ak.split_heads(t(2, 5, 30), 4),
        SCE,
        r"E=30 is not divisible by num_heads=4; choose H",
    ),
    ("split-rank", lambda: ak.split_heads(t(5, 32), 4), SCE, r"takes x of shape \(B, L, E\)"),
    ("merge-rank", lambda: ak.merge_heads(t(5, 32)), SCE, r"takes x of shape \(B, H, L, Dh\)"),
    ("alibi-bias-align", lambda: ak.alibi_bias(4, 3, 5), SCE, r"alibi_bias\(align='top_left'\)"),
]


@pytest.mark.parametrize(("call", "error", "words"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_a_typed_error_that_says_what_to_do(call, error, words):
    with pytest.raises(error, match=words) as raised:
        call()
    assert type(raised.value) is not RuntimeError and str(raised.value)[-1] in ".)'`"


def test_the_matrix_is_large():
    assert len(BAD) >= 60


def _reference(q, k, v, mask=None):
    return ak.attention(q.contiguous(), k.contiguous(), v.contiguous(), mask, backend="reference")


UNUSUAL = [
    ("transposed-storage", lambda: (t(2, 5, 4, 8).transpose(1, 2), k, v, None)),
    ("sliced-steps", lambda: (t(2, 4, 10, 16)[:, :, ::2, ::2], k, v, ak.causal())),
    ("expanded-kv", lambda: (q, t(2, 1, 5, 8).expand(2, 2, 5, 8), v, ak.causal())),
    ("expanded-batch", lambda: (t(1, 4, 5, 8).expand(2, 4, 5, 8), k, v, None)),
    ("zero-dim-mask", lambda: (q, k, v, torch.tensor(True))),
    ("mask-broadcast-over-keys", lambda: (q, k, v, ones(2, 1, 5, 1, dtype=torch.bool))),
    (
        "expanded-mask-view",
        lambda: (q, k, v, (torch.rand(1, 1, 5, 5) < 0.7)[..., :1].expand(2, 4, 5, 5)),
    ),
    ("transposed-mask", lambda: (q, k, v, (torch.rand(2, 1, 5, 5) < 0.7).transpose(-1, -2))),
    ("bias-of-another-dtype", lambda: (q, k, v, t(5, 5, dtype=torch.float64))),
    ("padding-of-zero-keys", lambda: (q, k, v, ak.key_padding(torch.tensor([0, 5])))),
    ("head-dim-zero", lambda: (q[..., :0], k[..., :0], v, ak.causal())),
    ("torch-causal-bias", lambda: (q, k, v, causal_lower_right(5, 5))),
    ("float-mask-of-zeros-and-ones-only", lambda: (q, k, v, torch.ones(5, 5))),
]


@pytest.mark.parametrize("backend", ["auto", "sdpa", "tiled", "reference"])
@pytest.mark.parametrize("make", [u[1] for u in UNUSUAL], ids=[u[0] for u in UNUSUAL])
def test_unusual_but_valid_input_gives_the_right_result(make, backend):
    q_, k_, v_, mask = make()
    try:
        got = ak.attention(q_, k_, v_, mask, backend=backend)
    except ValueError as refusal:  # a backend may refuse (a bias on tiled), with a reason
        assert "cannot serve this call" in str(refusal) and backend == "tiled"
        return
    torch.testing.assert_close(got, _reference(q_, k_, v_, mask))


def test_no_rows_asked_gives_an_empty_result():
    assert ak.attention_probs(q, k, rows=[]).shape == (2, 4, 0, 5)


def test_batch_of_zero_gives_an_empty_result():
    out = ak.attention(t(0, 4, 5, 8), t(0, 2, 5, 8), t(0, 2, 5, 8), ak.causal())
    assert out.shape == (0, 4, 5, 8)
