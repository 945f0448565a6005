"""Caches per mask (`attnkit.call.by_mask`): by value, by object, by the caller's tensor."""

from __future__ import annotations

import gc
import weakref

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit.call.by_mask import STRUCTURES_KEPT, ByMask
from attnkit.masks.base import as_mask
from attnkit.masks.spec import decode, encode
from attnkit.masks.window import window
from helpers import count_tile_plans


def _cache() -> tuple[ByMask[list[object]], list[object]]:
    made: list[object] = []

    def make(mask: object) -> list[object]:
        made.append(None if mask is None else type(mask))  # never the mask: it must die
        return []

    return ByMask(make), made


def test_masks_of_numbers_alone_share_the_holder_of_their_structure():
    cache, made = _cache()
    first = cache.of(ak.causal() & ak.sliding_window(4))
    assert cache.of(ak.causal() & ak.sliding_window(4)) is first
    assert len(made) == 1
    others = [
        ak.causal() & ak.sliding_window(5),
        ak.sliding_window(4) & ak.causal(),  # another structure, the same pairs
        ak.causal(offset=0) & ak.sliding_window(4),
    ]
    assert all(cache.of(m) is not first for m in others)
    assert len({id(cache.of(m)) for m in others}) == len(others)


def test_masks_holding_tensors_or_functions_are_their_own():
    cache, _ = _cache()
    lengths = torch.tensor([5, 3])
    a, b = ak.key_padding(lengths), ak.key_padding(lengths.clone())
    assert cache.of(a) is not cache.of(b)
    assert cache.of(a) is cache.of(a)
    f = ak.Mask.from_mod(lambda b, h, i, j: j <= i, "mine")
    g = ak.Mask.from_mod(lambda b, h, i, j: j <= i, "mine")
    assert cache.of(f) is not cache.of(g)


def test_masks_built_anew_over_the_same_tensors_share_a_holder():
    """A mask built each call over the same tensors (a piece's window, the compiled op's
    decoded mask) finds the holder of an equal one, while those tensors live."""
    cache, _ = _cache()
    lengths = torch.tensor([5, 3])
    first = cache.of(ak.key_padding(lengths) & ak.causal())
    assert cache.of(ak.key_padding(lengths) & ak.causal()) is first
    assert cache.of(ak.key_padding(lengths.clone()) & ak.causal()) is not first

    def fn(b, h, i, j):
        return j <= i

    # a function is no value (it may read data changed in place): each mask its own,
    # but a window of one mask object shares the holder of an equal window
    assert cache.of(ak.Mask.from_mod(fn, "f")) is not cache.of(ak.Mask.from_mod(fn, "f"))
    by_fn = ak.Mask.from_mod(fn, "f")
    part = dict(H=2, L=6, S=6, rows=(0, 3), cols=(0, 3))
    assert cache.of(window(by_fn, **part)) is cache.of(window(by_fn, **part))
    global_mask = ak.document(torch.tensor([[0, 0, 1, 1, 1, 2]])) & ak.causal()
    piece = dict(H=2, L=6, S=6, rows=(3, 6), cols=(0, 3))
    assert cache.of(window(global_mask, **piece)) is cache.of(window(global_mask, **piece))
    tensors: list[torch.Tensor] = []
    spec = encode(global_mask, tensors)
    assert cache.of(decode(spec, tensors)) is cache.of(decode(spec, tensors))
    assert cache.of(decode(spec, tensors)) is cache.of(global_mask)


def test_an_entry_by_value_goes_with_the_tensors_it_names():
    cache, _ = _cache()
    lengths = torch.tensor([5, 3])
    cache.of(ak.key_padding(lengths) & ak.causal())  # the mask dies at once
    assert len(cache._by_value) == 1
    alive = weakref.ref(lengths)
    del lengths
    gc.collect()
    assert alive() is None and len(cache._by_value) == 0  # neither held nor kept


def test_a_tensor_and_every_mask_made_from_it_share_one_holder():
    """`as_mask` wraps a tensor anew at each call: the holder follows the caller's tensor."""
    cache, made = _cache()
    tensor = torch.rand(6, 9) > 0.3
    held = cache.of(tensor)
    assert cache.of(as_mask(tensor)) is held and cache.of(as_mask(tensor)) is held
    assert cache.of(as_mask(tensor.clone())) is not held
    assert cache.of(None) is cache.of(None) and made.count(None) == 1


def test_entries_go_with_their_object_and_structures_are_bounded():
    cache, _ = _cache()
    tensor = torch.rand(6, 9) > 0.3
    mask = ak.key_padding(torch.tensor([5, 3]))
    cache.of(tensor)
    cache.of(mask)
    assert tensor in cache and mask in cache
    alive = [weakref.ref(tensor), weakref.ref(mask)]
    ids = [id(tensor), id(mask)]
    del tensor, mask
    gc.collect()
    assert all(ref() is None for ref in alive)  # the cache held neither
    assert not any(i in cache._by_object for i in ids)
    for n in range(STRUCTURES_KEPT + 5):
        cache.of(ak.sliding_window(n))
    assert len(cache._by_value) == STRUCTURES_KEPT


