"""Which dtype kernels run half in, GQA gradient sums in float32, the planner on tensor masks."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import runtime
from attnkit.call.planner import backend_for_run
from attnkit.call.precision import OVERRIDE_ENV, HalfKernels
from attnkit.contracts import normalize_call
from attnkit.heads import repeat_kv_exact_grad, sum_groups
from fuzz_cases import Case, MaskSpec
from fuzz_check import FUSED, run_case
from helpers import half_kernels, span_backend

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_dtype_follows_the_override_and_keeps_a_bias_in_float32(dtype, monkeypatch):
    half = runtime.current().half
    half_kernels(monkeypatch, "native")
    assert half.kernel_dtype(dtype, CPU) == dtype
    assert half.kernel_dtype(dtype, CPU, bias=True) == torch.float32
    half_kernels(monkeypatch, "float32")
    assert half.kernel_dtype(dtype, CPU) == torch.float32
    assert half.kernel_dtype(torch.float64, CPU) == torch.float64
    assert half.kernel_dtype(torch.float32, CPU) == torch.float32


def test_the_environment_sets_the_half_kernels_once_when_a_runtime_is_made(monkeypatch):
    """`ATTNKIT_HALF_KERNELS` is read when a runtime is made (attnkit's, at import), not
    at every call; a value that is no mode warns, naming the modes."""
    monkeypatch.setenv(OVERRIDE_ENV, " Float32 ")
    mine = runtime.Runtime(ak.cost.built_in, runtime.current().kernels)
    assert mine.half.mode == "float32"
    holders = [b for b in mine.backends if hasattr(b, "half")]
    assert holders and all(b.half is mine.half for b in holders)  # the backends share it
    monkeypatch.setenv(OVERRIDE_ENV, "native")
    assert mine.half.mode == "float32"  # read once
    monkeypatch.setenv(OVERRIDE_ENV, "fp32")
    with pytest.warns(UserWarning, match="auto, native, float32, amx"):
        assert HalfKernels.from_environment().mode == "auto"
    with pytest.raises(ValueError, match="one of auto, native, float32, amx"):
        mine.half.use("half")


def test_changing_the_half_kernels_plans_the_call_again(monkeypatch):
    """The dtype a call computes in is part of its key: a prepared half call is not
    reused after the mode changes."""
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    with runtime.fresh() as mine:
        plans = mine.calls.of(None).plans
        mine.half.use("native")
        ak.attention(q, q, q, backend="sdpa")
        planned = len(plans)
        ak.attention(q, q, q, backend="sdpa")
        assert len(plans) == planned  # the same call: its plan reused
        mine.half.use("float32")
        ak.attention(q, q, q, backend="sdpa")
        assert len(plans) > planned  # another dtype inside: planned again
        planned = len(plans)
        mine.half.use("amx")
        ak.attention(q, q, q, backend="sdpa")
        assert len(plans) > planned  # AMX's tiles asked for: planned again


def test_the_amx_mode_is_native_half_with_the_tiles_asked_for():
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    amx, native = HalfKernels("amx"), HalfKernels("native")
    assert amx.kernel_dtype(torch.bfloat16, CPU) == native.kernel_dtype(torch.bfloat16, CPU)
    assert amx.plan_key(torch.bfloat16, CPU) == (torch.bfloat16, True)
    assert native.plan_key(torch.bfloat16, CPU) == (torch.bfloat16, False)
    assert amx.on_amx_tiles(q, alibi=False) and not native.on_amx_tiles(q, alibi=False)
    assert not amx.on_amx_tiles(q, alibi=True)  # ALiBi keeps the call in float32
    assert not amx.on_amx_tiles(q.half(), alibi=False)  # the tiles take bfloat16


def test_repeat_kv_gradient_sums_the_group_in_float32():
    """Four per-head gradients of 1 + 2^-8 each: bfloat16 addition would round the
    partial sums (2 + 2^-7 + ... loses the low bits); float32 then one rounding keeps 4.0156."""
    x = torch.ones(1, 1, 1, 1, dtype=torch.bfloat16, requires_grad=True)
    y = repeat_kv_exact_grad(x, 4)  # (1, 4, 1, 1)
    assert y.shape == (1, 4, 1, 1)
    y.backward(torch.full_like(y, 1 + 2**-7))
    plain = torch.ones(1, 1, 1, 1, dtype=torch.bfloat16, requires_grad=True)
    plain.repeat_interleave(4, dim=1).backward(torch.full((1, 4, 1, 1), 1 + 2**-7).bfloat16())
    exact = 4 * (1 + 2**-7)
    assert abs(x.grad.item() - exact) <= abs(plain.grad.item() - exact)
    assert abs(x.grad.item() - exact) <= 2**-6  # one bfloat16 rounding of 4.03


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["native", "float32"])
def test_half_results_keep_the_dtype_and_lse_stays_float32(dtype, mode, monkeypatch):
    half_kernels(monkeypatch, mode)
    q, k, v = (torch.randn(1, 4, 33, 16).to(dtype) for _ in range(3))
    for backend in ("sdpa", "tiled"):
        out, lse = ak.attention_with_lse(q, k[:, :2], v[:, :2], ak.causal(), backend=backend)
        assert out.dtype == dtype and lse.dtype == torch.float32


def test_auto_runs_a_dense_tensor_mask_on_sdpa_and_structure_on_tiled():
    q = torch.randn(2, 4, 512, 64)
    dense = torch.rand(2, 1, 512, 512) > 0.5
    assert ak.explain(q, q, q, dense).backend == "sdpa"
    assert ak.explain(q, q, q, ak.causal() & dense).backend == "sdpa"
    assert ak.explain(q, q, q, ak.sliding_window(31)).backend == span_backend()


def test_decoding_step_runs_without_a_mask_tensor():
    """Bottom-right causal at L = 1 sees every key: SDPA gets no mask (the decode fast path)."""
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 40, 16)
    k[:, :, 5] = torch.nan  # a visible key holding NaN must still reach the output
    out = ak.attention(q, k, k, ak.causal(align="bottom_right"), backend="sdpa")
    assert torch.isnan(out).all()
    k[:, :, 5] = 0.0
    want = ak.attention(q, k, k, None, backend="reference")
    torch.testing.assert_close(ak.attention(q, k, k, ak.causal(align="bottom_right")), want)


@pytest.mark.parametrize(
    ("mask", "L", "S", "want"),
    [
        (ak.causal(align="bottom_right"), 1, 64, True),
        (ak.causal(align="bottom_right"), 2, 64, False),
        (ak.causal(align="top_left"), 1, 64, False),
        (ak.causal(), 1, 1, True),
        (ak.sliding_window(63, align="bottom_right"), 1, 64, True),
        (ak.sliding_window(62, align="bottom_right"), 1, 64, False),
        (ak.sliding_window(70, 70), 64, 64, True),
        (ak.sliding_window(70, 62), 64, 64, False),
        (ak.prefix_lm(64), 64, 64, True),
        (ak.prefix_lm(63), 64, 64, False),
        (
            ak.causal(align="bottom_right") & ak.sliding_window(100, align="bottom_right"),
            1,
            64,
            True,
        ),
        (ak.causal(align="bottom_right") & ak.key_padding(torch.tensor([64])), 1, 64, False),
        (ak.causal(align="top_left") | ak.prefix_lm(64, align="top_left"), 3, 64, True),
        (~ak.causal(align="bottom_right"), 1, 64, False),
        (ak.causal(offset=63), 5, 64, True),
        (ak.causal(offset=62), 1, 64, False),
        (ak.chunked(64), 64, 64, True),
        (ak.chunked(64, offset=60), 4, 64, True),
        (ak.chunked(64, offset=61), 4, 64, False),
        (ak.chunked(64, offset=-1), 4, 64, False),
        (ak.chunked(62), 63, 63, False),
    ],
)
def test_sees_all_agrees_with_the_materialized_mask(mask, L, S, want):
    assert mask.sees_all(L, S) == want
    if want:  # never True where some pair is hidden
        assert bool(mask.materialize(1, 1, L, S).all())


def test_the_run_takes_the_backend_explain_names_for_dense_calls():
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 300, 16)
    for mask in (
        None,
        ak.causal(align="bottom_right"),
        ak.sliding_window(400, align="bottom_right"),
    ):
        call = normalize_call(q, k, k, mask, table=runtime.current().costs.table())
        assert (
            backend_for_run(call, "auto", need_lse=False).name == ak.explain(q, k, k, mask).backend
        )
        assert ak.explain(q, k, k, mask).backend == "sdpa"


def test_sum_groups_keeps_float64_and_sums_half_in_float32():
    g = torch.randn(2, 6, 5, 4, dtype=torch.float64)
    got = sum_groups(g, 3)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, g.view(2, 2, 3, 5, 4).sum(2), rtol=0, atol=0)
    half = torch.full((1, 4, 1, 1), 1 + 2**-7).bfloat16()
    assert abs(sum_groups(half, 4).item() - 4 * (1 + 2**-7)) <= 2**-6


def test_conventions_design_and_the_harness_state_the_same_precision_bound():
    """The bound the docs promise is the one tests/fuzz_check.py checks: its floors, its
    reordering factor and the backends that take the slack appear in both documents."""
    from pathlib import Path

    import fuzz_check

    root = Path(__file__).resolve().parent.parent
    words = {
        "conventions.md": (root / "docs" / "conventions.md").read_text(),
        "DESIGN.md": (root / "docs" / "DESIGN.md").read_text(),
    }
    c = f"{fuzz_check.LSE_ROUNDING:g}·ε·m·σ(x)"
    floors = {
        torch.float32: "`1e-5` float32",
        torch.float16: "`2e-3` float16",
        torch.bfloat16: "`1.6e-2` bfloat16",
    }
    assert set(floors) | {torch.float64} == set(fuzz_check.FLOOR)
    for name, text in words.items():
        assert "2·‖x_w − x₆₄‖∞ + f_T·max(1, ‖x₆₄‖∞) + " in text, name
        stated_c = "c·ε·m·σ(x)" in text and f"`c = {fuzz_check.LSE_ROUNDING:g}`" in text
        assert c in text or stated_c, name
        for dtype, phrase in floors.items():
            assert float(phrase.split("`")[1]) == fuzz_check.FLOOR[dtype], phrase
            assert phrase in text, (name, phrase)
        assert "`1e-12 + 4·ε₆₄·m` float64" in text and fuzz_check.FLOOR[torch.float64] == 1e-12
        assert fuzz_check._EPS64 == 4 * torch.finfo(torch.float64).eps
        for backend in (b for b in (*fuzz_check.backends(), "flex") if fuzz_check.reordered(b)):
            assert f"`{backend}`" in text, (name, backend)


def _extreme_case(backend_dtype: torch.dtype) -> Case:
    return Case(
        B=1,
        H=2,
        Hkv=1,
        L=64,
        S=64,
        D=16,
        Dv=16,
        dtype=backend_dtype,
        layouts=("contiguous",) * 3,
        mask=MaskSpec("causal()", lambda c, g: ak.causal()),
        magnitude=1e4,
        scale=None,
        softcap=None,
        poison=None,
        seed=3,
    )


def test_extreme_logits_keep_the_documented_promise():
    """At |logits| ~ 1e4 in float32 every backend keeps the rule for outputs and lse; the
    fused backends' gradients get the documented extra eps·max|s| (DESIGN.md §2)."""
    outcomes = run_case(_extreme_case(torch.float32))
    failures = [o for o in outcomes if o.failed]
    assert not failures, failures
    ran = {(o.backend, o.what) for o in outcomes if o.status == "ok"}
    assert {("sdpa", "backward"), ("tiled", "backward+lse"), ("reference", "backward+lse")} <= ran


def test_extreme_logits_show_the_lse_rounding_on_fused_gradients_only():
    """The slack is needed: without it a fused backward misses the strict rule, while the
    reference (which keeps its weights) meets it."""
    import fuzz_check

    strict = dict(vars(fuzz_check))
    try:
        fuzz_check.LSE_ROUNDING = 0.0
        outcomes = run_case(_extreme_case(torch.float32))
    finally:
        fuzz_check.LSE_ROUNDING = strict["LSE_ROUNDING"]
    wrong = {o.backend for o in outcomes if o.status == "wrong"}
    assert wrong and wrong <= set(FUSED)
