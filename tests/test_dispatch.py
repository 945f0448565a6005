"""attnkit.call.dispatch: a repeated call is validated, planned and prepared once, and a
prepared call is never served stale; the cache holds neither masks nor inputs."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

import attnkit as ak
from attnkit import runtime
from attnkit.call import dispatch
from attnkit.masks.structure import value_key
from helpers import EXACT_BACKENDS, small_qkv


@pytest.fixture
def plans(monkeypatch):
    """Counts the calls really prepared (validated, planned, kernel built), but for the
    reference backend's (the tests' ground truth)."""
    count = [0]
    original = dispatch._prepared

    def counting(q, k, v, mask, options, *args):
        count[0] += options[3] != "reference"  # (scale, softcap, dropout_p, backend, ...)
        return original(q, k, v, mask, options, *args)

    monkeypatch.setattr(dispatch, "_prepared", counting)
    return count


def _qkv(B=2, L=6, S=9, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(B, h, n, 8, generator=g).to(dtype) for h, n in ((4, L), (2, S), (2, S))
    )


def _reference(q, k, v, mask, **kw):
    return ak.attention(q, k, v, mask, backend="reference", **kw)


@pytest.mark.parametrize("grad", [False, True])
def test_the_same_call_is_prepared_once(plans, grad):
    q, k, v = _qkv()
    mask = ak.causal(align="bottom_right") & ak.key_padding(torch.tensor([9, 4]))
    with torch.set_grad_enabled(grad):
        first = ak.attention(q, k, v, mask)
        for seed in range(1, 4):  # new inputs of the same kind
            q2, k2, v2 = _qkv(seed=seed)
            torch.testing.assert_close(ak.attention(q2, k2, v2, mask), _reference(q2, k2, v2, mask))
        torch.testing.assert_close(ak.attention(q, k, v, mask), first)
    assert plans[0] == 1


def test_a_prepared_call_is_never_served_stale(plans):
    q, k, v = _qkv()
    lengths = torch.tensor([9, 4])
    mask = ak.causal(align="bottom_right") & ak.key_padding(lengths)
    ak.attention(q, k, v, mask)
    seen = plans[0]

    def prepared_afresh(call) -> tuple[bool, torch.Tensor]:  # (prepared afresh, the output)
        nonlocal seen
        out = call()
        fresh, seen = plans[0] > seen, plans[0]
        return fresh, out

    lengths[1] = 0  # an in-place change of the mask's tensor
    fresh, out = prepared_afresh(lambda: ak.attention(q, k, v, mask))
    assert fresh and (out[1] == 0).all()
    torch.testing.assert_close(out, _reference(q, k, v, mask))
    q2, k2, v2 = _qkv(L=5, S=11)  # new sizes
    assert prepared_afresh(lambda: ak.attention(q2, k2, v2, ak.causal(align="bottom_right")))[0]
    qd, kd, vd = (t.double() for t in (q, k, v))  # another dtype
    assert prepared_afresh(lambda: ak.attention(qd, kd, vd, mask))[0]
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # other strides, same values
    fresh, out = prepared_afresh(lambda: ak.attention(qt, k, v, mask))
    assert fresh
    torch.testing.assert_close(out, _reference(q, k, v, mask))
    qg = q.clone().requires_grad_()  # gradients wanted
    fresh, out = prepared_afresh(lambda: ak.attention(qg, k, v, mask))
    assert fresh
    out.sum().backward()
    assert torch.isfinite(qg.grad).all()
    with torch.no_grad():  # the same tensor, autograd off: the first call's kind again
        fresh, out = prepared_afresh(lambda: ak.attention(qg, k, v, mask))
        assert not fresh and not out.requires_grad
    assert prepared_afresh(lambda: ak.attention(q, k, v, mask, backend="blockwise"))[0]
    assert prepared_afresh(lambda: ak.attention(q, k, v, mask, softcap=3.0))[0]
    assert prepared_afresh(lambda: ak.attention(q, k, v, mask, scale=-0.5))[0]
    assert prepared_afresh(lambda: ak.attention_with_lse(q, k, v, mask))[0]
    assert not prepared_afresh(lambda: ak.attention(q, k, v, mask))[0]  # the first, kept


def test_a_tensor_mask_changed_in_place_is_prepared_again(plans):
    q, k, v = _qkv()
    for mask in (torch.ones(6, 9, dtype=torch.bool), torch.zeros(1, 1, 6, 9)):
        hidden = False if mask.dtype == torch.bool else -torch.inf
        before = plans[0]
        torch.testing.assert_close(ak.attention(q, k, v, mask), _reference(q, k, v, mask))
        mask[..., 4:] = hidden  # keys 4.. hidden from then on
        got = ak.attention(q, k, v, mask)
        assert plans[0] == before + 2
        torch.testing.assert_close(got, _reference(q, k, v, mask))
        torch.testing.assert_close(got, _reference(q, k[:, :, :4], v[:, :, :4], None))


def test_a_negative_scale_and_odd_strides_stay_exact_when_cached(plans):
    q, k, v = _qkv()
    mask = ak.sliding_window(2, align="bottom_right")
    for seed in range(3):
        q, k, v = _qkv(seed=seed)
        qs = torch.stack([q, q], -1).flatten(-2)[..., ::2]  # q, its last dim of stride 2
        got = ak.attention(qs, k, v, mask, scale=-0.7)
        torch.testing.assert_close(got, _reference(q, k, v, mask, scale=-0.7))
    assert plans[0] == 1


def test_poison_written_into_padded_slots_after_the_first_call_never_leaks():
    """The prepared kernel runs on the cache as given; padded slots poisoned in place
    between calls (no key notices: K and V are not part of it) still never leak."""
    q, k, v = _qkv(L=1, S=12)
    lengths = torch.tensor([12, 5])
    mask = ak.causal(align="bottom_right") & ak.key_padding(lengths)
    padded = torch.arange(12)[None, None, :, None] >= lengths[:, None, None, None]
    want = _reference(q, k, v, mask)
    with torch.no_grad():
        torch.testing.assert_close(ak.attention(q, k, v, mask), want)
        for poison in (float("nan"), float("inf"), -float("inf")):
            k.masked_fill_(padded, poison)
            v.masked_fill_(padded, poison)
            torch.testing.assert_close(ak.attention(q, k, v, mask), want)


def test_the_cache_holds_neither_masks_nor_inputs():
    q, k, v = _qkv()
    mask = ak.causal(align="bottom_right") & ak.key_padding(torch.tensor([9, 4]))
    tensor_mask = torch.rand(6, 9) > 0.3
    ak.attention(q, k, v, mask)
    ak.attention(q, k, v, tensor_mask)
    masks = [id(mask), id(tensor_mask)]
    assert mask in runtime.current().calls and tensor_mask in runtime.current().calls
    alive = [weakref.ref(x) for x in (mask, tensor_mask, q, k, v)]
    del mask, tensor_mask, q, k, v
    gc.collect()
    assert all(ref() is None for ref in alive)
    assert not any(
        i in runtime.current().calls._by_object for i in masks
    )  # their entries went with them


def test_masks_built_anew_share_the_calls_of_their_structure(plans):
    """A mask of numbers alone built anew each call (`causal()` in a loop) is prepared
    once; a different field, type of field, class or a tensor makes another mask."""
    q, k, v = _qkv(L=9)
    for _ in range(3):
        ak.attention(q, k, v, ak.causal() & ak.sliding_window(4))
    assert plans[0] == 1
    others = [
        ak.causal() & ak.sliding_window(5),
        ak.causal(offset=0) & ak.sliding_window(4),  # same pairs, another structure
        ak.sliding_window(4) & ak.causal(),
        ak.chunked(4),
        ak.Mask.from_mod(lambda b, h, i, j: j <= i, "mine"),  # a function: its own
        ak.Mask.from_mod(lambda b, h, i, j: j > i, "mine"),
        ak.causal() & ak.key_padding(torch.tensor([9, 4])),  # tensors: its own
        ak.causal() & ak.key_padding(torch.tensor([9, 5])),
    ]
    for mask in others:
        torch.testing.assert_close(ak.attention(q, k, v, mask), _reference(q, k, v, mask))
    assert plans[0] == 1 + len(others)
    assert value_key((1, 2.0)) != value_key((True, 2))  # typed numbers


def test_a_growing_cache_is_served_by_one_call_per_bucket_and_stays_exact(plans):
    """A decoding step (every key seen: bottom-right causal at L = 1) runs one unmasked
    kernel whatever S: one preparation serves every step of a bucket (the power of two
    at or above S), a new mask object each."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 2, 40, 8, generator=g)
    v = torch.randn(2, 2, 40, 8, generator=g)
    with torch.no_grad():
        for S in range(5, 40, 3):  # buckets 8, 16, 32, 64
            q = torch.randn(2, 4, 1, 8, generator=g)
            mask = ak.causal(align="bottom_right")
            got = ak.attention(q, k[:, :, :S], v[:, :, :S], mask)
            torch.testing.assert_close(got, _reference(q, k[:, :, :S], v[:, :, :S], mask))
    assert plans[0] == 4


