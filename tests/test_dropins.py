"""Drop-ins: `attnkit.sdpa` against torch's SDPA, `attnkit.varlen_attn` against a float64
formula written from torch's documented convention, and the TypeErrors that point a
habit of another library to the attnkit way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.dropins import AuxRequest, sdpa, varlen_attn
from fuzz_dropins import cumulative as _cu
from fuzz_dropins import varlen_formula
from helpers import assert_rule

# (query, key, value) shapes: ranks 2-5, L != S, Dv != D, broadcast batch dims, GQA
SHAPES = {
    "rank2": ((5, 8), (7, 8), (7, 4)),
    "rank3": ((3, 5, 8), (3, 7, 8), (3, 7, 8)),
    "rank4 L<S": ((2, 4, 5, 8), (2, 4, 9, 8), (2, 4, 9, 6)),
    "rank4 L>S": ((2, 4, 9, 8), (2, 4, 5, 8), (2, 4, 5, 8)),
    "rank5": ((2, 3, 2, 6, 8), (2, 3, 2, 6, 8), (2, 3, 2, 6, 8)),
    "batch broadcast": ((2, 4, 5, 8), (1, 4, 7, 8), (1, 4, 7, 8)),
    "GQA": ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)),
    "MQA rank5": ((2, 3, 4, 5, 8), (2, 3, 1, 7, 8), (2, 3, 1, 7, 8)),
}


def _masks(q_shape: tuple[int, ...], S: int, dtype: torch.dtype) -> dict[str, object]:
    g = torch.Generator().manual_seed(1)
    L, lead = q_shape[-2], q_shape[:-2]
    return {
        "none": None,
        "causal": "causal",
        "bool (L, S)": torch.rand(L, S, generator=g) > 0.3,
        "bool (1, S)": torch.rand(1, S, generator=g) > 0.2,
        "bool full": torch.rand(*lead, L, S, generator=g) > 0.4,  # empty rows too
        "bool heads 1": torch.rand(*lead[:-1], 1, L, S, generator=g) > 0.3,
        "float (L, S)": torch.randn(L, S, generator=g).to(dtype),
        "float -inf": torch.where(torch.rand(*lead, L, S, generator=g) > 0.3, 0.0, -torch.inf).to(
            dtype
        ),
    }


def _both(q, k, v, mask, dtype, scale=None):
    causal = isinstance(mask, str)
    attn_mask = None if causal else mask
    gqa = q.dim() >= 3 and q.shape[-3] != k.shape[-3]
    kwargs = {"is_causal": causal, "scale": scale, "enable_gqa": gqa}
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    m = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.to(dtype)
    return inputs, m, kwargs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
def test_sdpa_equals_torch(shapes, dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    for name, mask in _masks(shapes[0], shapes[1][-2], dtype).items():
        if q.dim() < 3 and name in ("bool heads 1",):
            continue
        for scale in (None, 0.3):
            inputs, attn_mask, kwargs = _both(q, k, v, mask, dtype, scale)
            want = F.scaled_dot_product_attention(*inputs, attn_mask, **kwargs)
            got = sdpa(*inputs, attn_mask, **kwargs)
            assert got.shape == want.shape, name
            torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")
            dout = torch.randn_like(want)
            grads = torch.autograd.grad(got, inputs, dout)
            expected = torch.autograd.grad(want, inputs, dout)
            for a, b in zip(grads, expected, strict=True):
                torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name} grad: {m}")


@pytest.mark.parametrize("shapes", [SHAPES["rank4 L<S"], SHAPES["GQA"], SHAPES["rank5"]])
def test_sdpa_bfloat16_within_the_rule_of_torchs_own(shapes):
    """bfloat16: error against float64 at most 2x torch's own bfloat16 SDPA's, + floor,
    outputs and gradients."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    for name, mask in _masks(shapes[0], shapes[1][-2], torch.bfloat16).items():
        truth_in, m64, kwargs = _both(q, k, v, mask, torch.float64)
        half_in, m16, _ = _both(q, k, v, mask, torch.bfloat16)
        truth = F.scaled_dot_product_attention(*truth_in, m64, **kwargs)
        torch_half = F.scaled_dot_product_attention(*half_in, m16, **kwargs)
        ours = sdpa(*half_in, m16, **kwargs)
        assert_rule(f"sdpa bf16 {name}", ours, torch_half, truth)
        dout = torch.randn_like(truth)
        truth_grads = torch.autograd.grad(truth, truth_in, dout)
        torch_grads = torch.autograd.grad(torch_half, half_in, dout.bfloat16())
        our_grads = torch.autograd.grad(ours, half_in, dout.bfloat16())
        for which, got, ref, exact in zip("qkv", our_grads, torch_grads, truth_grads, strict=True):
            assert_rule(f"sdpa bf16 {name} d{which}", got, ref, exact)


