"""The block allocator (`attnkit.kv.pool`): blocks freed behind a window, forks that
share blocks, removal and reuse, running out, and its invariants under any sequence of
operations; attention on the pages stays the dense formula's throughout.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from fuzz_paged import DV, HKV, D, World


@pytest.mark.parametrize("left", [0, 3, 6])
def test_blocks_a_window_left_behind_are_freed_and_attention_is_unchanged(left):
    world = World(block_size=4, num_blocks=12)
    pages = world.pages
    a, b = world.add(), world.add()
    world.run([a, b], [10, 3], left=left)
    for _ in range(20):  # far past the pool's 48 slots: only the windows are held
        for s in (a, b):
            before = pages.length(s) - left
            held = [x for x in pages.block_table(s) if x >= 0]
            freed = pages.release(s, before)
            assert freed == len(held) - len([x for x in pages.block_table(s) if x >= 0])
            assert all(x == -1 for x in pages.block_table(s)[: max(before, 0) // 4])  # gone
        world.run([a, b], [1, 2], left=left)  # equal to the dense window (checked in run)
        for s in (a, b):  # what is held: the window and the block being written, no more
            assert len([x for x in pages.block_table(s) if x >= 0]) <= -(-(left + 2) // 4) + 1
    c = world.fork(a)  # a fork shares what is left
    world.run([a, c], [1, 1], left=left)
    step = pages.step([a], [1])  # without the window, a would reach what it released
    zeros = (torch.zeros(1, h, d, dtype=torch.float64) for h, d in ((4, D), (HKV, D), (HKV, DV)))
    with pytest.raises(ValueError, match=r"released its keys before position \d+, but causal"):
        ak.paged_attention(*zeros, pages, step, 0)
    pages.remove(a)
    pages.remove(c)
    pages.remove(b)
    assert pages.free_blocks == pages.num_blocks


def test_fork_shares_blocks_and_divergent_appends_leave_the_sibling_unchanged():
    world = World(block_size=4)
    pages = world.pages
    s = world.add()
    world.run([s], [6])  # blocks: one full, one half full
    used = pages.num_blocks - pages.free_blocks
    c = world.fork(s)
    assert pages.num_blocks - pages.free_blocks == used  # no memory until they diverge
    assert pages.block_table(c) == pages.block_table(s) and pages.length(c) == 6
    assert all(pages.ref_count(b) == 2 for b in pages.block_table(s))
    shared_full, shared_partial = pages.block_table(s)
    world.run([c], [1])  # the child writes: its partial block is copied first
    assert pages.block_table(c)[0] == shared_full and pages.block_table(c)[1] != shared_partial
    assert pages.ref_count(shared_partial) == 1 and pages.ref_count(shared_full) == 2
    world.run([s, c], [3, 2])  # both go on: each sees only its own tokens (checked in run)
    world.run([s], [1])
    pages.remove(c)
    assert pages.ref_count(shared_full) == 1


def test_remove_and_reuse_never_leave_stale_lengths_or_keys():
    world = World(num_blocks=6, block_size=4)
    a = world.add()
    world.run([a], [20])
    assert world.pages.free_blocks == 1
    world.pages.remove(a)
    assert world.pages.free_blocks == 6
    with pytest.raises(KeyError, match="no sequence"):
        world.pages.length(a)
    b = world.add()
    assert world.pages.length(b) == 0 and world.pages.block_table(b) == []
    world.run([b], [3])  # reuses a's blocks: sees only its own 3 tokens (checked in run)
    world.run([b], [1])


def test_out_of_blocks_is_a_typed_error_that_changes_nothing():
    world = World(num_blocks=5, block_size=4)
    pages = world.pages
    a, b = world.add(), world.add()
    world.run([a, b], [6, 4])
    c, d = world.fork(a), world.fork(a)  # three share a's partial block: a and c copy it
    before = {s: (pages.length(s), pages.block_table(s)) for s in pages.sequences}
    refs = [pages.ref_count(i) for i in range(pages.num_blocks)]
    free, version = pages.free_blocks, pages.version
    with pytest.raises(ak.OutOfBlocksError, match=r"needs 3 free blocks .* 2 are free"):
        pages.step([a, b, c, d], [1, 1, 1, 1])  # and b grows
    assert {s: (pages.length(s), pages.block_table(s)) for s in pages.sequences} == before
    assert [pages.ref_count(i) for i in range(pages.num_blocks)] == refs
    assert pages.free_blocks == free and pages.version == version
    world.run([a, c, d], [1, 1, 1])  # a and c copy, d writes in place: 2 blocks, they fit
    assert pages.free_blocks == 0


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("afrsd"), st.integers(0, 9), st.integers(0, 7)), max_size=40)
)
def test_allocator_invariants_hold_after_any_sequence_of_operations(ops):
    pages = ak.PagedKVCache(1, 1, 2, num_blocks=12, block_size=3)
    for op, pick, n in ops:
        live = pages.sequences
        try:
            if op == "a" or not live:
                pages.add()
            elif op == "f":
                pages.fork(live[pick % len(live)])
            elif op == "r":
                pages.remove(live[pick % len(live)])
            elif op == "d":
                seq = live[pick % len(live)]
                pages.release(seq, pages.length(seq) - n)
            else:
                pages.step([live[pick % len(live)]], [n])
        except ak.OutOfBlocksError:
            pass
        held = [b for s in pages.sequences for b in pages.block_table(s) if b >= 0]
        for block in range(pages.num_blocks):
            assert pages.ref_count(block) == held.count(block)  # counts are exact
        used = sum(pages.ref_count(b) > 0 for b in range(pages.num_blocks))
        assert used + pages.free_blocks == pages.num_blocks  # free + used = total
        assert not set(pages._free) & set(held) and len(set(pages._free)) == len(pages._free)
        for s in pages.sequences:
            assert len(pages.block_table(s)) == math.ceil(pages.length(s) / pages.block_size)
