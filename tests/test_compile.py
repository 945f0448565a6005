"""attnkit inside `torch.compile`: same outputs and gradients as eager, with
`fullgraph=True` for every mask kind (the call is one custom op, `attnkit.call.compiled`),
and `torch.library.opcheck` on both ops. Small shapes: seconds per case."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.call.compiled import attention_backward_op, attention_op
from attnkit.masks.spec import encode


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
    "chunked_offset": lambda: ak.chunked(4) & ak.causal(offset=1),
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
    got, got_grads = _grads(torch.compile(fn, fullgraph=True), q, k, v)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_a_from_mod_mask_runs_eagerly_inside_compiled_code():
    """A mask_mod is a Python function: it cannot cross the op as a string (graph break)."""
    torch._dynamo.reset()
    mask = ak.Mask.from_mod(lambda b, h, q, kv: (kv <= q) & ((q - kv) % 3 != 1))
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 12, 8, generator=g) for _ in range(3))

    def fn(q, k, v):
        return ak.attention(q * 2, k, v, mask).tanh()

    want, want_grads = _grads(fn, q, k, v)
    got, got_grads = _grads(torch.compile(fn), q, k, v)
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


def test_dropout_and_trainable_float_masks_run_eagerly_inside_compiled_code():
    """What the op cannot express breaks the graph and runs eagerly (not silently wrong)."""
    torch._dynamo.reset()
    q = torch.randn(1, 2, 8, 4)
    bias = torch.zeros(1, 2, 8, 8, requires_grad=True)

    def fn(q):
        return ak.attention(q, q, q, bias).sum()

    torch.compile(fn)(q).backward()
    assert bias.grad is not None and bias.grad.shape == bias.shape
    out = torch.compile(lambda q: ak.attention(q, q, q, dropout_p=0.5))(q)
    assert out.shape == q.shape


def test_compiled_call_raises_the_eager_errors():
    torch._dynamo.reset()
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 5)
    with pytest.raises(Exception, match="head dim"):
        torch.compile(lambda q, k: ak.attention(q, k, k), fullgraph=True)(q, k)


def _op_samples():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 7, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 7, 5, generator=g, requires_grad=True)
    lengths = torch.tensor([7, 3])
    for mask in (None, ak.causal(align="bottom_right"), ak.key_padding(lengths)):
        tensors = []
        spec = encode(mask, tensors)
        for backend, need_lse in (("auto", True), ("reference", False)):
            yield (q, k, v, tensors, spec, backend, None, None, need_lse, True)


@pytest.mark.parametrize("args", list(_op_samples()))
def test_opcheck_attention_op(args):
    torch.library.opcheck(attention_op, args)


@pytest.mark.parametrize("path", ["flash", "blockwise", "recompute"])
def test_opcheck_attention_backward_op(path):
    """From the forward's out and lse: one flash backward (no mask needed), tiled's
    blockwise backward (a padding mask), or (no lse kept) a recomputed forward."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, n, 6, 8, generator=g) for n in (4, 2, 2))
    mask = ak.key_padding(torch.tensor([6, 3])) if path == "blockwise" else None
    tensors = []
    spec = encode(mask, tensors)
    out, lse, kept = attention_op(q, k, v, tensors, spec, "auto", None, None, True, True)
    assert kept.dtype == torch.bool and bool(kept)  # a CPU backend gave its lse
    if path == "recompute":
        lse, kept = torch.zeros_like(lse), torch.tensor(False)  # the backward must not read it
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    args = (dout, dlse, out, lse, kept, q, k, v, tensors, spec, "auto", None, None, True)
    torch.library.opcheck(attention_backward_op, args)
    want = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = ak.attention_with_lse(*want, mask, backend="reference")
    torch.autograd.backward((out_ref, lse_ref), (dout, dlse))
    got = attention_backward_op(*args)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b.grad, rtol=1e-4, atol=1e-5)


def test_new_document_ids_reuse_the_compiled_graph():
    """Mask tensors are op inputs, not constants: other ids, same graph, their result."""
    torch._dynamo.reset()
    model = ak.MultiHeadAttention(32, 4, num_kv_heads=2, rope=True)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 12, 32)
    first = ak.document(torch.arange(12) // 5) & ak.causal()
    torch.testing.assert_close(compiled(x, mask=first), model(x, mask=first))
    other = ak.document(torch.arange(12) // 3) & ak.causal()
    with torch.compiler.set_stance("fail_on_recompile"):
        got = compiled(x, mask=other)
    torch.testing.assert_close(got, model(x, mask=other))


def test_the_backward_op_runs_the_backward_of_the_forwards_backend(monkeypatch):
    """The compiled op's gradients come from the backend that ran its forward, where its
    backward serves (the one `auto` priced the call with), before any other's."""
    from attnkit.backends import BACKENDS
    from helpers import span_backend

    ran = []
    for name, backend in BACKENDS.items():
        original = backend.backward

        def counting(*args, name=name, original=original):
            ran.append(name)
            return original(*args)

        monkeypatch.setattr(backend, "backward", counting)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 512, 16, generator=g, requires_grad=True) for _ in range(3))
    mask = ak.causal()  # sdpa's backward serves it too (one call, no mask)
    backend = ak.explain(q, k, v, mask).backend
    tensors: list[torch.Tensor] = []
    spec = encode(mask, tensors)
    out, lse, kept = attention_op(q, k, v, tensors, spec, "auto", None, None, False, True)
    assert bool(kept) and backend == span_backend()
    dout = torch.randn_like(out)
    grads = attention_backward_op(
        dout, lse.new_empty(0), out, lse, kept, q, k, v, tensors, spec, "auto", None, None, False
    )
    assert ran == [backend]
    want = torch.autograd.grad(ak.attention(q, k, v, mask, backend="reference"), (q, k, v), dout)
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