def test_sdpa_refuses_what_torch_refuses_and_runs_compiled_fullgraph():
    q = torch.randn(2, 4, 6, 8)
    with pytest.raises(RuntimeError, match="attn_mask should not be set when is_causal"):
        sdpa(q, q, q, torch.ones(6, 6, dtype=torch.bool), is_causal=True)
    with pytest.raises(RuntimeError, match=r"enable_gqa=True"):
        sdpa(q, torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8))  # GQA without the flag
    with pytest.raises(RuntimeError, match=r"must match|leading dims"):
        sdpa(q, torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8))  # no GQA: 4 % 3
    mask = torch.rand(2, 1, 6, 6) > 0.3
    compiled = torch.compile(lambda q, m: sdpa(q, q, q, m), fullgraph=True)
    torch.testing.assert_close(compiled(q, mask), F.scaled_dot_product_attention(q, q, q, mask))
    causal = torch.compile(lambda q: sdpa(q, q, q, is_causal=True, scale=0.2), fullgraph=True)
    want = F.scaled_dot_product_attention(q, q, q, is_causal=True, scale=0.2)
    torch.testing.assert_close(causal(q), want)


def test_sdpa_empty_rows_give_zero_outputs_and_gradients_even_over_nan_keys():
    q, k, v = (torch.randn(1, 2, 3, 4, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[True, False, False], [False, False, False], [True, True, False]])
    with torch.no_grad():
        k[..., 2, :] = torch.nan  # a key no row sees
        v[..., 2, :] = torch.nan
    out = sdpa(q, k, v, mask)
    assert torch.isfinite(out).all() and out[:, :, 1].abs().max() == 0
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


# ------------------------------------------------------------------ varlen_attn


VARLEN = {
    "self": ([5, 7, 3], [5, 7, 3], (-1, -1)),
    "self causal": ([5, 7, 3], [5, 7, 3], (-1, 0)),
    "sliding": ([9, 7, 3], [9, 7, 3], (2, 0)),
    "local both sides": ([9, 7, 3], [9, 7, 3], (2, 1)),
    "cross": ([4, 2, 5], [6, 9, 3], (-1, -1)),
    "decode": ([1, 1, 1], [9, 4, 6], (-1, 0)),
    "chunked prefill": ([3, 2, 4], [9, 4, 6], (-1, 0)),
    "more queries than keys": ([6, 2], [3, 4], (-1, 0)),  # early rows see nothing
}


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("case", VARLEN.values(), ids=VARLEN.keys())
def test_varlen_equals_the_documented_formula(case, heads):
    len_q, len_k, window = case
    H, Hkv = heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(len_q), H, 8, generator=g).requires_grad_()
    k, v = (torch.randn(sum(len_k), Hkv, 8, generator=g).requires_grad_() for _ in range(2))
    cu_q, cu_k = _cu(len_q), _cu(len_k)
    out, lse = varlen_attn(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(len_q),
        max(len_k),
        return_aux=AuxRequest(lse=True),
        window_size=window,
        enable_gqa=H != Hkv,
        scale=0.4,
    )
    want, want_lse = varlen_formula(q, k, v, cu_q, cu_k, window, scale=0.4)
    torch.testing.assert_close(out, want.float())
    torch.testing.assert_close(lse, want_lse.float())
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = torch.autograd.grad(want, (q, k, v), dout.double())
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b.float())


