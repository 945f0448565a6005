"""paged_attention and PagedLayer (`attnkit.kv.paged`) against a float64 dense
reference: every new token attends to its own sequence's history (causal, bottom-right;
optionally a window), whatever the step mix and the physical block order.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from fuzz_cases import HypothesisDraw
from fuzz_paged import DV, HKV, D, World, dense, program


@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("n", [1, 4, 5, 13])  # 1, block_size, block_size + 1, several blocks
def test_prefill_with_no_history_then_decode(G, n):
    world = World(H=HKV * G)
    s = world.add()
    world.run([s], [n])
    for _ in range(3):
        world.run([s], [1])


def test_a_step_mixes_prefill_chunked_prefill_and_decode_of_many_sequences():
    world = World()
    a, b, c = world.add(), world.add(), world.add()
    world.run([a, b], [7, 1])
    world.run([a, b, c], [1, 6, 11])  # decode, chunked prefill (unaligned), prefill
    world.run([c, a, b], [3, 1, 1])  # any order of sequences in a step
    world.run([b], [0])  # a sequence with nothing new


def test_chunked_prefill_at_unaligned_points_equals_one_shot_prefill():
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(23, h, d, generator=g, dtype=torch.float64)
        for h, d in ((4, D), (HKV, D), (HKV, DV))
    )
    outs = {}
    for split in ([23], [5, 13, 5], [1, 3, 9, 10]):
        pages = ak.PagedKVCache(
            1, HKV, D, num_blocks=16, block_size=4, value_dim=DV, dtype=torch.float64
        )
        s, parts, t = pages.add(), [], 0
        for n in split:
            step = pages.step([s], [n])
            parts.append(
                ak.paged_attention(q[t : t + n], k[t : t + n], v[t : t + n], pages, step, 0)
            )
            t += n
        outs[tuple(split)] = torch.cat(parts)
    first = outs[(23,)]
    for out in outs.values():
        torch.testing.assert_close(out, first, atol=1e-13, rtol=0)


@pytest.mark.parametrize("left", [0, 3, 5, 9])
def test_sliding_windows_crossing_block_boundaries(left):
    world = World(block_size=4)
    a, b = world.add(), world.add()
    world.run([a, b], [10, 3], left=left)
    for _ in range(6):
        world.run([a, b], [1, 2], left=left)


def test_the_physical_order_of_blocks_changes_nothing():
    results = []
    for shuffle in (False, True):
        world = World(num_blocks=40, seed=5)
        if shuffle:
            random.Random(1).shuffle(world.pages._free)
        a, b = world.add(), world.add()
        outs = world.run([a, b], [9, 14]) + world.run([a, b], [1, 3])
        results.append(outs)
        if shuffle:
            assert world.pages.block_table(a) != sorted(world.pages.block_table(a))
    for x, y in zip(*results, strict=True):
        torch.testing.assert_close(x, y, atol=1e-13, rtol=0)


def test_bfloat16_pages_follow_the_float64_formula_within_half_precision():
    world = World(dtype=torch.bfloat16)
    a, b = world.add(), world.add()
    world.run([a, b], [9, 2], tol=3e-2)
    world.run([a, b], [1, 1], tol=3e-2)


def test_bad_calls_are_refused_with_a_reason():
    pages = ak.PagedKVCache(1, HKV, D, num_blocks=4, value_dim=DV)
    s = pages.add()
    step = pages.step([s], [2])
    q, k, v = torch.randn(2, 4, D), torch.randn(2, HKV, D), torch.randn(2, HKV, DV)
    with pytest.raises(ak.ShapeContractError, match=r"k must be \(2, 2, 8\)"):
        ak.paged_attention(q, k[:, :1], v, pages, step, 0)
    with pytest.raises(TypeError, match=r"cache holds torch\.float32"):
        ak.paged_attention(q.double(), k, v, pages, step, 0)
    with pytest.raises(ak.MaskError, match="sliding_window\\(left\\)"):
        ak.paged_attention(q, k, v, pages, step, 0, ak.causal())
    with pytest.raises(IndexError, match="layer 1"):
        ak.paged_attention(q, k, v, pages, step, 1)
    pages.add()
    with pytest.raises(ValueError, match="stale"):
        ak.paged_attention(q, k, v, pages, step, 0)
    with pytest.raises(ValueError, match="repeat a sequence"):
        pages.step([s, s], [1, 1])
    with pytest.raises(ValueError, match="positive int"):
        ak.PagedKVCache(1, HKV, D, num_blocks=0)
    with pytest.raises(ValueError, match="int position"):
        pages.release(s, 1.5)


def test_multi_head_attention_on_pages_equals_one_kv_cache_per_sequence():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(16, 4, num_kv_heads=2, rope=True).double()
    pages = ak.PagedKVCache(1, 2, 4, num_blocks=16, block_size=4, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randn(1, n, 16, generator=g, dtype=torch.float64) for n in (5, 9, 1)]
    caches = [ak.KVCache() for _ in prompts]
    ids = [pages.add() for _ in prompts]
    want = [mha(p, mask=ak.causal(), cache=c) for p, c in zip(prompts, caches, strict=True)]
    step = pages.step(ids, [p.shape[1] for p in prompts])
    got = mha(torch.cat(prompts, 1), cache=pages.layer(step, 0))
    torch.testing.assert_close(got, torch.cat(want, 1), atol=1e-12, rtol=0)
    for _ in range(3):  # decode: one token each, and a chunk for the last sequence
        new = [torch.randn(1, n, 16, generator=g, dtype=torch.float64) for n in (1, 1, 3)]
        bottom_right = ak.causal(align="bottom_right")
        want = [mha(x, mask=bottom_right, cache=c) for x, c in zip(new, caches, strict=True)]
        step = pages.step(ids, [x.shape[1] for x in new])
        got = mha(torch.cat(new, 1), cache=pages.layer(step, 0))
        torch.testing.assert_close(got, torch.cat(want, 1), atol=1e-12, rtol=0)


@pytest.mark.parametrize("grad_of", ["q", "qkv"])
def test_gradients_through_pages_match_the_dense_formula_across_layers(grad_of):
    """Gathers reuse buffers only when autograd keeps nothing: a later layer's gather
    used to overwrite what an earlier layer's backward needed (q requiring grad)."""
    g = torch.Generator().manual_seed(3)
    f64 = dict(dtype=torch.float64)
    pages = ak.PagedKVCache(2, HKV, D, num_blocks=16, block_size=4, value_dim=DV, **f64)
    a, b = pages.add(), pages.add()
    old = [
        (torch.randn(9, HKV, D, generator=g, **f64), torch.randn(9, HKV, DV, generator=g, **f64))
        for _ in range(2)
    ]
    step = pages.step([a, b], [6, 3])
    for layer, (k, v) in enumerate(old):
        ak.paged_attention(torch.randn(9, 4, D, **f64), k, v, pages, step, layer)
    step = pages.step([a, b], [1, 2])  # a decodes, b prefills two more
    new = [
        [torch.randn(3, h, d, generator=g, **f64) for h, d in ((4, D), (HKV, D), (HKV, DV))]
        for _ in range(2)
    ]
    for t in (t for trio in new for t in trio[: 1 if grad_of == "q" else 3]):
        t.requires_grad_(True)
    got = [ak.paged_attention(q, k, v, pages, step, i) for i, (q, k, v) in enumerate(new)]
    want = []
    for (q, k, v), (k0, v0) in zip(new, old, strict=True):
        rows_a = dense(q[:1], torch.cat([k0[:6], k[:1]]), torch.cat([v0[:6], v[:1]]), 6)
        rows_b = dense(q[1:], torch.cat([k0[6:], k[1:]]), torch.cat([v0[6:], v[1:]]), 3)
        want.append(torch.cat([rows_a, rows_b]))
    leaves = [t for trio in new for t in trio if t.requires_grad]
    weight = torch.randn(3, 4, DV, generator=g, **f64)
    grads = torch.autograd.grad(sum((o * weight).sum() for o in got), leaves)
    wanted = torch.autograd.grad(sum((o * weight).sum() for o in want), leaves)
    for x, y in zip(grads, wanted, strict=True):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_any_mix_of_operations_attends_like_the_dense_formula(data):
    """Random adds, forks, removes, releases and steps (prefill, chunks, decode, idle
    sequences) on a shuffled pool: every output equals the float64 formula
    (tests/fuzz_paged.py draws the program; `make fuzz` runs many more)."""
    program(HypothesisDraw(data))


