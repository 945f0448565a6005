"""The planner's cache of chosen backends: a plan is reused only for a call that every
input of the choice matches, and never served stale."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import planner


@pytest.fixture
def choices(monkeypatch):
    """Counts the times the planner really chooses (prices every backend)."""
    count = [0]
    original = planner.choose_backend

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(planner, "choose_backend", counting)
    return count


def _qkv(B=2, L=6, S=9, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(B, h, n, 8, generator=g).to(dtype) for h, n in ((4, L), (2, S), (2, S))
    )


def test_the_same_call_is_planned_once(choices):
    q, k, v = _qkv()
    mask = ak.causal(align="bottom_right") & ak.key_padding(torch.tensor([9, 4]))
    first = ak.attention(q, k, v, mask)
    for _ in range(3):
        torch.testing.assert_close(ak.attention(q, k, v, mask), first)
    assert choices[0] == 1


def test_a_plan_is_never_served_stale(choices):
    q, k, v = _qkv()
    lengths = torch.tensor([9, 4])
    mask = ak.causal(align="bottom_right") & ak.key_padding(lengths)
    ak.attention(q, k, v, mask)
    seen = choices[0]

    def replanned(call) -> tuple[bool, torch.Tensor]:  # (planned afresh, the output)
        nonlocal seen
        out = call()
        fresh, seen = choices[0] > seen, choices[0]
        return fresh, out

    lengths[1] = 0  # an in-place change of the mask's tensor
    fresh, out = replanned(lambda: ak.attention(q, k, v, mask))
    assert fresh and (out[1] == 0).all()
    torch.testing.assert_close(out, ak.attention(q, k, v, mask, backend="reference"))
    q2, k2, v2 = _qkv(L=5, S=11)  # new sizes
    assert replanned(lambda: ak.attention(q2, k2, v2, ak.causal(align="bottom_right")))[0]
    qd, kd, vd = (t.double() for t in (q, k, v))  # another dtype
    assert replanned(lambda: ak.attention(qd, kd, vd, mask))[0]
    qg = q.clone().requires_grad_()  # gradients wanted
    fresh, out = replanned(lambda: ak.attention(qg, k, v, mask))
    assert fresh
    out.sum().backward()
    assert torch.isfinite(qg.grad).all()
    assert replanned(lambda: ak.attention(q, k, v, mask, backend="blockwise"))[0]
    assert replanned(lambda: ak.attention(q, k, v, mask, softcap=3.0))[0]
    assert not replanned(lambda: ak.attention(q, k, v, mask))[0]  # the first one, cached


def test_a_float_bias_is_planned_every_call(choices):
    q, k, v = _qkv()
    bias = torch.randn(1, 1, 6, 9)
    ak.attention(q, k, v, bias)
    ak.attention(q, k, v, bias)
    assert choices[0] == 2
