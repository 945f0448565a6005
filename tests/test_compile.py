"""attnkit inside `torch.compile`: same outputs and gradients as eager.

Each public call runs eagerly within compiled code (a graph break around it: planning
reads masks as data); the rest of the model compiles. Small shapes, so `make test` pays
seconds per case.
"""

from __future__ import annotations

import pytest
import torch

import attnkit as ak


def _grads(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.square().sum().backward()
    return out.detach(), [t.grad for t in leaves]


MASKS = {
    "none": lambda: None,
    "causal": lambda: ak.causal(),
    "sliding": lambda: ak.sliding_window(5),
    "prefix": lambda: ak.prefix_lm(3),
    "alibi": lambda: ak.causal() & ak.alibi(4),
    "padding": lambda: ak.key_padding(torch.tensor([16, 9])),
    "documents": lambda: ak.document(torch.arange(16) // 5) & ak.causal(),
    "tensor": lambda: torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(0)) > 0.3,
}


CASES = [(kind, "auto") for kind in MASKS] + [
    (kind, backend) for backend in ("reference", "sdpa", "tiled") for kind in ("padding", "tensor")
]


@pytest.mark.parametrize(("kind", "backend"), CASES)
def test_compiled_function_matches_eager(kind, backend):
    torch._dynamo.reset()
    mask = MASKS[kind]()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA

    def fn(q, k, v):
        if backend == "sdpa":  # its log-sum-exp carries no gradient
            return ak.attention(q * 2, k, v, mask, backend=backend).tanh()
        out, lse = ak.attention_with_lse(q * 2, k, v, mask, backend=backend)
        return out.tanh() + lse[..., None] * 0.1

    want, want_grads = _grads(fn, q, k, v)
    got, got_grads = _grads(torch.compile(fn, backend="aot_eager"), q, k, v)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_compiled_model_with_rope_gqa_and_cache_matches_eager():
    """The model of issue 10's report: it failed in Inductor (`vr must not be None`)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ak.MultiHeadAttention(32, 4, num_kv_heads=2, rope=True)
    x = torch.randn(2, 12, 32)
    compiled = torch.compile(model)
    for mask in (ak.causal(), ak.sliding_window(5)):
        want, want_grads = _grads(lambda t, mask=mask: model(t, mask=mask), x)
        got, got_grads = _grads(lambda t, mask=mask: compiled(t, mask=mask), x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_grads[0], want_grads[0], rtol=1e-5, atol=1e-5)
    cache, eager_cache = ak.KVCache(), ak.KVCache()
    step = ak.causal(align="bottom_right")
    for t in range(3):  # decoding: one token at a time
        token = x[:, t : t + 1]
        torch.testing.assert_close(
            compiled(token, mask=step, cache=cache),
            model(token, mask=step, cache=eager_cache),
            rtol=1e-5,
            atol=1e-5,
        )
