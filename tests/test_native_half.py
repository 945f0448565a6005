"""The native kernel's bfloat16 path on the CPU's half units, and its float32 fallback.

Where the runtime's `precision.HalfKernels` runs half natively (a CPU with AVX512-BF16 or AMX, or
`ATTNKIT_HALF_KERNELS=native`), bfloat16 blocks multiply on the half units (half.h:
products in bfloat16, sums in float32, the weights rounded to bfloat16 for P·V); with
`ATTNKIT_HALF_KERNELS=float32` (or a build without the units) they are converted to
float32. Both paths keep the flash-attention rule against float64 on GQA/MQA, partial
tiles, odd D, strided inputs, empty rows and softcap, and neither lets a non-finite
value at a key reach a row that does not see it.
"""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import _compat, runtime
from attnkit.contracts import normalize_call
from attnkit.native import build
from helpers import assert_rule, half_kernels

pytestmark = pytest.mark.skipif(build.setting() == "off", reason="ATTNKIT_NATIVE=off")

# built for a CPU with the units: `-march=native` defines __AVX512BF16__ and torch's
# 16-lane vectors come with its AVX512 capability
UNITS = _compat.half_matmul_is_fast(torch.bfloat16, "cpu") and (
    torch.backends.cpu.get_cpu_capability() == "AVX512"
)
TILES = UNITS and _compat.cpu_features()["AMX"]  # AMX: whole blocks on brgemm in "amx"
MODES = ["native", "float32"] + (["amx"] if TILES else [])


def _run(mode, q, k, v, mask, **kwargs):
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        half_kernels(patch, mode)
        return ak.attention_with_lse(q, k, v, mask, backend="native", **kwargs)


def _inputs(B, H, Hkv, L, S, D, Dv, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g).bfloat16()
    k = torch.randn(B, Hkv, S, D, generator=g).bfloat16()
    v = torch.randn(B, Hkv, S, Dv, generator=g).bfloat16()
    return q, k, v


def _check(mode, q, k, v, mask, **kwargs):
    out, lse = _run(mode, q, k, v, mask, **kwargs)
    with torch.no_grad():
        want, want_lse = ak.attention_with_lse(
            q.double(), k.double(), v.double(), mask, backend="reference", **kwargs
        )
        naive = ak.attention(q, k, v, mask, backend="reference", **kwargs)
    assert out.dtype == torch.bfloat16
    assert_rule(f"native bfloat16 ({mode})", out, naive, want)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    seen = torch.isfinite(want_lse)
    if seen.any():
        assert (lse[seen].double() - want_lse[seen]).abs().max() < 1e-3
    return out


SHAPES = {  # (B, H, Hkv, L, S, D, Dv): tiles cut short, odd D and Dv, one key, one query
    "MHA": (2, 4, 4, 131, 300, 64, 64),
    "GQA-odd-D": (1, 6, 2, 70, 517, 33, 17),
    "MQA": (2, 8, 1, 37, 1030, 80, 48),
    "one-key": (1, 2, 2, 9, 1, 16, 16),
    "decode": (3, 8, 2, 1, 700, 64, 64),
    "D1": (1, 2, 1, 5, 40, 1, 3),
}
MASKS = ["none", "causal", "sliding", "padding", "documents"]


