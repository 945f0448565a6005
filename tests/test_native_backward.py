"""The native backward (span_backward.cpp) against the float64 reference: dq, dk, dv by
the flash-attention rule on every dtype, MHA/GQA/MQA and every mask the kernel takes
(training calls run on it), awkward sizes and strides; empty rows and keys no row sees
give exact zeros, and a non-finite key, value, query or output gradient a row does not
see never reaches another row's gradients; bitwise-equal gradients across runs and
across packings; the gradient of the log-sum-exp; the op's contract (`opcheck`)."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.native import build, ops, unavailable
from attnkit.native.backward import span_backward
from helpers import assert_rule, naive_same_dtype
from test_reference_matrix import HEADS, MASKS, SIZES, truth_and_reference

pytestmark = pytest.mark.skipif(build.setting() == "off", reason="ATTNKIT_NATIVE=off")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TAKEN = {
    "none",
    "causal",
    "causal_top_left",
    "padding",
    "causal_left_padding",
    "sliding",
    "sliding_two_sided",
    "documents_causal",
    "prefix_lm",
    "chunked_causal_offset",
}


@pytest.fixture(autouse=True, scope="module")
def _built() -> None:
    assert unavailable() is None, unavailable()


def _grads(q, k, v, mask, dout, backend="native", **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = ak.attention(q, k, v, mask, backend=backend, **kwargs)
    (out * dout).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _matrix():
    for dtype in DTYPES:
        for heads in HEADS:
            for mask_kind in sorted(TAKEN & set(MASKS)):
                for size in SIZES:
                    slow = max(size) > 1000 and (dtype != torch.float32 or heads != "GQA")
                    yield pytest.param(
                        dtype,
                        heads,
                        mask_kind,
                        size,
                        marks=[pytest.mark.slow] if slow else [],
                        id=f"{str(dtype)[6:]}-{heads}-{mask_kind}-L{size[0]}-S{size[1]}",
                    )


@pytest.mark.parametrize(("dtype", "heads", "mask_kind", "size"), list(_matrix()))
def test_native_gradients_match_float64_reference(dtype, heads, mask_kind, size):
    (q, k, v, mask, dout), truth, ref = truth_and_reference(dtype, heads, mask_kind, size, 64)
    got = _grads(q, k, v, mask, dout)
    for name, a, r, w in zip(("out", "dq", "dk", "dv"), got, ref, truth, strict=True):
        assert a.dtype == dtype
        assert_rule(f"native {mask_kind} {name}", a, r, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", ["MHA", "GQA"])
@pytest.mark.parametrize(("L", "S"), [(300, 300), (70, 300), (1, 257)])
@pytest.mark.parametrize("terms", ["softcap", "alibi", "both"])
def test_softcap_and_alibi_gradients(dtype, heads, L, S, terms):
    """softcap's derivative 1 − tanh² and ALiBi's bias inside the kernel's backward, with
    a window and causal (bottom-right when L != S): by the rule against float64, the
    comparand the reference in the same dtype (as the forward's test)."""
    H, Hkv = (4, 4) if heads == "MHA" else (8, 2)
    g = torch.Generator().manual_seed(L + S)
    q = torch.randn(2, H, L, 32, generator=g).to(dtype)
    k, v = (torch.randn(2, Hkv, S, 32, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(2, H, L, 32, generator=g).to(dtype)
    align = "bottom_right" if L != S else None
    mask = ak.sliding_window(100, align=align) & ak.causal(align=align)
    if terms != "softcap":
        mask = mask & ak.alibi(H, align=align)
    softcap = 2.0 if terms != "alibi" else None
    got = _grads(q, k, v, mask, dout, softcap=softcap)
    truth = _grads(
        q.double(), k.double(), v.double(), mask, dout.double(), "reference", softcap=softcap
    )
    ref = _grads(q, k, v, mask, dout, "reference", softcap=softcap)
    for name, a, r, w in zip(("out", "dq", "dk", "dv"), got, ref, truth, strict=True):
        assert_rule(f"native {terms} {name}", a, r, w)


def test_large_logits_keep_the_rule_through_the_rest_of_lse():
    """Rows that see two keys, one dominating, at logits in the thousands, float32: the
    forward keeps what rounding lse to float32 left out (its op's third output) and the
    backward subtracts it, so each weight exp(s − lse) is as exact as the naive softmax's
    (without it dv was off by 9x the naive computation's error: an ulp of lse at 2·10³ is
    1.2·10⁻⁴, a weight's relative error)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 4, 64, 64, generator=g, dtype=torch.float64) for _ in range(4))
    q, k = q * 30, k * 30
    mask = ak.sliding_window(1)
    truth = _grads(q, k, v, mask, dout, "reference")
    got = _grads(*(t.float() for t in (q, k, v)), mask, dout.float())
    ref = _grads(*(t.float() for t in (q, k, v)), mask, dout.float(), "reference")
    # out and dv read the weights alone (dq and dk here are 0 in float64: their error is
    # flash's Δ = dO·O against dP, times |k| ~ 240, in every flash backward)
    for name, i in (("out", 0), ("dv", 3)):
        assert_rule(f"native at large logits {name}", got[i], ref[i], truth[i])


ALL_GRADS, WEIGHTS = ("out", "dq", "dk", "dv"), ("out", "dv")


@pytest.mark.parametrize(
    ("H", "L", "S", "mask", "checked"),
    [(4, 1, 1, None, ALL_GRADS), (4, 2, 2, "causal", ALL_GRADS), (1, 129, 1, None, WEIGHTS)],
)
def test_a_decoding_shaped_backward_weighs_a_lone_key_exactly(H, L, S, mask, checked):
    """An independent fuzz's case: float32, one K/V head for H query heads, L = S = 1,
    D = 40, Dv = 8, V transposed, logits near 10⁴: the forward's few rows score through
    the BLAS and the backward's products in another order, a few ulps apart at 10⁴, so dv
    was 8·10⁻⁴ off where a lone key weighs exactly 1. The backward now normalises such
    rows by its own scores (within the rule, as SDPA, tiled and the reference are); a
    causal pair's cut blocks alike; and a long call's last tile of one row scores on the
    same products as the backward's (it went through the BLAS too, unnormalised; its dq and
    dk, 0 in float64, carry flash's Δ = dO·O against dP times |k| ~ 250, as in any flash
    backward: the weights are checked)."""
    g = torch.Generator().manual_seed(7)
    q = torch.nn.functional.normalize(torch.randn(1, H, L, 40, generator=g, dtype=torch.float64))
    k = q[:, :1, :S].clone()  # each row's own key: logits |q|·|k| / √D ~ 10⁴
    q, k = q * 40 * 40**0.5, k * 40 * 40**0.5
    v = torch.randn(1, 1, 8, S, generator=g, dtype=torch.float64).transpose(-1, -2)
    dout = torch.randn(1, H, L, 8, generator=g, dtype=torch.float64)
    mask = ak.causal() if mask else None
    truth = _grads(q, k, v, mask, dout, "reference")
    x = (q.float(), k.float(), v.float())
    got, ref = _grads(*x, mask, dout.float()), _grads(*x, mask, dout.float(), "reference")
    for name, a, r, w in zip(ALL_GRADS, got, ref, truth, strict=True):
        if name in checked:
            assert_rule(f"native lone key {name}", a, r, w)


def test_rows_one_apart_are_laid_out_anew():
    """A transposed (B, Hkv, Dv, 1) value tensor is a (B, Hkv, 1, Dv) one whose rows are 1
    apart (a size-1 dimension's stride is free): the kernels' GEMMs take the row stride as
    their leading dimension, so the op lays such a tensor out anew (the BLAS refused it,
    and its product was never written); the C++ side refuses one that reaches it."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 1, 40, generator=g)
    k = torch.randn(1, 1, 1, 40, generator=g)
    v = torch.randn(1, 1, 8, 1, generator=g).transpose(-1, -2)
    assert v.stride(-2) < v.shape[-1]
    dout = torch.randn(1, 4, 1, 8, generator=g)
    got = _grads(q, k, v, None, dout)
    want = _grads(q, k, v.contiguous(), None, dout, "reference")
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    args = (q, k, v, None, None, None, None, 0.5, 0.0, 1, 16, False, False, False)
    with pytest.raises(RuntimeError, match="rows at least a row apart"):
        torch.ops.attnkit_native.span_forward(*args)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["causal", "sliding", "documents_causal", "padding"])
@pytest.mark.parametrize("size", [(97, 1025), (1025, 1025)])
def test_one_pass_and_two_pass_backwards_both_keep_the_rule(threads, dtype, mask_kind, size):
    """MQA with B = 2 is two (batch row, K/V head) items: one thread takes all of an item
    in one pass on 1 or 2 threads; on 3 a second pass per query tile gives dq."""
    (q, k, v, mask, dout), truth, ref = truth_and_reference(dtype, "MQA", mask_kind, size, 64)
    results = []
    for n in (2, 3):
        threads(n)
        results.append(got := _grads(q, k, v, mask, dout))
        for name, a, r, w in zip(("out", "dq", "dk", "dv"), got, ref, truth, strict=True):
            assert_rule(f"native {n} threads {mask_kind} {name}", a, r, w)
    assert torch.equal(results[0][2], results[1][2])  # dk, dv: the same blocks either way
    assert torch.equal(results[0][3], results[1][3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_gradients_flow_through_the_log_sum_exp(dtype):
    """Sinks merge in by the kernel's lse: q, k, v and the sinks' own gradients by the
    rule against float64 (rows that see nothing included: their output is 0)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 90, 32, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 90, 32, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(2, 8, 90, 32, generator=g).to(dtype)
    sinks = torch.randn(8, generator=g)
    mask = ak.sliding_window(20) & ak.key_padding(torch.tensor([90, 0]))

    def grads(backend, dt):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v, sinks)]
        out = ak.attention(*leaves[:3], mask, sinks=leaves[3], backend=backend)
        (out * dout.to(dt)).sum().backward()
        return [out.detach(), *(t.grad for t in leaves)]

    got, truth = grads("native", dtype), grads("reference", torch.float64)
    ref = grads("reference", dtype)
    for name, a, r, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref, truth, strict=True):
        assert_rule(f"native sinks {name}", a, r, w)
    assert torch.equal(got[0][1], torch.zeros_like(got[0][1]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("D", "Dv"), [(40, 24), (1, 3)])
def test_strided_inputs_and_odd_head_dims(dtype, D, Dv):
    g = torch.Generator().manual_seed(D)
    q = torch.randn(2, 6, 131, D, generator=g).to(dtype)
    k = torch.randn(2, 3, 300, D, generator=g).to(dtype)
    v = torch.randn(2, 3, 300, Dv, generator=g).to(dtype)
    dout = torch.randn(2, 6, 131, Dv, generator=g).to(dtype)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, L, H, D) underneath
    k = k.transpose(1, 2).contiguous().transpose(1, 2)
    mask = ak.sliding_window(37, align="bottom_right") & ak.key_padding(torch.tensor([300, 211]))
    truth = _grads(q.double(), k.double(), v.double(), mask, dout.double(), "reference")
    if dtype == torch.float32:
        ref = _grads(q, k, v, mask, dout, "reference")
    else:
        ref = naive_same_dtype(q, k, v, mask, dout, dtype)
    got = _grads(q, k, v, mask, dout)
    for name, a, r, w in zip(("out", "dq", "dk", "dv"), got, ref, truth, strict=True):
        assert_rule(f"strided {name}", a, r, w)


def test_empty_rows_and_unseen_keys_get_exact_zeros():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    mask = ak.key_padding(torch.tensor([6, 0])) & ak.causal(offset=-3)  # rows 0-2 see none
    _, dq, dk, dv = _grads(q, k, v, mask, torch.randn(2, 4, 9, 8, generator=g))
    assert (dq[1] == 0).all() and (dq[0, :, :3] == 0).all()
    assert (dk[1] == 0).all() and (dv[1] == 0).all()  # batch row 1 sees no key
    assert (dk[0, :, 6:] == 0).all() and (dv[0, :, 6:] == 0).all()  # padding


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_values_a_row_does_not_see_never_leak(poison):
    """Three causal documents in one call: NaN (or inf) in one document's keys, values,
    queries and output gradients; every gradient of the other documents stays exact."""
    g = torch.Generator().manual_seed(3)
    L = 400
    q, k, v, dout = (torch.randn(1, 4, L, 32, generator=g) for _ in range(4))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    ids = (torch.arange(L) >= 150).long() + (torch.arange(L) >= 260).long()
    mask = ak.document(ids) & ak.causal()
    want = _grads(q.double(), k.double(), v.double(), mask, dout.double(), "reference")
    bad = [t.clone() for t in (q, k, v, dout)]
    for t, at in zip(bad, (170, 180, 190, 200), strict=True):
        t[:, :, at] = poison  # all in document 1 (rows and keys 150..259)
    got = _grads(*bad[:3], mask, bad[3])
    others = torch.cat([torch.arange(150), torch.arange(260, L)])
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        part = a[:, :, others]
        assert torch.isfinite(part).all(), name
        assert (part.double() - w[:, :, others]).abs().max() < 1e-5, name


def test_gradients_are_bitwise_repeatable_and_pack_invariant():
    """Two runs give the same bits (no atomics: every sum in one order); through
    `attention`, a sequence's gradients are the same alone and packed after another
    (packed documents run one call each), whatever the other holds."""
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, 8, 500, 64, generator=g) for _ in range(4))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    ids = (torch.arange(500) >= 213).long()
    mask = ak.document(ids) & ak.causal()
    first, second = _grads(q, k, v, mask, dout), _grads(q, k, v, mask, dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    one = ak.causal() & ak.sliding_window(300)  # a single call of the kernel, cut blocks
    assert all(
        torch.equal(a, b)
        for a, b in zip(_grads(q, k, v, one, dout), _grads(q, k, v, one, dout), strict=True)
    )
    alone = _grads(*(t[:, :, 213:] for t in (q, k, v)), ak.causal(), dout[:, :, 213:])
    for a, b in zip(alone, first, strict=True):
        assert torch.equal(a, b[:, :, 213:])


def test_the_log_sum_exp_gradient_flows():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 4, 50, 16, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    mask = ak.sliding_window(9)
    dout, dlse = torch.randn(1, 4, 50, 16, generator=g), torch.randn(1, 4, 50, generator=g)
    grads = []
    for backend, dtype in (("reference", torch.float64), ("native", torch.float32)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = ak.attention_with_lse(*leaves, mask, backend=backend)
        ((out * dout.to(dtype)).sum() + (lse * dlse.to(dtype)).sum()).backward()
        grads.append([t.grad.double() for t in leaves])
    for want, got in zip(*grads, strict=True):
        assert (got - want).abs().max() < 1e-5


def test_opcheck_of_the_backward_op():
    q, k, v = torch.randn(2, 4, 33, 16), torch.randn(2, 2, 50, 16), torch.randn(2, 2, 50, 8)
    lo = torch.arange(33).clamp(max=40)[None].expand(2, 33).contiguous()
    hi = (lo + 10).clamp(max=50)
    for dtype in DTYPES:
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        out, lse = ops.span_forward(qd, kd, vd, ops.row_intervals(lo, hi, 2, 33, 50), 0.25)
        dout = torch.randn_like(out)
        slopes, positions = torch.rand(2, 33, 4), torch.arange(33)[None].repeat(2, 1)
        for glse, spans, bias, softcap in (
            (None, (lo, hi), (None, None), 0.0),
            (torch.randn_like(lse), (None, None), (None, None), 0.0),
            (None, (lo, hi), (slopes, positions), 3.0),
        ):
            args = (qd, kd, vd, out, dout, lse, glse, *spans, *bias, 0.25, softcap, 16, 32)
            # float32; the half units (bfloat16 where built); AMX's tiles where the CPU has them
            for units in ((False, False), (True, False), (True, True)):
                torch.library.opcheck(torch.ops.attnkit_native.span_backward, (*args, *units))
            kept = (qd, kd, vd, out.float(), *args[4:])  # the output in float32
            torch.library.opcheck(torch.ops.attnkit_native.span_backward, kept)
        grads = span_backward(qd, kd, vd, out, dout, lse, None, 0.25)
        assert [t.shape for t in grads] == [qd.shape, kd.shape, vd.shape]


def test_half_gradients_take_delta_from_the_weights_not_the_rounded_output():
    """Fuzz seed 37, native case 1254: float16, a padding mask, |logit| ~ 10: Δ = dO·O from
    the float16 output moved dq past the rule (1.1x the bound) through dP − Δ; Δ summed
    as Σ P·dP in float32 keeps it within."""
    from fuzz_cases import RandomDraw, draw_case
    from fuzz_check import run_case

    outcomes = run_case(draw_case(RandomDraw(37, 1254), flex_percent=0), only=("native",))
    assert [o.status for o in outcomes] == ["ok", "ok"], outcomes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_call_that_records_keeps_its_output_in_float32_for_delta(dtype):
    """Autograd recording, the forward keeps its float32 output (the backward takes
    Δ = dO·O from it, with no pass over P·dP); the caller gets the same bits as without."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 70, 24, generator=g).to(dtype) for _ in range(3))
    lo = torch.zeros(2, 70, dtype=torch.long)
    hi = torch.arange(1, 71).expand(2, 70).contiguous()  # causal
    visible = ops.row_intervals(lo, hi, 2, 70, 70)
    with torch.no_grad():
        plain, plain_lse = ops.span_forward(q, k, v, visible, 0.3)
        args = (q, k, v, lo, hi, None, None, 0.3, 0.0, *ops.blocking(70, 1)[:2], False, False)
        kept, _, rest = torch.ops.attnkit_native.span_forward(*args, True)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ops.span_forward(*x, visible, 0.3)
    assert kept.dtype == torch.float32 and torch.equal(kept.to(dtype), plain)
    assert out.dtype == dtype and torch.equal(out, plain) and torch.equal(lse, plain_lse)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(dout)
    with torch.no_grad():
        from_kept = span_backward(q, k, v, kept, dout, plain_lse, visible, 0.3, rest=rest)
        summed = span_backward(q, k, v, plain, dout, plain_lse, visible, 0.3)
    assert all(torch.equal(a.grad, b) for a, b in zip(x, from_kept, strict=True))
    for a, b in zip(x, summed, strict=True):  # Σ P·dP instead: the same up to rounding
        assert (a.grad.float() - b.float()).abs().max() < 0.05


@pytest.mark.parametrize(
    ("D", "Dv", "L", "S"), [(0, 4, 5, 7), (4, 0, 5, 7), (4, 4, 0, 7), (4, 4, 5, 0)]
)
def test_empty_dimensions(D, Dv, L, S):
    """No key dimension (uniform weights), no value dimension, no query, no key."""
    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(1, 4, L, D, generator=g), torch.randn(1, 2, S, D, generator=g)
    v, dout = torch.randn(1, 2, S, Dv, generator=g), torch.randn(1, 4, L, Dv, generator=g)
    mask = ak.causal(align="bottom_right") if L <= S else None
    want = _grads(q.double(), k.double(), v.double(), mask, dout.double(), "reference")
    out, lse = ops.span_forward(q, k, v, None, 0.5)
    got = span_backward(q, k, v, out, dout, lse, None, 0.5)
    plain = _grads(q, k, v, None, dout, "reference")
    for a, w in zip(got, plain[1:], strict=True):
        assert a.shape == w.shape
        assert a.numel() == 0 or (a.double() - w.double()).abs().max() < 1e-5
    assert want[0].shape == out.shape


@pytest.mark.parametrize(
    ("mask", "softcap"),
    [
        (ak.sliding_window(4, align="top_left") & ak.causal(align="top_left"), None),
        (ak.causal(align="bottom_right") & ak.alibi(2, align="bottom_right"), 1.5),
    ],
    ids=["window", "alibi-softcap"],
)
def test_gradcheck(mask, softcap):
    """Finite differences against the kernel's backward, the lse's gradient included. The
    kernel computes in float32 (float64 is the reference's), so the differences run in
    float32 with a step and tolerances to match (a wrong term misses by far more)."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 7, 4, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 1, 9, 4, generator=g, requires_grad=True) for _ in range(2))

    def f(q, k, v):
        out, lse = ak.attention_with_lse(q, k, v, mask, softcap=softcap, backend="native")
        return out, lse

    with pytest.warns(UserWarning, match="double precision"):
        assert torch.autograd.gradcheck(f, (q, k, v), eps=2e-3, atol=3e-3, rtol=3e-3)
