"""Decoding steps (`attnkit.call.steps`): which calls are steps, one plan per bucket of S for a
growing cache, padded or not, and a choice of backend that a plan made afresh repeats."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.call import dispatch
from attnkit.call.key import Options
from attnkit.call.steps import bucket, step_kind
from attnkit.masks import from_hf_attention_mask
from attnkit.native import unavailable

OPTIONS = Options(None, None, 0.0, "auto", need_lse=False, check_bias=True)
native = pytest.mark.skipif(unavailable() is not None, reason="the native kernels: not built")


@pytest.fixture
def plans(monkeypatch):
    """Counts the calls really planned (validated, planned, kernel built), but for the
    reference backend's (the tests' ground truth)."""
    count = [0]
    original = dispatch._prepared

    def counting(q, k, v, mask, options, *args):
        count[0] += options.backend != "reference"
        return original(q, k, v, mask, options, *args)

    monkeypatch.setattr(dispatch, "_prepared", counting)
    dispatch.clear()
    return count


def _ran(q, k, v, mask):
    """The backend `attention` runs this call on (the cache's plan, a step's included)."""
    return dispatch._lookup(q, k, v, mask, OPTIONS, None, True).backend.name


def test_bucket_is_the_power_of_two_at_or_above():
    assert [bucket(S) for S in (1, 2, 3, 512, 513, 1024, 1025)] == [1, 2, 4, 512, 1024, 1024, 2048]


def test_which_calls_are_steps():
    padding = ak.key_padding(torch.tensor([3, 5]))
    bottom = ak.causal(align="bottom_right")
    assert step_kind(None, 1, 9) == "dense"
    assert step_kind(bottom, 1, 9) == "dense"
    assert step_kind(bottom & padding, 1, 9) == "padded"
    assert step_kind(padding, 1, 9) == "padded"
    assert step_kind(bottom & padding, 2, 9) is None  # the first query misses a key
    assert step_kind(ak.sliding_window(3, align="bottom_right") & padding, 1, 9) is None
    assert step_kind(bottom & ak.alibi(2), 1, 9) is None  # a bias
    assert step_kind(bottom, 17, 40) is None  # more queries than a step asks
    assert step_kind(bottom | padding, 1, 9) == "dense"  # `|` with a mask that sees all


def _padded_loop(B, H, Hkv, lengths, dtype=torch.float32, seed=0):
    """A left-padded batch decoding from `lengths[0]` to `lengths[-1]` keys as transformers
    does it: a new mask object each step; yields (q, k, v, mask) of each step."""
    g = torch.Generator().manual_seed(seed)
    S_max = lengths[-1]
    k = torch.randn(B, Hkv, S_max, 16, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S_max, 16, generator=g).to(dtype)
    real = torch.ones(B, S_max, dtype=torch.long)
    for b in range(B):
        real[b, : 7 * b + 3] = 0  # row b: 7·b + 3 tokens of left padding
    for S in lengths:
        q = torch.randn(B, H, 1, 16, generator=g).to(dtype)
        mask = ak.causal(offset=S - 1) & from_hf_attention_mask(real[:, :S].clone())
        yield q, k[:, :, :S], v[:, :, :S], mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_padded_cache_is_planned_once_per_bucket_and_stays_exact(plans, dtype):
    lengths = list(range(500, 530)) + list(range(1020, 1030))  # buckets 512, 1024, 2048
    with torch.no_grad():
        for q, k, v, mask in _padded_loop(4, 8, 2, lengths, dtype):
            got = ak.attention(q, k, v, mask)
            want = ak.attention(q.double(), k.double(), v.double(), mask, backend="reference")
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    assert plans[0] == 3


@native
def test_a_step_runs_on_the_backend_a_fresh_plan_chooses():
    """One sequence's float32 GQA step: SDPA up to 1,024 keys, the kernel from 1,025 (its
    bucket reaches the shared reads): the step plan that served each step chose as
    `explain`, which plans afresh, does."""
    with torch.no_grad():
        for q, k, v, mask in _padded_loop(1, 8, 2, [1000, 1023, 1024, 1025, 1030]):
            assert _ran(q, k, v, mask) == ak.explain(q, k, v, mask).backend
        assert [_ran(*s) for s in _padded_loop(1, 8, 2, [1024, 1025])] == ["sdpa", "native"]


@native
def test_a_step_the_plans_backend_cannot_serve_is_planned_in_full(plans):
    """Padding with a hole (not one interval of keys): the kernel that served the steps
    before refuses it, and the call is planned and exact."""
    B, S = 4, 600
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, 8, 1, 16, generator=g)
    k, v = (torch.randn(B, 2, S, 16, generator=g) for _ in range(2))
    with torch.no_grad():
        real = torch.ones(B, S, dtype=torch.bool)
        ak.attention(q, k, v, ak.causal(offset=S - 1) & ak.key_padding(real))  # native
        holes = real.clone()
        holes[:, 100:120] = False
        mask = ak.causal(offset=S - 1) & ak.key_padding(holes)
        got = ak.attention(q, k, v, mask)
        want = ak.attention(q, k, v, mask, backend="reference")
    torch.testing.assert_close(got, want)
    assert plans[0] == 2 and _ran(q, k, v, mask) != "native"


@pytest.mark.parametrize(("B", "backend"), [(1, "sdpa"), pytest.param(4, "native", marks=native)])
def test_a_padded_step_keeps_nan_at_padding_from_its_row(B, backend):
    """A NaN key or value at a padded position of a batch row reaches no row (each row's
    K/V are its own: the row that hides it sees none of it), on the step plan's path
    too, whichever backend the rule takes."""
    with torch.no_grad():
        for q, k, v, mask in _padded_loop(B, 8, 2, [700, 701, 702]):
            k, v = k.clone(), v.clone()
            v[B - 1, :, 0] = float("nan")  # the last row's first key: padding
            k[B - 1, :, 1] = float("inf")
            assert _ran(q, k, v, mask) == backend
            assert torch.isfinite(ak.attention(q, k, v, mask)).all()


def test_a_prepared_step_takes_a_growing_cache(plans):
    """`attnkit.prepare` of one step serves the next ones, one key longer each, planned
    once per bucket; another change of shape still names what changed."""
    g = torch.Generator().manual_seed(6)
    k, v = (torch.randn(2, 2, 80, 16, generator=g) for _ in range(2))
    q = torch.randn(2, 8, 1, 16, generator=g)
    mask = ak.causal(align="bottom_right") & ak.key_padding(torch.tensor([30, 40]))
    with torch.no_grad():
        step = ak.prepare(q, k[:, :, :40], v[:, :, :40], mask)
        for S in range(40, 64):  # bucket 64 from 33 up
            got = step(q, k[:, :, :S], v[:, :, :S])
            torch.testing.assert_close(
                got, ak.attention(q, k[:, :, :S], v[:, :, :S], mask, backend="reference")
            )
        assert plans[0] == 1
        with pytest.raises(ak.PreparedMismatchError, match="k's shape"):
            step(q, k[:1, :, :50], v[:1, :, :50])
    dense = ak.prepare(q, k[:, :, :9], v[:, :, :9], ak.causal(align="top_left"))  # no step
    with pytest.raises(ak.PreparedMismatchError, match="k's shape"):
        dense(q, k[:, :, :10], v[:, :, :10])
