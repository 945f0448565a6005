"""docs/migration.md: each "before" equals its drop-in and attnkit's own call, as shown."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.dropins import AuxRequest, varlen_attn
from attnkit.flash_attn import flash_attn_func
from fuzz_dropins import flash_formula


def test_sdpa_before_drop_in_and_attnkit_agree():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 6, 16, generator=g)
    k, v = (torch.randn(2, 2, 6, 16, generator=g) for _ in range(2))
    lengths = torch.tensor([6, 4])
    mask = (ak.causal() & ak.key_padding(lengths)).dense(2, 1, 6, 6)
    before = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(ak.sdpa(q, k, v, attn_mask=mask, enable_gqa=True), before)
    torch.testing.assert_close(ak.attention(q, k, v, ak.causal() & ak.key_padding(lengths)), before)


def test_multihead_attention_before_and_after_agree():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 32)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])  # True = ignore
    causal_bool = torch.ones(5, 5, dtype=torch.bool).triu(1)  # True = ignore
    before, _ = mha(x, x, x, key_padding_mask=pad, attn_mask=causal_bool)
    after = ak.MultiHeadAttention.from_torch(mha)(
        x, mask=ak.from_key_padding_mask(pad) & ak.causal()
    )
    torch.testing.assert_close(after, before)


def test_flash_attention_before_drop_in_and_attnkit_agree():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 4, 8, generator=g)  # (B, L, H, D), L < S
    k, v = (torch.randn(2, 9, 4, 8, generator=g) for _ in range(2))
    drop_in = flash_attn_func(q, k, v, causal=True, window_size=(3, 0), softcap=3.0)
    before = torch.stack(
        [
            flash_formula(q[b], k[b], v[b], causal=True, window=(3, 0), softcap=3.0)[0]
            for b in range(2)
        ]
    )
    torch.testing.assert_close(drop_in, before.float())
    window = ak.sliding_window(3, align="bottom_right")
    own = ak.attention(*(t.transpose(1, 2) for t in (q, k, v)), window, softcap=3.0)
    torch.testing.assert_close(own.transpose(1, 2), drop_in)


def test_varlen_drop_in_and_attnkit_document_mask_agree():
    g = torch.Generator().manual_seed(2)
    lengths = torch.tensor([3, 5, 2])
    q, k, v = (torch.randn(10, 4, 8, generator=g) for _ in range(3))
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
    out, lse = varlen_attn(
        q, k, v, cu, cu, 5, 5, window_size=(-1, 0), return_aux=AuxRequest(lse=True)
    )
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    own = ak.attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        ak.document(ids) & ak.causal(),
    )[0].transpose(0, 1)
    torch.testing.assert_close(own, out)
    assert lse.shape == (10, 4)


def test_flash_alibi_slopes_are_attnkits_alibi_bottom_right():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 3, 4, 8, generator=g)
    k, v = (torch.randn(1, 7, 4, 8, generator=g) for _ in range(2))
    drop_in = flash_attn_func(q, k, v, causal=True, alibi_slopes=ak.alibi_slopes(4))
    mask = ak.causal(align="bottom_right") & ak.alibi(4, align="bottom_right")
    own = ak.attention(*(t.transpose(1, 2) for t in (q, k, v)), mask)
    torch.testing.assert_close(own.transpose(1, 2), drop_in)


def test_the_tuple_return_is_the_first_difference_listed_and_is_what_the_page_says():
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "migration.md").read_text()
    section = page.split("## `torch.nn.MultiheadAttention`")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    assert "returns `(out, weights)`" in rows[1]  # rows[0] is the header
    mha = ak.MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16)
    out, _ = mha(x, x, x)  # the habit unpacks the batch, silently, as the page warns
    torch.testing.assert_close(out, mha(x)[0])
