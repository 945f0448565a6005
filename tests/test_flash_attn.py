"""attnkit.flash_attn against a float64 formula written from flash-attention's documented
conventions: causal bottom-right, the window around i + S - L, softcap on the scaled
scores, ALiBi `-slope · |i + S - L - j|`, GQA by head count, lse of the scaled scores."""

from __future__ import annotations

import pytest
import torch

from attnkit import BlockTableError, ShapeContractError
from attnkit.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from fuzz_dropins import cumulative
from fuzz_dropins import flash_formula as formula

OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "causal window": {"causal": True, "window": (3, -1)},
    "local": {"window": (2, 1)},
    "softcap": {"causal": True, "softcap": 2.0},
    "alibi": {"causal": True, "alibi": True},
    "alibi local softcap": {"window": (4, 2), "alibi": True, "softcap": 1.5},
}


def _call_options(opts):
    return {
        "causal": opts.get("causal", False),
        "window_size": opts.get("window", (-1, -1)),
        "softcap": opts.get("softcap", 0.0),
    }


def _formula_options(opts, slopes):
    return {
        "causal": opts.get("causal", False),
        "window": opts.get("window", (-1, -1)),
        "softcap": opts.get("softcap", 0.0),
        "slopes": slopes,
    }


@pytest.mark.parametrize("sizes", [(5, 5), (3, 8), (7, 4)], ids=["L=S", "L<S", "L>S"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("name", OPTIONS)
def test_flash_attn_func_equals_the_formula(name, heads, sizes):
    opts, (H, Hkv), (L, S), B = OPTIONS[name], heads, sizes, 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, L, H, 8, generator=g).requires_grad_()
    k, v = (torch.randn(B, S, Hkv, 8, generator=g).requires_grad_() for _ in range(2))
    slopes = torch.rand(B, H, generator=g) if opts.get("alibi") else None  # (B, H)
    out, lse, none = flash_attn_func(
        q,
        k,
        v,
        softmax_scale=0.3,
        alibi_slopes=slopes,
        return_attn_probs=True,
        **_call_options(opts),
    )
    assert none is None and out.shape == (B, L, H, 8) and lse.shape == (B, H, L)
    for b in range(B):
        want, want_lse = formula(
            q[b],
            k[b],
            v[b],
            scale=0.3,
            **_formula_options(opts, None if slopes is None else slopes[b]),
        )
        torch.testing.assert_close(out[b], want.float())
        torch.testing.assert_close(lse[b], want_lse.float())
        dout = torch.randn_like(out[b])
        grads = torch.autograd.grad(out[b], (q, k, v), dout, retain_graph=True)
        expected = torch.autograd.grad(want, (q, k, v), dout.double(), retain_graph=True)
        for a, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(a, e.float())


@pytest.mark.parametrize("name", ["plain", "causal", "local", "alibi local softcap"])
@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
def test_flash_attn_varlen_func_equals_the_formula(name, paged):
    opts, H, Hkv, D, page = OPTIONS[name], 4, 2, 8, 4
    len_q, len_k = [3, 1, 6, 0], [5, 9, 6, 2]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(len_q), H, D, generator=g).requires_grad_()
    k, v = (torch.randn(sum(len_k), Hkv, D, generator=g).requires_grad_() for _ in range(2))
    slopes = torch.rand(len(len_q), H, generator=g) if opts.get("alibi") else None
    cu_q, cu_k = cumulative(len_q), cumulative(len_k)
    keys, values, table = k, v, None
    if paged:  # each sequence's keys in pages of a shuffled pool
        count = [-(-n // page) for n in len_k]
        order = torch.randperm(sum(count), generator=g)
        table = torch.zeros(len(len_k), max(count), dtype=torch.int32)
        keys, values = (torch.zeros(sum(count), page, Hkv, D) for _ in range(2))
        taken = iter(order.tolist())
        for n, length in enumerate(len_k):
            for p in range(count[n]):
                table[n, p] = pid = next(taken)
                rows = slice(int(cu_k[n]) + p * page, int(cu_k[n]) + min(length, (p + 1) * page))
                keys[pid, : rows.stop - rows.start] = k[rows].detach()
                values[pid, : rows.stop - rows.start] = v[rows].detach()
    out, lse, _ = flash_attn_varlen_func(
        q,
        keys,
        values,
        cu_q,
        cu_k,
        max(len_q),
        max(len_k),
        softmax_scale=0.4,
        alibi_slopes=slopes,
        return_attn_probs=True,
        block_table=table,
        **_call_options(opts),
    )
    assert lse.shape == (H, sum(len_q))
    for n in range(len(len_q)):
        rows, cols = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        want, want_lse = formula(
            q[rows],
            k[cols],
            v[cols],
            scale=0.4,
            **_formula_options(opts, None if slopes is None else slopes[n]),
        )
        torch.testing.assert_close(out[rows], want.float())
        torch.testing.assert_close(lse[:, rows], want_lse.float())
    if not paged:
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        outs = [
            formula(
                q[cu_q[n] : cu_q[n + 1]],
                k[cu_k[n] : cu_k[n + 1]],
                v[cu_k[n] : cu_k[n + 1]],
                scale=0.4,
                **_formula_options(opts, None if slopes is None else slopes[n]),
            )[0]
            for n in range(len(len_q))
        ]
        expected = torch.autograd.grad(torch.cat(outs), (q, k, v), dout.double())
        for a, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(a, e.float())


def _rotary(x, cos, sin, positions, interleaved):
    """flash-attention's rotary on the first 2·cos.shape[1] dims, one sequence (n, H, D)."""
    half = cos.shape[1]
    out = x.clone().double()
    c, s = cos[positions][:, None].double(), sin[positions][:, None].double()
    if interleaved:
        a, b = x[..., 0 : 2 * half : 2].double(), x[..., 1 : 2 * half : 2].double()
        out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., :half].double(), x[..., half : 2 * half].double()
        out[..., :half], out[..., half : 2 * half] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("paged", [False, True], ids=["rows", "paged"])
@pytest.mark.parametrize("rotary", [None, True, False], ids=["no rotary", "interleaved", "neox"])
@pytest.mark.parametrize("name", ["causal", "causal window", "alibi local softcap", "plain"])
def test_flash_attn_with_kvcache_appends_in_place_and_equals_the_formula(name, rotary, paged):
    opts, B, H, Hkv, D, L, page = OPTIONS[name], 3, 4, 2, 8, 2, 4
    g = torch.Generator().manual_seed(2)
    seqlens = torch.tensor([5, 0, 9], dtype=torch.int32)
    leftpad = torch.tensor([1, 0, 3], dtype=torch.int32)
    S_cache = 12
    cache_k, cache_v = (torch.randn(B + 1, S_cache, Hkv, D, generator=g) for _ in range(2))
    batch_idx = torch.tensor([2, 0, 3])  # sequence b lives in cache row batch_idx[b]
    q = torch.randn(B, L, H, D, generator=g)
    k, v = (torch.randn(B, L, Hkv, D, generator=g) for _ in range(2))
    cos = sin = None
    if rotary is not None:
        angles = torch.rand(S_cache + 2, 2, generator=g) * 6
        cos, sin = angles.cos(), angles.sin()
    slopes = torch.rand(H, generator=g) if opts.get("alibi") else None
    before_k, before_v = cache_k.clone(), cache_v.clone()
    if paged:  # the same rows in pages: row r, positions p.. -> page table[b, p // page]
        pages = S_cache // page
        table = torch.randperm((B + 1) * pages, generator=g).view(B + 1, pages)[batch_idx]
        pool_k, pool_v = (torch.zeros((B + 1) * pages, page, Hkv, D) for _ in range(2))
        for b in range(B):
            for p in range(pages):
                pool_k[table[b, p]] = cache_k[batch_idx[b], p * page : (p + 1) * page]
                pool_v[table[b, p]] = cache_v[batch_idx[b], p * page : (p + 1) * page]
        args = {"k_cache": pool_k, "v_cache": pool_v, "block_table": table.int()}
    else:
        args = {"k_cache": cache_k, "v_cache": cache_v, "cache_batch_idx": batch_idx.int()}
    out, lse = flash_attn_with_kvcache(
        q,
        k=k,
        v=v,
        rotary_cos=cos,
        rotary_sin=sin,
        cache_seqlens=seqlens,
        cache_leftpad=leftpad,
        softmax_scale=0.5,
        alibi_slopes=slopes,
        rotary_interleaved=bool(rotary),
        return_softmax_lse=True,
        **args,
        **_call_options(opts),
    )
    assert out.shape == (B, L, H, D) and lse.shape == (B, H, L)
    local = opts.get("causal", False) or opts.get("window", (-1, -1)) != (-1, -1)
    for b in range(B):
        start, end = int(seqlens[b]), int(seqlens[b]) + L
        new_k = (
            k[b] if rotary is None else _rotary(k[b], cos, sin, torch.arange(start, end), rotary)
        )
        written = args["k_cache"]
        if paged:
            got_k = torch.cat([written[table[b, p]] for p in range(S_cache // page)])
        else:
            got_k = written[batch_idx[b]]
        torch.testing.assert_close(got_k[start:end], new_k.float())  # written in place
        torch.testing.assert_close(got_k[end:], before_k[batch_idx[b], end:])  # nothing else
        keys = torch.cat([before_k[batch_idx[b], :start], new_k.float()])[int(leftpad[b]) :]
        values = torch.cat([before_v[batch_idx[b], :start], v[b]])[int(leftpad[b]) :]
        positions = torch.arange(start, end) if local else torch.full((L,), start)
        qb = q[b] if rotary is None else _rotary(q[b], cos, sin, positions, rotary).float()
        want, want_lse = formula(qb, keys, values, scale=0.5, **_formula_options(opts, slopes))
        torch.testing.assert_close(out[b], want.float())
        torch.testing.assert_close(lse[b], want_lse.float())


def test_flash_attn_func_runs_compiled_fullgraph():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 6, 4, 8, generator=g) for _ in range(3))
    fn = torch.compile(
        lambda q, k, v: flash_attn_func(q, k, v, causal=True, window_size=(2, 0)), fullgraph=True
    )
    want = torch.stack([formula(q[b], k[b], v[b], causal=True, window=(2, 0))[0] for b in range(2)])
    torch.testing.assert_close(fn(q, k, v), want.float())


def test_flash_attn_varlen_and_kvcache_run_compiled_fullgraph():
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(9, 4, 8, generator=g), torch.randn(12, 2, 8, generator=g)
    cu_q, cu_k = cumulative([4, 5]), cumulative([5, 7])

    def varlen(q, k, cu_q, cu_k):
        return flash_attn_varlen_func(q, k, k, cu_q, cu_k, 5, 7, causal=True)

    torch.testing.assert_close(
        torch.compile(varlen, fullgraph=True)(q, k, cu_q, cu_k), varlen(q, k, cu_q, cu_k)
    )
    cache = torch.randn(2, 10, 2, 8, generator=g)
    q1, k1 = torch.randn(2, 1, 4, 8, generator=g), torch.randn(2, 1, 2, 8, generator=g)
    lengths = torch.tensor([3, 6], dtype=torch.int32)

    def step(q, k_cache, v_cache, k, lengths):
        return flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k, v=k, cache_seqlens=lengths, causal=True
        )

    eager_cache = cache.clone()
    want = step(q1, eager_cache, eager_cache.clone(), k1, lengths)
    compiled_cache = cache.clone()
    got = torch.compile(step, fullgraph=True)(
        q1, compiled_cache, compiled_cache.clone(), k1, lengths
    )
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled_cache, eager_cache)  # the same in-place write