def _mask(kind, B, L, S):
    if kind == "causal":
        return ak.causal(align="bottom_right")
    if kind == "sliding":
        return ak.sliding_window(37, align="bottom_right")
    if kind == "padding":  # batch row 1 sees nothing
        return ak.key_padding(torch.tensor([S, 0, max(S // 2, 1)])[:B])
    if kind == "documents" and L == S:
        return ak.document(torch.arange(S) * 3 // S)
    return None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_both_half_paths_keep_the_rule(mode, mask_kind, shape):
    B, H, Hkv, L, S, D, Dv = SHAPES[shape]
    q, k, v = _inputs(B, H, Hkv, L, S, D, Dv, seed=L * 7 + S)
    _check(mode, q, k, v, _mask(mask_kind, B, L, S))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["bthd", "every_other_d"])
def test_strided_inputs_and_softcap(mode, how):
    q, k, v = _inputs(2, 4, 2, 129, 260, 40, 24, seed=5)
    if how == "bthd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    else:
        q, k, v = (torch.cat([t, t], -1)[..., : t.shape[-1]] for t in (q, k, v))
    mask = ak.sliding_window(50, align="bottom_right")
    _check(mode, q, k, v, mask, softcap=2.0, scale=0.3)


@pytest.mark.skipif(not UNITS, reason="this CPU has no bfloat16 units the kernel uses")
def test_the_half_units_compute_where_kernel_dtype_says_half():
    """The two paths are different code: the half units round the weights to bfloat16,
    the float32 path does not, so some output differs in its last bits."""
    q, k, v = _inputs(1, 4, 4, 200, 300, 64, 64, seed=1)
    mask = ak.causal(align="bottom_right")
    native, float32 = (_run(mode, q, k, v, mask)[0] for mode in ("native", "float32"))
    assert not torch.equal(native, float32)
    assert _run("float32", q, k, v, mask, softcap=None)[0].equal(float32)  # repeatable


@pytest.mark.parametrize("shape", ["MHA", "GQA-odd-D", "decode"])
def test_the_amx_mode_multiplies_on_the_tiles_only_where_the_cpu_has_them(shape):
    """Asked for AMX's tiles, a CPU without them runs the half units' own products (the
    same bits as "native"); one with them runs whole blocks of 16 stacked rows or more on
    brgemm, which sums in another order."""
    B, H, Hkv, L, S, D, Dv = SHAPES[shape]
    q, k, v = _inputs(B, H, Hkv, L, S, D, Dv, seed=3)
    native, amx = (_run(mode, q, k, v, None)[0] for mode in ("native", "amx"))
    assert torch.equal(native, amx) == (not TILES or H // Hkv * L < 16)
    grads = {}
    for mode in ("native", "amx"):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        with pytest.MonkeyPatch.context() as patch:
            half_kernels(patch, mode)
            ak.attention(*x, ak.causal(align="bottom_right"), backend="native").sum().backward()
        grads[mode] = [t.grad for t in x]
    same = all(torch.equal(a, b) for a, b in zip(grads["native"], grads["amx"], strict=True))
    assert same == (not TILES or H // Hkv * L < 16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["k", "v"])
def test_a_non_finite_key_or_value_reaches_only_the_rows_that_see_it(mode, poison, where):
    """Key 40 of a causal call: rows 0-39 never see it, and in a window the rows past it
    never see it either; a whole block and a cut group both hold it (S = 600: blocks of
    512 keys). Those rows keep the rule against the clean call in float64 (a group that
    holds the value sums each row's own keys, in another order than the tile)."""
    q, k, v = _inputs(1, 4, 2, 600, 600, 32, 32, seed=3)
    for mask in (ak.causal(), ak.sliding_window(30)):
        with torch.no_grad():
            want = ak.attention(q.double(), k.double(), v.double(), mask, backend="reference")
            naive = ak.attention(q, k, v, mask, backend="reference")
        bad_k, bad_v = k.clone(), v.clone()
        (bad_k if where == "k" else bad_v)[:, :, 40] = poison
        got = _run(mode, q, bad_k, bad_v, mask)[0]
        rows = ~mask.materialize(1, 1, 600, 600)[0, 0, :, 40]  # (L,) rows that hide key 40
        assert torch.isfinite(got[:, :, rows]).all()
        assert_rule(
            f"hidden {where} ({mode})", got[:, :, rows], naive[:, :, rows], want[:, :, rows]
        )


def test_the_cost_prices_bfloat16_on_the_half_units_by_the_kinds_factor(monkeypatch):
    """`bf16` scales the forward's work where the units run (AVX512-BF16's own factor, the
    tiles' on AMX, 1 on AVX2), nothing where they do not (`ATTNKIT_HALF_KERNELS=float32`, an
    ALiBi call); forward and backward both run on the units, so the training factor is
    the kind's `backward_half`."""
    from attnkit.backends import get_backend
    from attnkit.backends.nativecost import BF16_AVX512
    from attnkit.call import cost
    from attnkit.contracts import normalize_call

    native = get_backend("native")
    assert native.cost_factors.built_in("avx512_bf16")["bf16"] == BF16_AVX512 < 1.0
    assert native.cost_factors.built_in("amx")["bf16"] > 1.0
    assert native.cost_factors.built_in("avx2")["bf16"] == 1.0
    q, k, v = _inputs(1, 8, 8, 2048, 2048, 64, 64, seed=0)
    half_kernels(monkeypatch, "native")
    table = cost.built_in("avx512_bf16")
    call = normalize_call(q, k, v, ak.causal(), table=table)
    alibi = normalize_call(q, k, v, ak.causal() & ak.alibi(8), table=table)
    assert native.half_units(call) and not native.half_units(alibi)
    fast = native.cost(call, need_lse=False)
    half_kernels(monkeypatch, "float32")
    assert not native.half_units(call)
    slow = native.cost(call, need_lse=False)
    call_cost = native.factors(table)["call"]
    assert fast - call_cost == pytest.approx((slow - call_cost) * BF16_AVX512)
    half_kernels(monkeypatch, "native")
    grad = normalize_call(*(t.requires_grad_() for t in (q, k, v)), ak.causal(), table=table)
    backward = native.factors(table)["backward_half"]
    assert native.training_factor(grad) == pytest.approx(backward)


GRAD_MASKS = ["none", "causal", "padding", "causal_left_padding", "sliding", "prefix_lm"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask_kind", GRAD_MASKS)
@pytest.mark.parametrize("heads", ["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("size", [(97, 97), (1, 97), (97, 1025)])
def test_both_half_paths_keep_the_rule_for_gradients(mode, mask_kind, heads, size):
    """The backward on the half units (products in bfloat16: S, dP, dV += Pᵀ·dO, dK +=
    dSᵀ·Q, dQ += dS·K) and its float32 fallback against float64, with the naive bfloat16
    gradients as the yardstick; rows that see nothing (padding) give zero gradients."""
    from test_reference_matrix import run, truth_and_reference

    (q, k, v, mask, dout), truth, ref = truth_and_reference(
        torch.bfloat16, heads, mask_kind, size, 64
    )
    with pytest.MonkeyPatch.context() as patch:
        half_kernels(patch, mode)
        got = run(q, k, v, mask, dout, "native")
    for name, g, r, t in zip(("out", "dq", "dk", "dv"), got, ref, truth, strict=True):
        assert g.dtype == torch.bfloat16 and g.shape == t.shape
        assert_rule(f"native {name} ({mode})", g, r, t)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["q", "k", "dout"])
def test_a_non_finite_input_a_row_does_not_see_keeps_the_gradients_finite(mode, where):
    """A NaN in a query row, key or output gradient of a cut block poisons the rows that
    read it (and the keys those rows see) and nothing else: the exact loops of the
    backward replace the tiles where a factor holds it."""
    q, k, v = _inputs(1, 4, 2, 300, 300, 32, 32, seed=9)
    dout = torch.randn(1, 4, 300, 32).bfloat16()
    mask = ak.sliding_window(30)
    clean = _grads(mode, q, k, v, dout, mask)
    bad = {"q": q.clone(), "k": k.clone(), "dout": dout.clone()}
    bad[where][0, :, 150] = float("nan")
    got = _grads(mode, bad["q"], bad["k"], v, bad["dout"], mask)
    seen = mask.materialize(1, 1, 300, 300)[0, 0]  # (L, S)
    poisoned = seen[:, 150] if where == "k" else torch.arange(300) == 150  # (L,) rows
    keys = ~seen[poisoned].any(0)  # (S,) keys no poisoned row sees
    for name, g, c in zip(("dq", "dk", "dv"), got, clean, strict=True):
        index = ~poisoned if name == "dq" else keys
        part, want = g[..., index, :].float(), c[..., index, :].float()
        assert torch.isfinite(part).all(), name
        assert (part - want).abs().max() <= 0.02 * want.abs().max() + 1e-3, name


def _grads(mode, q, k, v, dout, mask):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with pytest.MonkeyPatch.context() as patch:
        half_kernels(patch, mode)
        ak.attention(q, k, v, mask, backend="native").backward(dout)
    return q.grad, k.grad, v.grad


class _Probe:
    """A calibration's probe whose calls take fixed times: a tiny call 10 units, the
    window 100 in float32 and 55 in bfloat16."""

    def inputs(self, L, H=8):
        return tuple(torch.zeros(1, H, L, 64) for _ in range(3))

    def attention(self, inputs, mask, backend, runs=3):
        if inputs[0].shape[2] == 16:
            return 10.0
        return 55.0 if inputs[0].dtype == torch.bfloat16 else 100.0


@pytest.mark.parametrize("mode", ["native", "float32"])
def test_calibration_times_bfloat16_where_it_runs_on_the_half_units(monkeypatch, mode):
    """`bf16` is the window's bfloat16 time over its float32 time, net of a call, where
    bfloat16 runs on the half units; elsewhere the factor is never read, and not timed."""
    half_kernels(monkeypatch, mode)
    measured = runtime.current().backends.get("native").calibrate(_Probe())
    assert measured["call"] == 10.0
    if mode == "native":
        assert measured["bf16"] == pytest.approx(45 / 90)
    else:
        assert "bf16" not in measured


def test_a_recorded_half_call_counts_the_float32_output_it_keeps():
    """A half call autograd records keeps its output in float32 for the backward's Δ: the
    memory the planner sees has 4 more bytes per output element."""
    native = runtime.current().backends.get("native")
    q = torch.randn(1, 4, 64, 16).bfloat16()
    x = q.clone().requires_grad_()
    plain, recorded = (
        native.peak_bytes(
            normalize_call(t, t, t, ak.causal(), scale=None, softcap=None), need_lse=False
        )
        for t in (q, x)
    )
    assert recorded - plain == 4 * q.numel()
