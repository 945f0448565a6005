"""`Mask.to_block_mask`: FlexAttention's BlockMask from a mask's spans, the same present
and full blocks as `create_block_mask` for every kind and their combinations."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit._compat import flex_attention_module
from attnkit.masks import as_mask, blocks
from attnkit.masks.spans import exact_spans

pytestmark = pytest.mark.skipif(flex_attention_module() is None, reason="no FlexAttention")

B, H = 2, 3


def _masks(L, S):
    g = torch.Generator().manual_seed(L * 1000 + S)
    ids = torch.sort(torch.randint(0, 4, (B, max(L, S)), generator=g)).values
    lengths = torch.tensor([S, S // 3])
    align = "bottom_right" if L != S else None
    return {
        "causal": ak.causal(align=align),
        "causal_offset": ak.causal(offset=-5),
        "sliding": ak.sliding_window(37, align=align),
        "two_sided": ak.sliding_window(20, 9, align=align),
        "chunked": ak.chunked(50, align=align),
        "prefix_lm": ak.prefix_lm(40, align=align),
        "padding": ak.key_padding(lengths),
        "padded_causal": ak.causal(align=align) & ak.key_padding(lengths),
        "documents": ak.document(ids[:, :L], ids[:, :S]),
        "documents_causal": ak.document(ids[:, :L], ids[:, :S]) & ak.causal(align=align),
        "window_or_prefix": ak.sliding_window(10, align=align) | ak.prefix_lm(30, align=align),
        "not_causal": ~ak.causal(align=align),
        "alibi_causal": ak.causal(align=align) & ak.alibi(H, align=align),
        "tensor_per_head": as_mask(torch.rand(1, H, L, S, generator=g) > 0.5),
        "banded_tensor": as_mask((torch.arange(S)[None] - torch.arange(L)[:, None]).abs() < 70),
        "from_mod_per_head": ak.Mask.from_mod(lambda b, h, i, j: (i + j + h) % 3 != 0),
        "nothing": ak.key_padding(torch.tensor([0, 0])),
    }


def _assert_same_blocks(got, want):
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if name.endswith("indices"):  # only the first `count` indices of a row are read
            counts = getattr(want, name.replace("indices", "num_blocks"))
            used = torch.arange(a.shape[-1]) < counts[..., None]
            assert torch.equal(a[used], b[used]), name
        else:
            assert torch.equal(a, b), name
    assert got.BLOCK_SIZE == want.BLOCK_SIZE
    assert got.seq_lengths == want.seq_lengths


@pytest.mark.parametrize("size", [(333, 333), (200, 333), (333, 200), (64, 256)])
@pytest.mark.parametrize("block_size", [128, 64, 48])
def test_to_block_mask_equals_create_block_mask(size, block_size):
    flex = flex_attention_module()
    L, S = size
    for name, mask in _masks(L, S).items():
        if name.endswith("offset") and L != S:
            continue
        got = mask.to_block_mask(B, H, L, S, block_size=block_size)
        want = flex.create_block_mask(
            blocks.mask_mod(mask, B, H, L, S, torch.device("cpu")),
            B,
            H,
            L,
            S,
            device="cpu",
            BLOCK_SIZE=block_size,
        )
        _assert_same_blocks(got, want)


def test_spans_and_chunks_agree_where_both_apply():
    """The span path (no pair evaluated) against evaluating the mask, block by block."""
    L, S = 300, 420
    for name, mask in _masks(L, S).items():
        found = exact_spans(mask, B, L, S)
        if name.endswith("offset") or found is None:
            continue
        spans = [t[:, None] for t in blocks._from_spans(*found, L, S, 32)]
        chunks = blocks._from_chunks(mask, B, H, L, S, 32, torch.device("cpu"))
        for a, b in zip(spans, chunks, strict=True):
            assert torch.equal(a.expand_as(b), b), name


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_with_the_block_mask_equals_the_reference():
    flex = flex_attention_module()
    g = torch.Generator().manual_seed(1)
    L, S = 160, 224
    q = torch.randn(B, H, L, 16, generator=g)
    k, v = torch.randn(B, H, S, 16, generator=g), torch.randn(B, H, S, 16, generator=g)
    lengths = torch.tensor([224, 100])
    mask = ak.sliding_window(40, align="bottom_right") & ak.key_padding(lengths)
    out = flex.flex_attention(q, k, v, block_mask=mask.to_block_mask(B, H, L, S, block_size=32))
    torch.testing.assert_close(out, ak.attention(q, k, v, mask, backend="reference"))


def test_to_block_mask_checks_its_arguments():
    with pytest.raises(ValueError, match="block_size"):
        ak.causal().to_block_mask(1, 1, 64, 64, block_size=0)
    with pytest.raises(ValueError, match="L, S >= 1"):
        ak.causal().to_block_mask(1, 1, 0, 64)
    with pytest.raises(ak.ShapeContractError):
        ak.key_padding(torch.tensor([3, 4])).to_block_mask(3, 1, 8, 8)  # a batch of 2