def test_tiled_plans_once_for_masks_built_anew_each_call(monkeypatch):
    """A decoding loop that builds `causal() & sliding_window(w)` each step plans once."""
    planned = count_tile_plans(monkeypatch)  # plans live in the prepared calls
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 16, generator=g) for _ in range(3))
    want = ak.attention(q, k, v, ak.causal() & ak.sliding_window(40), backend="reference")
    for _ in range(3):
        got = ak.attention(q, k, v, ak.causal() & ak.sliding_window(40), backend="tiled")
        torch.testing.assert_close(got, want)
    assert len(planned) == 1


def test_a_function_mask_built_anew_follows_the_data_its_function_reads():
    """A function may read data that changes in place (FlexAttention's document masks
    read a global ids tensor refilled each batch): a `from_mod` mask built anew is never
    served the call prepared for an earlier one, though it holds the same function."""
    ids = torch.tensor([0, 0, 0, 1, 1, 1])

    def same_document(b, h, i, j):
        return ids[i] == ids[j]

    q, k, v = (
        torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(n)) for n in range(3)
    )
    for refill in ([0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 2]):
        ids.copy_(torch.tensor(refill))
        got = ak.attention(q, k, v, ak.Mask.from_mod(same_document))
        want = ak.attention(q, k, v, ak.document(ids.clone()), backend="reference")
        torch.testing.assert_close(got, want)


def test_a_tensor_part_refilled_in_place_is_read_again_whatever_its_layout():
    """`causal() & t` built each call over a buffer refilled in place: the contiguous
    buffer itself, an expanded one (the wrapper keeps a compact copy) and a 2-D one."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(3))
    for layout in ("4d", "expanded", "2d"):
        buffer = torch.ones(6, dtype=torch.bool)
        t = {
            "4d": buffer.view(1, 1, 1, 6),
            "expanded": buffer.expand(2, 1, 6, 6),
            "2d": buffer.view(1, 6).expand(6, 6),
        }[layout]
        for hidden in (None, 2, 4, 1):
            buffer.fill_(True)
            if hidden is not None:
                buffer[hidden] = False
            got = ak.attention(q, k, v, ak.causal() & t)
            want = ak.attention(q, k, v, ak.causal() & t.clone(), backend="reference")
            torch.testing.assert_close(got, want, msg=f"{layout} hidden {hidden}")


def _masks_over(buffers: dict[str, object], kind: str) -> ak.Mask:
    """A mask built anew over the same buffers, as a loop builds one each call: ids
    (1, S) long, valid (1, S) bool, dense an expanded view of it, a function reading it."""
    if kind == "padding":
        return ak.causal(align="bottom_right") & ak.key_padding(buffers["valid"])
    if kind == "documents":
        return ak.document(buffers["ids"]) & ak.causal()
    if kind == "tensor":
        return ak.causal() & buffers["dense"]
    return ak.Mask.from_mod(buffers["fn"], "reads a buffer")


def _buffers(ids: torch.Tensor) -> dict[str, object]:
    valid = ids > 0
    return {
        "ids": ids,
        "valid": valid,
        "dense": valid.expand(4, 4),
        "fn": lambda b, h, i, j: valid[0, j] & (j <= i),
    }


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(["padding", "documents", "tensor", "function"]),
    fills=st.lists(st.lists(st.integers(0, 2), min_size=4, max_size=4), min_size=2, max_size=4),
    backend=st.sampled_from(["auto", "sdpa", "tiled", "blockwise"]),
)
def test_masks_built_anew_over_a_buffer_refilled_in_place_follow_it(kind, fills, backend):
    """Every call sees the buffers' contents now: a prepared call found by value, by
    object or by the caller's tensor is never one of earlier contents."""
    g = torch.Generator().manual_seed(len(fills))
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    ids = torch.zeros(1, 4, dtype=torch.long)
    buffers = _buffers(ids)
    for fill in fills:
        ids.copy_(torch.tensor([fill]))
        buffers["valid"].copy_(ids > 0)  # type: ignore[attr-defined]
        try:
            got = ak.attention(q, k, v, _masks_over(buffers, kind), backend=backend)
        except ValueError as refused:  # a backend that cannot serve the kind says so
            assert "cannot serve this call" in str(refused)
            continue
        want = _masks_over(_buffers(ids.clone()), kind)
        torch.testing.assert_close(got, ak.attention(q, k, v, want, backend="reference"))