# ------------------------------------------------------------------ contiguous outputs

SIZES = [(512, 4, 64), (37, 3, 16), (6, 1, 8)]  # (T, H, D); 512, 4, 64 came back strided


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "T={} H={} D={}".format(*s))
def test_every_output_is_contiguous_in_its_own_layout(size, grad):
    T, H, D = size
    g = torch.Generator().manual_seed(6)
    with torch.set_grad_enabled(grad):
        q = torch.randn(T, H, D, generator=g).requires_grad_(grad)
        cu = cumulative([T // 3, T - T // 3])
        out, lse, _ = flash_attn_varlen_func(
            q, q, q, cu, cu, T, T, causal=True, return_attn_probs=True
        )
        assert out.shape == (T, H, D) and lse.shape == (H, T)
        assert out.is_contiguous() and lse.is_contiguous()
        assert out.view(-1, H * D).shape == (T, H * D)
        qb = q.view(2, T // 2, H, D) if T % 2 == 0 else q[None]  # (B, L, H, D)
        out, lse, _ = flash_attn_func(qb, qb, qb, causal=True, return_attn_probs=True)
        assert (
            out.is_contiguous() and lse.is_contiguous() and lse.shape == (len(qb), H, T // len(qb))
        )
        assert out.view(-1, H * D).shape == (qb.shape[0] * qb.shape[1], H * D)
    cache = torch.randn(2, T + 1, H, D, generator=g)
    lengths = torch.tensor([T // 2, T], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(
        q[:2, None],
        cache,
        cache.clone(),
        k=q[:2, None].detach(),
        v=q[:2, None].detach(),
        cache_seqlens=lengths,
        return_softmax_lse=True,
    )
    assert out.is_contiguous() and lse.is_contiguous()
    assert out.view(-1, H * D).shape == (2, H * D)


def test_contiguous_outputs_keep_their_gradients():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 5, 4, 8, generator=g, dtype=torch.float64).requires_grad_()
    out = flash_attn_func(q, q, q, causal=True)
    dout = torch.randn(2, 5, 4 * 8, generator=g, dtype=torch.float64)
    (got,) = torch.autograd.grad(out.view(2, 5, 32), q, dout)  # through the view
    want = torch.stack([formula(q[b], q[b], q[b], causal=True)[0] for b in range(2)])
    (expected,) = torch.autograd.grad(want, q, dout.view(2, 5, 4, 8))
    torch.testing.assert_close(got, expected)


# ------------------------------------------------------------------ block_table bounds


def _one_page_pool(g):
    """Three pages of 256 slots (pages, page_size, Hkv, D), and a table listing page 1."""
    pool_k, pool_v = (torch.randn(3, 256, 2, 8, generator=g) for _ in range(2))
    return pool_k, pool_v, torch.tensor([[1]], dtype=torch.int32)


@pytest.mark.parametrize(
    ("seqlen", "new", "table", "words"),
    [
        (257, 0, None, "sequence 0 has 257 positions"),  # reads past the page
        (256, 1, None, "sequence 0 has 257 positions"),  # appends at position 256
        (254, 3, None, r"cache_seqlens\[0\] \+ 3 new keys"),  # an append that crosses the end
        (10, 1, [[3]], r"block_table\[0, 0\] = 3 is no page"),  # past the pool
        (10, 0, [[-1]], r"block_table\[0, 0\] = -1 is no page"),
        (300, 2, [[0, 7]], r"block_table\[0, 1\] = 7"),  # the second page is in use
    ],
)
def test_kvcache_refuses_a_table_too_short_or_outside_the_pool_and_writes_nothing(
    seqlen, new, table, words
):
    g = torch.Generator().manual_seed(8)
    pool_k, pool_v, one = _one_page_pool(g)
    table = one if table is None else torch.tensor(table, dtype=torch.int32)
    before_k, before_v = pool_k.clone(), pool_v.clone()
    k = torch.randn(1, new, 2, 8, generator=g) if new else None
    with pytest.raises(BlockTableError, match=words) as info:
        flash_attn_with_kvcache(
            torch.randn(1, 1, 4, 8, generator=g),
            pool_k,
            pool_v,
            k=k,
            v=k,
            cache_seqlens=torch.tensor([seqlen], dtype=torch.int32),
            block_table=table,
        )
    assert "block_table" in str(info.value) and isinstance(info.value, ValueError)
    assert isinstance(info.value, RuntimeError)  # what flash-attention's own tests match
    assert torch.equal(pool_k, before_k) and torch.equal(pool_v, before_v)  # bitwise unchanged


@pytest.mark.parametrize(("seqlens", "new"), [([3, 8], 1), ([2, 9], 0), ([5, 7], 2)])
def test_kvcache_without_pages_refuses_keys_past_the_cache_and_writes_nothing(seqlens, new):
    g = torch.Generator().manual_seed(10)
    k_cache, v_cache = (torch.randn(2, 8, 2, 4, generator=g) for _ in range(2))  # S_cache 8
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k = torch.randn(2, new, 2, 4, generator=g) if new else None
    with pytest.raises(
        ShapeContractError,
        match=r"sequence 1 needs \d+ cache positions.*"
        r"S_cache=8; give a longer cache",
    ):
        flash_attn_with_kvcache(
            torch.randn(2, 1, 4, 4, generator=g),
            k_cache,
            v_cache,
            k=k,
            v=k,
            cache_seqlens=torch.tensor(seqlens),
        )
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


def test_kvcache_capacity_message_names_the_numbers_and_the_fix():
    g = torch.Generator().manual_seed(9)
    pool_k, pool_v, table = _one_page_pool(g)
    k = torch.randn(1, 1, 2, 8, generator=g)
    with pytest.raises(BlockTableError) as info:
        flash_attn_with_kvcache(
            torch.randn(1, 1, 4, 8, generator=g),
            pool_k,
            pool_v,
            k=k,
            v=k,
            cache_seqlens=256,
            block_table=table,
        )
    text = str(info.value)
    for words in (
        "flash_attn_with_kvcache",
        "sequence 0",
        "257 positions",
        "1 page of 256",
        "256 positions",
        "at least 2 pages per row",
    ):
        assert words in text, text


def test_kvcache_entries_past_a_sequence_may_hold_anything():
    """flash-attention reads only the pages a sequence uses: the rest of its row is free."""
    g = torch.Generator().manual_seed(10)
    pool_k, pool_v = (torch.randn(4, 4, 2, 8, generator=g) for _ in range(2))
    q = torch.randn(1, 1, 4, 8, generator=g)
    lengths = torch.tensor([6], dtype=torch.int32)
    table = torch.tensor([[2, 3]], dtype=torch.int32)  # 6 positions: 2 pages of 4
    want = flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lengths, block_table=table)
    for junk in (99, -5):
        table = torch.tensor([[2, 3, junk]], dtype=torch.int32)
        got = flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lengths, block_table=table)
        torch.testing.assert_close(got, want)


def test_flash_attn_varlen_refuses_a_table_too_short_for_cu_seqlens_k():
    g = torch.Generator().manual_seed(11)
    pool_k, pool_v, table = _one_page_pool(g)
    q, cu_q = torch.randn(1, 4, 8, generator=g), cumulative([1])
    with pytest.raises(BlockTableError, match=r"cu_seqlens_k\[1\] - cu_seqlens_k\[0\]"):
        flash_attn_varlen_func(
            q, pool_k, pool_v, cu_q, cumulative([257]), 1, 257, block_table=table
        )
    with pytest.raises(BlockTableError, match="no page of the pool"):
        flash_attn_varlen_func(
            q,
            pool_k,
            pool_v,
            cu_q,
            cumulative([5]),
            1,
            5,
            block_table=torch.tensor([[3]], dtype=torch.int32),
        )