def test_strided_inputs_give_the_same_result_as_contiguous_ones():
    """q, k, v as transposed views (what a module's head split hands over)."""
    results = []
    for strided in (False, True):
        pages = ak.PagedKVCache(1, HKV, D, num_blocks=16, block_size=4, value_dim=DV)
        g = torch.Generator().manual_seed(0)
        ids = [pages.add(), pages.add()]
        outs = []
        for counts in ([6, 3], [1, 1], [1, 4]):
            T = sum(counts)
            q, k, v = (torch.randn(h, T, d, generator=g) for h, d in ((4, D), (HKV, D), (HKV, DV)))
            q, k, v = (
                t.transpose(0, 1) if strided else t.transpose(0, 1).contiguous() for t in (q, k, v)
            )
            assert q.is_contiguous() != strided
            outs.append(ak.paged_attention(q, k, v, pages, pages.step(ids, counts), 0))
        results.append(outs)
    for x, y in zip(*results, strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_a_step_prepares_each_prefill_once_for_all_its_layers(monkeypatch):
    """`Step.calls`: the first layer prepares each sequence's prefill, the others run it."""
    from attnkit.call import dispatch

    lookups = []
    real = dispatch._lookup
    monkeypatch.setattr(dispatch, "_lookup", lambda *a: lookups.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    layers = 3
    pages = ak.PagedKVCache(layers, HKV, D, num_blocks=16, block_size=4, value_dim=DV)
    a, b = pages.add(), pages.add()
    step = pages.step([a, b], [5, 7])  # two prefills
    inputs = [
        [torch.randn(12, h, d, generator=g) for h, d in ((4, D), (HKV, D), (HKV, DV))]
        for _ in range(layers)
    ]
    outs = [ak.paged_attention(q, k, v, pages, step, i) for i, (q, k, v) in enumerate(inputs)]
    assert len(lookups) == 2  # one per sequence, for every layer
    for out, (q, k, v) in zip(outs, inputs, strict=True):
        want = [
            ak.attention(*(t[s].transpose(0, 1)[None] for t in (q, k, v)), ak.causal())[0]
            for s in (slice(0, 5), slice(5, 12))
        ]
        torch.testing.assert_close(out, torch.cat([w.transpose(0, 1) for w in want]))