def test_varlen_reads_paged_keys_in_shuffled_pages():
    g = torch.Generator().manual_seed(0)
    H, Hkv, D, page = 4, 2, 8, 4
    used, len_q = [9, 5, 12], [1, 3, 2]
    keys, values = ([torch.randn(n, Hkv, D, generator=g) for n in used] for _ in range(2))
    count = [-(-n // page) for n in used]
    order = torch.randperm(sum(count) + 3, generator=g)  # the pool holds unused pages too
    pool_k, pool_v = (torch.randn(len(order), page, Hkv, D, generator=g) for _ in range(2))
    table = torch.zeros(len(used), max(count), dtype=torch.int32)
    taken = iter(order.tolist())
    for n, length in enumerate(used):
        for p in range(count[n]):
            table[n, p] = pid = next(taken)
            rows = slice(p * page, min(length, (p + 1) * page))
            pool_k[pid, : rows.stop - rows.start] = keys[n][rows]
            pool_v[pid, : rows.stop - rows.start] = values[n][rows]
    q = torch.randn(sum(len_q), H, D, generator=g)
    seqused = torch.tensor(used, dtype=torch.int32)
    got = varlen_attn(
        q,
        pool_k,
        pool_v,
        _cu(len_q),
        None,
        3,
        12,
        window_size=(-1, 0),
        enable_gqa=True,
        seqused_k=seqused,
        block_table=table,
    )
    # the same keys packed, each sequence's tail past seqused_k poisoned: never read
    packed_k, packed_v = (
        torch.cat([torch.cat([t, t.new_full((2, Hkv, D), torch.nan)]) for t in ts])
        for ts in (keys, values)
    )
    cu_k = _cu([n + 2 for n in used])
    want, _ = varlen_formula(q, packed_k, packed_v, _cu(len_q), cu_k, (-1, 0), used=used)
    torch.testing.assert_close(got, want.float())
    also = varlen_attn(
        q,
        packed_k,
        packed_v,
        _cu(len_q),
        cu_k,
        3,
        14,
        window_size=(-1, 0),
        enable_gqa=True,
        seqused_k=seqused,
    )
    torch.testing.assert_close(also, got)


def test_varlen_refuses_as_torch_does_and_runs_compiled_fullgraph():
    q, k = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    cu = _cu([2, 4])
    with pytest.raises(ValueError, match="Try setting enable_gqa=True"):
        varlen_attn(q, k, k, cu, cu, 4, 4)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        varlen_attn(q, torch.randn(6, 3, 8), torch.randn(6, 3, 8), cu, cu, 4, 4, enable_gqa=True)
    with pytest.raises(ValueError, match="cu_seq_q must rise"):
        varlen_attn(q, q, q, _cu([2, 3]), _cu([2, 3]), 3, 3)
    fn = torch.compile(
        lambda q, k, cu: varlen_attn(q, k, k, cu, cu, 4, 4, window_size=(-1, 0), enable_gqa=True),
        fullgraph=True,
    )
    want, _ = varlen_formula(q, k, k, cu, cu, (-1, 0))
    torch.testing.assert_close(fn(q, k, cu), want.float())


# ------------------------------------------------------------------ habits


@pytest.mark.parametrize(
    ("call", "word", "hint"),
    [
        (lambda q: ak.attention(q, q, q, is_causal=True), "is_causal", "ak.causal()"),
        (lambda q: ak.attention(q, q, q, attn_mask=None), "attn_mask", "mask="),
        (lambda q: ak.attention(q, q, q, need_weights=True), "need_weights", "attention_probs"),
        (lambda q: ak.attention_with_lse(q, q, q, is_causal=True), "is_causal", "attnkit.sdpa"),
        (lambda q: ak.explain(q, q, q, enable_gqa=True), "enable_gqa", "head counts"),
        (lambda q: ak.attention(q, q, q, causal=True), "causal", "bottom_right"),
    ],
)
def test_keywords_of_other_libraries_name_the_attnkit_way(call, word, hint):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match=word) as info:
        call(q)
    assert hint in str(info.value)


def test_multihead_attention_points_nn_multihead_keywords_to_masks():
    module = ak.MultiHeadAttention(16, 2)
    x = torch.randn(2, 3, 16)
    for word, hint in (
        ("key_padding_mask", "from_key_padding_mask"),
        ("attn_mask", "True = ignore"),
        ("need_weights", "attention_probs"),
    ):
        with pytest.raises(TypeError, match=word) as info:
            module(x, **{word: None})
        assert hint in str(info.value)
    with pytest.raises(TypeError, match="unexpected keyword"):  # not a habit: Python's own
        module(x, nonsense=1)


def test_row_spans_is_a_mask_of_its_intervals_on_every_backend():
    from attnkit.masks import row_spans

    lo, hi = torch.tensor([[0, 0, 2, 5, 1], [3, 1, 0, 0, 4]]), torch.tensor([[1, 4, 2, 7, 6]] * 2)
    mask = row_spans(lo, hi)
    dense = mask.materialize(2, 1, 5, 7)[:, 0]
    j = torch.arange(7)
    assert torch.equal(dense, (j >= lo[..., None]) & (j < hi[..., None]))
    assert not dense[0, 2].any()  # hi <= lo: a row that sees nothing
    q, k, v = (torch.randn(2, 2, n, 8) for n in (5, 7, 7))
    want = ak.attention(q, k, v, dense[:, None], backend="reference")
    for backend in ("auto", "tiled", "sdpa", "reference"):
        torch.testing.assert_close(ak.attention(q, k, v, mask, backend=backend), want)
    with pytest.raises(ak.MaskError, match="integer"):
        row_spans(lo.float(), hi)
    with pytest.raises(ak.MaskError, match="one shape"):
        row_spans(lo, hi[:, :3])
    with pytest.raises(ak.ShapeContractError, match="one span per query row"):
        ak.attention(torch.randn(2, 2, 4, 8), k, v, mask)


def test_varlen_with_paged_keys_runs_compiled_fullgraph():
    g = torch.Generator().manual_seed(5)
    pool = torch.randn(6, 4, 2, 8, generator=g)  # (pages, page_size, Hkv, D)
    table = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    used = torch.tensor([6, 3], dtype=torch.int32)
    q, cu = torch.randn(2, 4, 8, generator=g), _cu([1, 1])

    def decode(q, pool, table, used):
        return varlen_attn(
            q,
            pool,
            pool,
            cu,
            None,
            1,
            8,
            window_size=(-1, 0),
            enable_gqa=True,
            seqused_k=used,
            block_table=table,
        )

    compiled = torch.compile(decode, fullgraph=True)
    torch.testing.assert_close(compiled(q, pool, table, used), decode(q, pool, table, used))


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
@pytest.mark.parametrize("size", [(512, 4, 64), (37, 3, 16), (6, 1, 8)], ids=str)
def test_varlen_returns_out_and_lse_contiguous_in_torchs_layout(size, grad):
    T, H, D = size  # at (512, 4, 64) the output came back with strides (64, 32768, 1)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(T, H, D, generator=g).requires_grad_(grad)
    cu = _cu([T // 3, T - T // 3])
    with torch.set_grad_enabled(grad):
        out, lse = varlen_attn(
            q, q, q, cu, cu, T, T, return_aux=AuxRequest(lse=True), window_size=(-1, 0)
        )
    assert out.shape == (T, H, D) and lse.shape == (T, H)
    assert out.is_contiguous() and lse.is_contiguous()
    assert out.view(-1, H * D).shape == (T, H * D)  # the reshape models do next
    if grad:  # through the view, against the float64 formula
        dout = torch.randn(T, H * D, generator=g)
        (got,) = torch.autograd.grad(out.view(-1, H * D), q, dout)
        wide = q.detach().double().requires_grad_()
        want, _ = varlen_formula(wide, wide, wide, cu, cu, (-1, 0))
        (expected,) = torch.autograd.grad(want, wide, dout.double().view(T, H, D))
        torch.testing.assert_close(got, expected.float())


def _paged_pool(g):
    """Three pages of 256 slots (pages, page_size, Hkv, D), one query, and a table of page 1."""
    pool_k, pool_v = (torch.randn(3, 256, 2, 8, generator=g) for _ in range(2))
    return pool_k, pool_v, torch.randn(1, 2, 8, generator=g), torch.tensor([[1]], dtype=torch.int32)


@pytest.mark.parametrize(
    ("used", "table", "words"),
    [
        (257, None, r"sequence 0 has 257 positions \(seqused_k\[0\]\)"),  # past its one page
        (600, [[0, 2]], "at least 3 pages per row"),
        (10, [[3]], r"block_table\[0, 0\] = 3 is no page of the pool \(ids 0 to 2: 3 pages\)"),
        (10, [[-1]], r"block_table\[0, 0\] = -1 is no page"),
        (300, [[0, 9]], r"block_table\[0, 1\] = 9"),  # its second entry is in use
    ],
)
def test_varlen_refuses_seqused_k_past_its_block_table_or_pages_outside_the_pool(
    used, table, words
):
    g = torch.Generator().manual_seed(7)
    pool_k, pool_v, q, one = _paged_pool(g)
    table = one if table is None else torch.tensor(table, dtype=torch.int32)
    before = pool_k.clone(), pool_v.clone()
    seqused = torch.tensor([used], dtype=torch.int32)
    with pytest.raises(ak.BlockTableError, match=words) as info:
        varlen_attn(
            q, pool_k, pool_v, _cu([1]), None, 1, used, seqused_k=seqused, block_table=table
        )
    assert "block_table" in str(info.value) and isinstance(info.value, ValueError)
    assert torch.equal(pool_k, before[0]) and torch.equal(pool_v, before[1])


def test_varlen_reads_only_the_entries_a_sequence_uses():
    """Entries past ceil(seqused_k / page_size) are not pages in use: anything goes there."""
    g = torch.Generator().manual_seed(8)
    pool_k, pool_v, q, one = _paged_pool(g)
    used = torch.tensor([200], dtype=torch.int32)
    want = varlen_attn(q, pool_k, pool_v, _cu([1]), None, 1, 200, seqused_k=used, block_table=one)
    for junk in (-1, 99):
        table = torch.tensor([[1, junk]], dtype=torch.int32)
        got = varlen_attn(
            q, pool_k, pool_v, _cu([1]), None, 1, 200, seqused_k=used, block_table=table
        )
        torch.testing.assert_close(got, want)
