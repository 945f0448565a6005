"""The native decoding kernels' edges against float64: the paged kernel over page sizes
that cut a history into runs of every length (one slot a page, pages that straddle the
kernel's batches, pages longer than a batch), awkward head sizes (vector tails in every
dtype), more query heads per K/V head than one register tile holds, K/V heads grouped
when sequences are few, empty sequences, and NaN in slots no sequence reads; the span
kernel's dense call (no spans) against the same call with spans of every key."""

from __future__ import annotations

import pytest
import torch

from attnkit.native import build, ops, unavailable

pytestmark = pytest.mark.skipif(build.setting() == "off", reason="ATTNKIT_NATIVE=off")


@pytest.fixture(autouse=True, scope="module")
def _built() -> None:
    """Where the kernels are meant to run, a failed build fails these tests."""
    assert unavailable() is None, unavailable()


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _paged_case(dtype: torch.dtype, bs: int, G: int, D: int, Dv: int, lengths: list[int]):
    """A pool of scattered pages, NaN wherever no sequence reads, and the float64 truth."""
    g = torch.Generator().manual_seed(bs * 131 + G * 7 + D)
    Hkv, N = 3, len(lengths)
    pages = [-(-n // bs) + 1 for n in lengths]  # one page more than needed: never read
    total = sum(pages)
    keys = torch.full((total * bs, Hkv, D), float("nan"))
    values = torch.full((total * bs, Hkv, Dv), float("nan"))
    order = torch.randperm(total, generator=g)
    blocks, starts, truth_kv = [], [], []
    lo = [min(3, n) for n in lengths]  # a few leading positions unseen, NaN there too
    for i, n in enumerate(lengths):
        ids = order[sum(pages[:i]) : sum(pages[: i + 1])]
        starts.append(len(blocks))
        blocks += ids.tolist()
        slots = (ids[:, None] * bs + torch.arange(bs)).reshape(-1)[lo[i] : n]
        k = torch.randn(len(slots), Hkv, D, generator=g)
        v = torch.randn(len(slots), Hkv, Dv, generator=g)
        keys[slots], values[slots] = k, v
        truth_kv.append((k.to(dtype).double(), v.to(dtype).double()))
    q = torch.randn(N, Hkv * G, D, generator=g).to(dtype)
    table = (torch.tensor(blocks), torch.tensor(starts), torch.tensor(lo), torch.tensor(lengths))
    return q, keys.to(dtype), values.to(dtype), table, truth_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [1, 3, 16, 300])
@pytest.mark.parametrize(("G", "D", "Dv"), [(1, 64, 64), (8, 13, 9), (4, 40, 24)])
def test_paged_kernel_matches_float64_on_every_cut(dtype, bs, G, D, Dv):
    # one-slot pages: a history of two batches; other pages: one of three parts
    lengths = [700, 3, 0, 4500] if bs != 1 else [300, 3, 0, 41]
    q, keys, values, table, truth_kv = _paged_case(dtype, bs, G, D, Dv, lengths)
    out, lse = ops.paged_decode(q, keys, values, *table, bs, 0.3)
    assert out.dtype == dtype and not out.isnan().any() and not lse.isnan().any()
    for i, (k, v) in enumerate(truth_kv):
        if k.shape[0] == 0:  # a sequence with no key: 0 and lse -inf
            assert (out[i] == 0).all() and (lse[i] == float("-inf")).all()
            continue
        s = torch.einsum("hd,shd->hs", q[i].double(), k.repeat_interleave(G, 1)) * 0.3
        want = torch.einsum("hs,shd->hd", torch.softmax(s, -1), v.repeat_interleave(G, 1))
        assert (out[i].double() - want).abs().max() < TOL[dtype] * 4
        assert (lse[i].double() - torch.logsumexp(s, -1)).abs().max() < TOL[dtype] * 8


def test_paged_kernel_groups_heads_alike_for_one_sequence():
    """One short sequence on two threads: its K/V heads split into groups, each head's
    result the same as when the sequence shares the step with others (no groups)."""
    q, keys, values, (blocks, at, lo, hi), _ = _paged_case(torch.float32, 16, 2, 64, 64, [500, 800])
    alone = ops.paged_decode(q[:1], keys, values, blocks, at[:1], lo[:1], hi[:1], 16, 0.2)
    both = ops.paged_decode(q, keys, values, blocks, at, lo, hi, 16, 0.2)
    assert torch.equal(alone[0][0], both[0][0]) and torch.equal(alone[1][0], both[1][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_span_kernel_without_spans_sees_every_key(dtype):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 3, 24, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 77, 24, generator=g).to(dtype) for _ in range(2))
    lo = torch.zeros(2, 3, dtype=torch.long)
    every = ops.row_intervals(lo, lo + 77, 2, 3, 77)
    dense = ops.span_forward(q, k, v, None, 0.2)
    spanned = ops.span_forward(q, k, v, every, 0.2)
    assert torch.equal(dense[0], spanned[0]) and torch.equal(dense[1], spanned[1])


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(
    ("B", "H", "Hkv", "S"),
    [
        (4, 8, 2, 300),  # B·G·bucket(S) = 16·512: the shared reads pay
        (4, 8, 2, 40),  # 16·64
        (1, 8, 2, 1000),  # 4·1024: one sequence's step of a short cache
        (1, 8, 2, 1500),  # 4·2048
        (32, 8, 8, 300),  # MHA, 32·512
        (32, 8, 8, 1500),  # MHA, 32·2048
    ],
)
def test_auto_routes_a_float32_decoding_step_by_its_shared_reads(B, H, Hkv, S, padded):
    """A float32 step whose B·G query heads sharing each key read times the key length's
    bucket reach the CPU kind's threshold (`step_keys`, GQA; `step_keys_mha`) runs on the
    kernel, unpriced, padded or not (the exact result); a shorter one stays with SDPA."""
    import attnkit as ak
    from attnkit import runtime
    from attnkit.call.steps import bucket

    kind = runtime.current().costs.table().kind
    threshold = 8192 if H > Hkv else {"avx512_bf16": 8192}.get(kind, 65536)  # each kind's grid
    backend = "native" if B * H // Hkv * bucket(S) >= threshold else "sdpa"
    mask = ak.causal(align="bottom_right")
    if padded:
        mask = mask & ak.key_padding(torch.arange(B) * 7 % (S // 2) + S // 2)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, H, 1, 32, generator=g)
    k, v = (torch.randn(B, Hkv, S, 32, generator=g) for _ in range(2))
    assert f"backend '{backend}'" in str(ak.explain(q, k, v, mask))
    got = ak.attention(q, k, v, mask)
    want = ak.attention(q, k, v, mask, backend="reference")
    assert (got - want).abs().max() < 1e-5