def test_a_decoding_step_prepared_by_hand_first_still_serves_any_length(plans):
    """`attnkit.prepare` of a step, then `attention` of the same: the call found by its
    full key joins the any-length calls, so the next, longer step is not prepared."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, n, 8, generator=g) for n in (1, 30, 30))
    mask = ak.causal(align="bottom_right")
    with torch.no_grad():
        ak.prepare(q, k[:, :, :20], v[:, :, :20], mask)
        ak.attention(q, k[:, :, :20], v[:, :, :20], mask)
        got = ak.attention(q, k[:, :, :21], v[:, :, :21], mask)
    torch.testing.assert_close(got, _reference(q, k[:, :, :21], v[:, :, :21], mask))
    assert plans[0] == 1


def test_one_call_for_any_length_serves_only_calls_that_see_every_key():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 1, 8, generator=g)
    k, v = torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    window = ak.sliding_window(3, align="bottom_right")  # every key while S <= 4
    with torch.no_grad():
        for S in (3, 4, 12):  # then a window that hides keys: planned, masked
            got = ak.attention(q, k[:, :, :S], v[:, :, :S], window)
            torch.testing.assert_close(got, _reference(q, k[:, :, :S], v[:, :, :S], window))
        bottom = ak.causal(align="bottom_right")
        q2 = torch.randn(1, 4, 2, 8, generator=g)  # two queries: the first misses a key
        torch.testing.assert_close(ak.attention(q2, k, v, bottom), _reference(q2, k, v, bottom))
        with pytest.raises(ak.ShapeContractError, match="K/V length mismatch"):
            ak.attention(q, k, v[:, :, :11], bottom)
        assert (ak.attention(q, k[:, :, :0], v[:, :, :0], bottom) == 0).all()  # no keys
    qg = q.clone().requires_grad_()  # gradients through that kernel
    ak.attention(qg, k, v, ak.causal(align="bottom_right")).sum().backward()
    qr = q.clone().requires_grad_()
    _reference(qr, k, v, None).sum().backward()
    torch.testing.assert_close(qg.grad, qr.grad)


@pytest.mark.parametrize(
    "sizes",
    [dict(B=0), dict(L=0), dict(S=0), dict(Dv=0), dict(L=0, S=0)],
    ids=["B=0", "L=0", "S=0", "Dv=0", "L=S=0"],
)
@pytest.mark.parametrize("backend", [*EXACT_BACKENDS, "flex"])
def test_empty_sizes_give_zeros_lse_minus_inf_and_zero_gradients(backend, sizes):
    q, k, v = small_qkv(**sizes)
    q[..., 0] = math.nan  # with S = 0 no query sees anything: nothing may leak
    mask = ak.causal(align="bottom_right")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ak.attention_with_lse(q, k, v, mask, backend=backend)
    assert out.shape == (q.shape[0], 2, q.shape[2], v.shape[-1]) and (out == 0).all()
    assert lse.shape == q.shape[:3] and (lse == -math.inf).all()
    (out.sum() + lse.masked_fill(torch.isinf(lse), 0).sum()).backward()
    assert all(t.grad is not None and (t.grad == 0).all() for t in (q, k, v))
    plan = ak.explain(q, k, v, mask)
    assert plan.backend == "none" and plan.flops == 0 and "nothing to compute" in str(plan)
    assert ak.attention_probs(q, k, mask).shape == (q.shape[0], 2, q.shape[2], k.shape[2])


@pytest.mark.parametrize("backend", ["auto", "blockwise", "reference"])
def test_softcap_call_that_sees_nothing_gives_zero_finite_gradients(backend):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 45, 64, generator=g).half().requires_grad_()
    k = torch.randn(1, 1, 45, 64, generator=g).half().requires_grad_()
    v = torch.randn(1, 1, 45, 16, generator=g).half().requires_grad_()
    mask = ak.key_padding(torch.tensor([0]))
    out, lse = ak.attention_with_lse(q, k, v, mask, softcap=5000.0, backend=backend)
    (out.float().sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    assert (out == 0).all() and torch.isneginf(lse).all()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and (t.grad == 0).all()


@pytest.mark.parametrize("backend", ["blockwise", "tiled", "sdpa", "auto"])
def test_every_backend_joins_a_result_that_sees_nothing_to_its_inputs(backend):
    q, k, v = (t.requires_grad_() for t in small_qkv(B=2, H=2, Hkv=2, L=5, S=7))
    out = ak.attention(q, k, v, ak.key_padding(torch.tensor([0, 0])), backend=backend)
    out.sum().backward()
    assert all(t.grad is not None and (t.grad == 0).all() for t in (q, k, v))


def test_step_calls_run_the_first_call_for_later_layers_and_see_a_mask_change():
    g = torch.Generator().manual_seed(6)
    lengths = torch.tensor([9, 5])
    mask = ak.causal(align="bottom_right") & ak.key_padding(lengths)
    calls = dispatch.StepCalls()
    for length in (5, 5, 3):  # two layers, then the padding refilled in place
        lengths[1] = length
        q, k, v = _qkv(L=2, S=9, seed=int(torch.randint(0, 99, (1,), generator=g)))
        got = calls.run("place", q, k, v, mask, scale=None, softcap=None, dropout_p=0.0)
        torch.testing.assert_close(
            got,
            _reference(q, k, v, ak.causal(align="bottom_right") & ak.key_padding(lengths.clone())),
        )
