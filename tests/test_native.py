"""The native kernels (`attnkit.native`, backend `native`) against the float64 reference.

The flash-attention rule on every dtype, MHA/GQA/MQA, every mask with one key interval
per row, awkward sizes and strided inputs; empty rows give 0 and lse -inf; a non-finite
key or value a row does not see never reaches it; the op's contract (`opcheck`, compile
fullgraph), its checks before C++, and what happens where it cannot be built.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnkit as ak
from attnkit import native
from attnkit.backends import native as native_backend
from attnkit.backends.native import NativeBackend
from attnkit.flash_attn import flash_attn_func
from attnkit.native import build, ops
from fuzz_paged import World
from helpers import assert_rule, half_kernels
from test_reference_matrix import FAST_LARGE, HEADS, MASKS, SIZES, truth_and_reference

# where the kernels are meant to run, a failed build fails these tests instead of skipping
pytestmark = pytest.mark.skipif(build.setting() == "off", reason="ATTNKIT_NATIVE=off")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REFUSED = {  # masks the kernel does not take, and why (a random bool tensor may be spans)
    "from_mod_per_head": "not one interval of keys per row",
    "window_or_prefix_padded": "not one interval of keys per row",
    "bool_tensor": "not one interval of keys per row",
    "float_bias": "no additive bias tensor",
}


def _forward(q, k, v, mask, **kwargs):
    with torch.no_grad():
        return ak.attention_with_lse(q, k, v, mask, backend="native", **kwargs)


def _matrix():
    for dtype in DTYPES:
        for heads in HEADS:
            for mask_kind in MASKS:
                for size in SIZES:
                    big = max(size) > 1000  # the big fast ones: float32, masks it takes
                    taken = mask_kind in FAST_LARGE and mask_kind not in REFUSED
                    slow = big and not (taken and dtype == torch.float32)
                    yield pytest.param(
                        dtype,
                        heads,
                        mask_kind,
                        size,
                        marks=[pytest.mark.slow] if slow else [],
                        id=f"{str(dtype)[6:]}-{heads}-{mask_kind}-L{size[0]}-S{size[1]}",
                    )


@pytest.mark.parametrize(("dtype", "heads", "mask_kind", "size"), list(_matrix()))
def test_native_matches_float64_reference(dtype, heads, mask_kind, size):
    (q, k, v, mask, _), truth, ref = truth_and_reference(dtype, heads, mask_kind, size, 64)
    try:
        out, lse = _forward(q, k, v, mask)
    except ValueError as refused:
        assert mask_kind in REFUSED and REFUSED[mask_kind] in str(refused), refused
        return
    assert mask_kind not in REFUSED or mask_kind == "bool_tensor"
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_rule(f"native {mask_kind} out", out, ref[0], truth[0])
    with torch.no_grad():
        want = ak.attention_with_lse(q.double(), k.double(), v.double(), mask, backend="reference")[
            1
        ]
    assert torch.equal(torch.isinf(lse), torch.isinf(want))
    finite = torch.isfinite(want)
    assert (lse[finite].double() - want[finite]).abs().max().item() < 1e-4 if finite.any() else True


def _strided(x: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as x (B, H, T, D) in another layout."""
    if how == "bthd":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "every_other_d":
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    return x


@pytest.mark.parametrize("how", ["bthd", "every_other_d"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("D", "Dv"), [(64, 64), (40, 24), (1, 3)])
def test_strided_inputs_and_odd_head_dims(how, dtype, D, Dv):
    g = torch.Generator().manual_seed(D * 7 + Dv)
    q = torch.randn(2, 6, 131, D, generator=g).to(dtype)
    k = torch.randn(2, 3, 300, D, generator=g).to(dtype)
    v = torch.randn(2, 3, 300, Dv, generator=g).to(dtype)
    mask = ak.sliding_window(37, align="bottom_right") & ak.key_padding(torch.tensor([300, 211]))
    with torch.no_grad():
        want = ak.attention(q.double(), k.double(), v.double(), mask, backend="reference")
        naive = ak.attention(q, k, v, mask, backend="reference")
    got = _forward(*(_strided(t, how) for t in (q, k, v)), mask)[0]
    assert_rule(f"native {how}", got, naive, want)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("scale", [None, 0.7, -0.3])
def test_scale_and_softcap(scale, softcap):
    q, k, v = (torch.randn(1, 4, 70, 16), torch.randn(1, 2, 90, 16), torch.randn(1, 2, 90, 16))
    mask = ak.causal(align="bottom_right")
    kwargs = {"scale": scale, "softcap": softcap}
    with torch.no_grad():
        want, want_lse = ak.attention_with_lse(
            q.double(), k.double(), v.double(), mask, backend="reference", **kwargs
        )
    out, lse = _forward(q, k, v, mask, **kwargs)
    assert (out.double() - want).abs().max() < 1e-5
    assert (lse.double() - want_lse).abs().max() < 1e-5


def test_empty_rows_give_zero_and_minus_inf():
    q, k, v = (torch.randn(2, 2, 9, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8))
    mask = ak.key_padding(torch.tensor([12, 0])) & ak.causal(offset=-3)  # rows 0-2 see none
    out, lse = _forward(q, k, v, mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isneginf(lse[1]).all() and torch.isneginf(lse[0, :, :3]).all()
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    assert torch.isfinite(lse[0, :, 3:]).all()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_unseen_keys_never_leak(poison, dtype):
    """Documents: a key of one document holds NaN (or inf) in K and V; the rows of every
    other document, whose tiles' hulls and key blocks take that key, stay exact."""
    g = torch.Generator().manual_seed(3)
    L = 700
    q, k, v = (torch.randn(1, 4, L, 32, generator=g).to(dtype) for _ in range(3))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    ids = (torch.arange(L) >= 300).long() + (torch.arange(L) >= 450).long()  # 3 documents
    mask = ak.document(ids) & ak.causal()
    with torch.no_grad():
        want = ak.attention(q.double(), k.double(), v.double(), mask, backend="reference")
    bad_k, bad_v = k.clone(), v.clone()
    bad_k[:, :, 310], bad_v[:, :, 320] = poison, poison  # in document 1 (rows 300..449)
    got = _forward(q, bad_k, bad_v, mask)[0]
    others = torch.cat([torch.arange(300), torch.arange(450, L)])
    assert torch.isfinite(got[:, :, others]).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got[:, :, others].double() - want[:, :, others]).abs().max() < tol
    unseen = torch.full_like(k, poison)  # keys past the padding nobody sees
    k2, v2 = torch.cat([k, unseen], 2), torch.cat([v, unseen], 2)
    padded = ak.document(ids, torch.cat([ids, ids + 9])) & ak.causal(align="top_left")
    assert torch.isfinite(_forward(q, k2, v2, padded)[0]).all()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("G", [1, 2, 3])
def test_a_row_group_never_leaks_a_key_one_of_its_rows_does_not_see(poison, G):
    """The kernel itself (a document mask in one call, no per-document split): boundaries
    that cut a micro-tile's group of 6 stacked rows, a non-finite K and V at keys the group's
    hull holds but some of its rows do not see; every row stays exact."""
    native.library()
    g = torch.Generator().manual_seed(5)
    L, Hkv = 300, 2
    q = torch.randn(2, Hkv * G, L, 16, generator=g)
    k, v = (torch.randn(2, Hkv, L, 16, generator=g) for _ in range(2))
    starts = torch.tensor([0, 97, 98, 151, 152, 299])  # documents of 97, 1, 53, 1, 147, 1
    doc_start = starts[torch.searchsorted(starts, torch.arange(L), right=True) - 1]
    lo, hi = doc_start[None], (torch.arange(L) + 1)[None]  # causal within each document
    bad_k, bad_v = k.clone(), v.clone()
    last = [96, 97, 150, 151, 298, 299]  # each document's last key: only its last row sees it
    bad_k[:, :, last], bad_v[:, :, last] = poison, poison
    keep = torch.ones(L, dtype=torch.bool)
    keep[last] = False
    visible = ops.row_intervals(lo, hi, 2, L, L)
    got = ops.span_forward(q, bad_k, bad_v, visible, 0.25)[0]
    want = ops.span_forward(q, k, v, visible, 0.25)[0]
    assert torch.isfinite(got[:, :, keep]).all()
    assert (got[:, :, keep] - want[:, :, keep]).abs().max() < 1e-6


@pytest.mark.parametrize("L", [1, 4, 16])
@pytest.mark.parametrize(("H", "Hkv"), [(8, 8), (8, 2), (8, 1)])
def test_decoding_against_a_cache(L, H, Hkv):
    q = torch.randn(3, H, L, 64)
    k, v = torch.randn(3, Hkv, 1000, 64), torch.randn(3, Hkv, 1000, 64)
    mask = ak.causal(align="bottom_right") & ak.key_padding(torch.tensor([1000, 517, 40]))
    with torch.no_grad():
        want = ak.attention(q.double(), k.double(), v.double(), mask, backend="reference")
    got = _forward(q, k, v, mask)[0]
    assert (got.double() - want).abs().max() < 2e-6


@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("S", [1, 17, 531])
@pytest.mark.parametrize("dtype", DTYPES)
def test_few_rows_multiply_k_and_v_in_place(L, S, dtype):
    """Fewer than 4 stacked rows (MHA decoding) read K and V where they lie: strided,
    odd head dims, a block's tail past whole tiles of keys."""
    g = torch.Generator().manual_seed(L * 1000 + S)
    q = torch.randn(2, 3, L, 19, generator=g).to(dtype)
    k = torch.randn(2, S, 3, 19, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(2, S, 3, 23, generator=g).to(dtype).transpose(1, 2)
    with torch.no_grad():
        want = ak.attention(q.double(), k.double(), v.double(), backend="reference")
        naive = ak.attention(q, k, v, backend="reference")
    assert_rule("native few rows", _forward(q, k, v, None)[0], naive, want)


def test_auto_takes_native_for_a_window_and_explain_says_why():
    q, k, v = (torch.randn(1, 8, 4096, 64) for _ in range(3))
    text = str(ak.explain(q, k, v, ak.sliding_window(256)))
    assert "backend 'native'" in text and "native: tiles of 128 query rows" in text


def test_training_with_alibi_slopes_that_require_grad_runs_the_composed_backends():
    """The kernel's backward takes ALiBi's slopes as constants: slopes that want their
    own gradient go to a composed backend, which gives it."""
    q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), alibi_slopes=slopes)
    out.sum().backward()
    assert slopes.grad is not None and bool(slopes.grad.abs().sum() > 0)
    plain = ak.sliding_window(8) & ak.alibi(2)  # constant slopes: the kernel trains it
    assert "backend 'native'" in str(ak.explain(q, k, v, plain, backend="native"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("L", "S"), [(300, 300), (70, 300), (1, 257)])
def test_alibi_runs_in_the_kernel(dtype, L, S):
    """AlibiTerms with a window and causal (bottom-right when L != S), GQA, softcap: the
    kernel adds -slope·|i' - j| itself, within the rule of the float64 reference."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 8, L, 32, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, S, 32, generator=g).to(dtype) for _ in range(2))
    align = "bottom_right" if L != S else None
    mask = ak.sliding_window(100, align=align) & ak.causal(align=align) & ak.alibi(8, align=align)
    plan = str(ak.explain(q, k, v, mask, backend="native", softcap=4.0))
    assert "backend 'native'" in plan
    out, lse = _forward(q, k, v, mask, softcap=4.0)
    with torch.no_grad():
        truth = ak.attention_with_lse(
            q.double(), k.double(), v.double(), mask, backend="reference", softcap=4.0
        )
        naive = ak.attention(q, k, v, mask, backend="reference", softcap=4.0)
    assert_rule("native alibi out", out, naive, truth[0])
    assert (lse.double() - truth[1]).abs().max() < 1e-4


def test_a_bias_other_than_one_alibi_runs_on_the_composed_backends():
    q, k, v = (torch.randn(1, 4, 40, 16) for _ in range(3))
    bias = torch.randn(1, 4, 40, 40)
    for mask, why in (
        (bias, "no additive bias tensor"),
        (ak.causal() & ak.alibi(4) & ak.alibi(4), "the only bias the native kernel adds"),
    ):
        with pytest.raises(ValueError, match=why):
            _forward(q, k, v, mask)
    bad = {"slopes": torch.ones(1, 40, 3), "positions": torch.zeros(1, 40, dtype=torch.long)}
    with pytest.raises(ValueError, match="slopes must be float"):
        ops.alibi_terms(bad["slopes"], bad["positions"], 1, 40, 4, 40)
    with pytest.raises(ValueError, match="within 2"):
        ops.alibi_terms(torch.ones(1, 40, 4), bad["positions"] + 2**24, 1, 40, 4, 40)
    with pytest.raises(ValueError, match="finite"):
        ops.alibi_terms(torch.full((1, 40, 4), float("nan")), bad["positions"], 1, 40, 4, 40)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_decoding_step_runs_native_and_its_kernel_serves_a_growing_cache(monkeypatch, dtype):
    """`auto` takes a dense half decoding step to the kernel, unpriced, whether SDPA would
    compute it in float32 (converting the whole cache each step) or in its own dtype
    (slower still than the kernel on AVX512-BF16), and the prepared call serves the next
    steps of the growing cache's bucket without planning again; a float32 step of one
    sequence at 77 keys (B·G·bucket(S) below the `step_keys` threshold) stays with SDPA."""
    from attnkit.call import dispatch

    half_kernels(monkeypatch, "float32")
    prepared = []
    original = dispatch._prepared

    def counting(q, k, v, mask, options, *rest):
        prepared.append(options[3])  # (scale, softcap, dropout_p, backend, ...)
        return original(q, k, v, mask, options, *rest)

    monkeypatch.setattr(dispatch, "_prepared", counting)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 8, 1, 32, generator=g).to(dtype)
    k, v = (torch.randn(3, 2, 140, 32, generator=g).to(dtype) for _ in range(2))
    mask = ak.causal(align="bottom_right")
    assert "backend 'native'" in str(ak.explain(q, k[:, :, :100], v[:, :, :100], mask))
    with torch.no_grad():
        for S in range(100, 129):  # bucket 128
            got = ak.attention(q, k[:, :, :S], v[:, :, :S], mask)
            want = ak.attention(q, k[:, :, :S], v[:, :, :S], mask, backend="reference")
            assert (got.float() - want.float()).abs().max() < 2e-2
    assert prepared.count("auto") == 1  # one call prepared, 29 steps served
    half_kernels(monkeypatch, "native")
    assert "backend 'native'" in str(ak.explain(q, k[:, :, :77], v[:, :, :77], mask))
    x, kk, vv = q[:1].float(), k[:1].float(), v[:1].float()  # B·G = 4
    assert "backend 'sdpa'" in str(ak.explain(x, kk[:, :, :77], vv[:, :, :77], mask))


def test_opcheck_and_compile_fullgraph():
    q, k, v = torch.randn(2, 4, 33, 16), torch.randn(2, 2, 50, 16), torch.randn(2, 2, 50, 8)
    lo = torch.arange(33).clamp(max=40)[None].expand(2, 33).contiguous()
    hi = (lo + 10).clamp(max=50)
    slopes, at = torch.rand(2, 33, 4), torch.arange(33)[None].expand(2, 33).contiguous() + 17
    for dtype in DTYPES:
        for bias in ((None, None), (slopes, at)):
            # float32; the half units (bfloat16 where built); AMX's tiles where the CPU has them
            for units in ((False, False), (True, False), (True, True)):
                args = (q.to(dtype), k.to(dtype), v.to(dtype), lo, hi, *bias, 0.25, 0.0, 16, 32)
                for float_out in (False, True):  # the output in float32 (a half call's)
                    torch.library.opcheck(
                        torch.ops.attnkit_native.span_forward, (*args, *units, float_out)
                    )

    def fn(q, k, v):
        return ops.span_forward(q, k, v, visible, 0.25)[0] * 2

    visible = ops.row_intervals(lo, hi, 2, 33, 50)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v), fn(q, k, v))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: {**a, "q": a["q"].double()}, "must share one of"),
        (lambda a: {**a, "k": a["k"].half()}, "must share one of"),
        (lambda a: {**a, "q": a["q"][0]}, r"must be \(B, H, L, D\)"),
        (lambda a: {**a, "k": a["k"][:, :, :, :8]}, "do not fit"),
        (lambda a: {**a, "q": a["q"][:, :3]}, "multiple of Hkv"),
        (lambda a: {**a, "lo": a["lo"][:, :5]}, r"lo must be \(B, L\)"),
        (lambda a: {**a, "hi": a["hi"].float()}, "integer CPU tensor"),
        (lambda a: {**a, "scale": float("nan")}, "scale must be finite"),
        (lambda a: {**a, "softcap": -1.0}, "softcap finite and >= 0"),
        (lambda a: {**a, "tiles": (0, 8)}, "tiles must be"),
    ],
)
def test_inputs_are_checked_before_cpp(change, match):
    args = {
        "q": torch.randn(2, 4, 9, 16),
        "k": torch.randn(2, 2, 11, 16),
        "v": torch.randn(2, 2, 11, 16),
        "lo": torch.zeros(2, 9, dtype=torch.long),
        "hi": torch.full((2, 9), 11),
        "scale": 0.25,
        "softcap": 0.0,
        "tiles": None,
    }
    a = change(args)
    with pytest.raises(ValueError, match=match):
        visible = ops.row_intervals(a["lo"], a["hi"], 2, 9, 11)
        ops.span_forward(a["q"], a["k"], a["v"], visible, a["scale"], a["softcap"], a["tiles"])


def test_spans_past_the_keys_are_clamped():
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    lo, hi = torch.tensor([[-5, 0, 3, 9]]), torch.tensor([[2, 99, 3, 12]])
    out, lse = ops.span_forward(q, k, v, ops.row_intervals(lo, hi, 1, 4, 6), 0.5)
    s = (q[0, 0] @ k[0, 0].T) * 0.5
    assert torch.allclose(out[0, 0, 0], torch.softmax(s[0, :2], 0) @ v[0, 0, :2], atol=1e-6)
    assert torch.allclose(out[0, 0, 1], torch.softmax(s[1], 0) @ v[0, 0], atol=1e-6)
    assert torch.isneginf(lse[0, 0, 2:]).all() and not out[0, 0, 2:].any()


def _child(env: dict[str, str], code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_without_a_compiler_or_with_a_failed_build_the_composed_backends_serve(tmp_path):
    fake = tmp_path / "cxx"
    fake.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo fake 1.0 && exit 0\n'
        "echo 'span_attention.cpp:1:1: error: no kernels today' >&2; exit 1\n"
    )
    fake.chmod(0o755)
    code = (
        "import torch, attnkit as ak\n"
        "q = k = v = torch.randn(1, 2, 64, 16)\n"
        "plan = ak.explain(q, k, v, ak.sliding_window(8))\n"
        "print(plan.backend, plan.reasons['native'], sep='\\n')\n"
    )
    cache = {"ATTNKIT_NATIVE_DIR": str(tmp_path / "cache")}
    failed = "the build failed: span_attention.cpp:1:1: error: no kernels"
    for env, reason in (
        ({"CXX": str(tmp_path / "none")}, "no C++ compiler"),
        ({"CXX": str(fake), "ATTNKIT_NATIVE": "wait"}, failed),  # built in the foreground
        ({"CXX": str(fake)}, failed),  # remembered: no second build
        ({"ATTNKIT_NATIVE": "off"}, "disabled by ATTNKIT_NATIVE=off"),
    ):
        backend, why = _child({**cache, **env}, code).splitlines()
        assert why.startswith(f"attnkit's native kernels are unavailable: {reason}"), why
        assert backend != "native"
    assert list(Path(cache["ATTNKIT_NATIVE_DIR"]).glob("*/failed.txt"))


def test_the_build_key_reads_every_source_and_header():
    """A kernel change in any file of csrc/ gives a new build, never a stale one."""
    files = {f"csrc/{p.name}" for p in (Path(build.__file__).parent / "csrc").iterdir()}
    assert files == set(build.SOURCES) | set(build.HEADERS)


def test_python_and_cpp_agree_on_the_block_sizes():
    """The sizes both sides name (ops.py for the cost model and blocking, the kernels'
    headers for their loops) are the same numbers."""
    assert dict(torch.ops.attnkit_native.block_sizes()) == {
        "group_rows": ops.GROUP_ROWS,
        "tile_rows": ops.TILE_ROWS,
    }


def test_the_default_build_times_no_stage():
    """Stage timers are a build of their own (`ATTNKIT_NATIVE=stages`, its flag in the
    build key): the default kernels time nothing and say so with an empty dict."""
    native.library()
    assert ops.stage_times() == {}
    assert "-DATTNKIT_STAGES" in build.flags("stages")
    assert "-DATTNKIT_STAGES" not in build.flags("on")


@pytest.mark.slow
def test_the_stage_timers_account_for_the_threads_time():
    """Built with the timers (a minute), a causal float32 call and a bfloat16 one: every
    stage is named, the leaf stages sum to at most the work items' time, which is at most
    the threads' (idle time the rest), and the products and the softmax took time."""
    code = (
        "import torch\n"
        "from attnkit.native import library, ops\n"
        "library()\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    q = torch.randn(1, 8, 600, 64).to(dtype)\n"
        "    lo = torch.zeros(1, 600, dtype=torch.long)\n"
        "    causal = ops.row_intervals(lo, torch.arange(1, 601)[None], 1, 600, 600)\n"
        "    ops.span_forward(q, q, q, None, 0.125)\n"
        "    ops.span_forward(q, q, q, causal, 0.125)\n"
        "print(ops.stage_times(reset=True))\n"
        "print(ops.stage_times())\n"
    )
    got, after = _child({"ATTNKIT_NATIVE": "stages"}, code).splitlines()[-2:]
    times, zeroed = eval(got), eval(after)  # two dicts of ints
    leaves = ("load_q", "pack_k", "pack_v", "finite", "scores", "softmax", "convert", "values")
    leaves += ("cut", "finish")
    assert set(times) == {"call", "threads", "item", *leaves}
    assert sum(times[s] for s in leaves) <= times["item"] <= times["threads"]
    assert min(times[s] for s in ("scores", "softmax", "values", "cut", "convert")) > 0
    assert set(zeroed.values()) == {0}


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv("ATTNKIT_NATIVE", "maybe")
    with pytest.raises(ValueError, match=r"ATTNKIT_NATIVE=.maybe.: use one of on, wait, off"):
        build.setting()


def test_the_suite_passes_with_the_native_build_disabled():
    """The composed backends serve alone: the reference matrix's float32 GQA cases of the
    small sizes, the dispatcher's and the tiled backend's tests, with ATTNKIT_NATIVE=off."""
    files = ("test_dispatch.py", "test_tiled.py", "test_reference_matrix.py")
    selection = "not reference_matrix or (float32 and GQA and not 1025)"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", selection]
        + [str(Path(__file__).parent / name) for name in files],
        capture_output=True,
        text=True,
        env={**os.environ, "ATTNKIT_NATIVE": "off"},
    )
    assert done.returncode == 0, done.stdout[-3000:]


@pytest.mark.parametrize("left", [None, 5])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_paged_decoding_runs_the_paged_kernel(monkeypatch, dtype, tol, left):
    """Decoding steps of many sequences (forks sharing blocks, windows crossing blocks)
    against the float64 formula, on the kernel that reads the pool in place."""
    calls = []
    kernel = native_backend.paged_kernel  # the registry's door to the paged kernel
    monkeypatch.setattr(native_backend, "paged_kernel", lambda *a: calls.append(1) or kernel(*a))
    world = World(H=8, dtype=dtype)
    a, b = world.add(), world.add()
    world.run([a, b], [9, 3], left=left, tol=tol)
    c = world.fork(a)
    for _ in range(6):
        world.run([a, b, c], [1, 1, 1], left=left, tol=tol)
    world.run([c, a], [2, 1], left=left, tol=tol)  # a prefill beside a decoding token
    assert len(calls) == 2 * 7


@pytest.mark.parametrize("G", [1, 4])
def test_paged_kernel_splits_a_long_history_over_threads(G):
    """One sequence of 5,000 keys: its positions cut into parts merged by log-sum-exp."""
    g = torch.Generator().manual_seed(G)
    Hkv, D, Dv, bs = 2, 32, 16, 16
    pool = torch.randn(400 * bs, Hkv, D + Dv, generator=g)
    blocks = torch.randperm(400, generator=g)
    q = torch.randn(1, Hkv * G, D, generator=g)
    lo, hi = torch.tensor([37]), torch.tensor([5000])
    kv = (pool[..., :D], pool[..., D:])  # side by side, as a paged cache keeps them
    out, lse = ops.paged_decode(q, *kv, blocks, torch.tensor([0]), lo, hi, bs, 0.2)
    slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[37:5000]
    keys = pool[slots].double()  # (S, Hkv, D + Dv)
    k, v = (keys[..., :D], keys[..., D:])
    s = torch.einsum("hd,shd->hs", q[0].double(), k.repeat_interleave(G, 1)) * 0.2
    want = torch.softmax(s, -1) @ v.repeat_interleave(G, 1).transpose(0, 1)
    assert (out[0].double() - torch.diagonal(want, dim1=0, dim2=1).T).abs().max() < 1e-5
    assert (lse[0].double() - torch.logsumexp(s, -1)).abs().max() < 1e-5


def test_paged_kernel_refuses_tables_outside_the_pool():
    kv = (torch.zeros(4 * 4, 1, 8), torch.zeros(4 * 4, 1, 8))
    q = torch.zeros(1, 2, 8)
    args = (torch.tensor([0]), torch.tensor([0]), torch.tensor([9]), 4, 0.3)
    with pytest.raises(ValueError, match="run past its block table"):
        ops.paged_decode(q, *kv, torch.tensor([0, 1]), *args)
    with pytest.raises(ValueError, match="outside the pool"):
        ops.paged_decode(q, *kv, torch.tensor([0, 7, 1]), *args)
    with pytest.raises(ValueError, match="released one"):
        ops.paged_decode(q, *kv, torch.tensor([-1, 2, 1]), *args)
    with pytest.raises(ValueError, match="0 <= lo <= hi"):
        ops.paged_decode(q, *kv, torch.tensor([0, 1, 2]), args[0], args[2], args[1], 4, 0.3)
    with pytest.raises(ValueError, match="do not fit"):
        ops.paged_decode(q, kv[0], kv[1][:8], torch.tensor([0, 1, 2]), *args)


def test_native_lse_takes_the_reordering_slack_of_the_precision_bound():
    """Fuzz seed 0, native case 1126: bfloat16 inputs, one key a row (singleton
    documents), |logit| ~ 1000, softcap 5: the kernel's GEMM sums a score over D in
    another order than the reference, and its lse moved by that rounding (1.16x the
    strict bound): the bound's reordering term covers the lse of every reordered backend
    (the backward with softcap too)."""
    from fuzz_cases import RandomDraw, draw_case
    from fuzz_check import run_case

    outcomes = run_case(draw_case(RandomDraw(0, 1126), flex_percent=0), only=("native",))
    assert [o.status for o in outcomes] == ["ok", "ok"], outcomes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("causal", "window", "softcap"), [(True, (-1, -1), 0.0), (True, (40, 0), 3.0)]
)
def test_flash_attn_with_kvcache_decodes_on_the_paged_kernel(
    monkeypatch, dtype, causal, window, softcap
):
    """A decoding step of flash-attention's `flash_attn_with_kvcache` with a `block_table`
    reads the pages in place on the paged kernel (keys and values in separate pools), and
    gives what the composed path gives; pages nobody reads may hold NaN."""
    from attnkit.flash_attn import flash_attn_with_kvcache

    g = torch.Generator().manual_seed(4)
    B, H, Hkv, D, page, pages = 3, 8, 2, 32, 16, 40
    k_cache, v_cache = (torch.randn(pages, page, Hkv, D, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(pages, generator=g)[: B * 12].view(B, 12).int()
    lengths = torch.tensor([0, 57, 150], dtype=torch.int32)
    unread = sorted(set(range(pages)) - set(table.flatten().tolist()))
    k_cache[unread], v_cache[unread] = float("nan"), float("nan")
    q = torch.randn(B, 1, H, D, generator=g).to(dtype)
    k, v = (torch.randn(B, 1, Hkv, D, generator=g).to(dtype) for _ in range(2))
    calls = []
    kernel = native_backend.paged_kernel
    monkeypatch.setattr(native_backend, "paged_kernel", lambda *a: calls.append(1) or kernel(*a))

    def run():
        caches = (k_cache.clone(), v_cache.clone())
        return flash_attn_with_kvcache(
            q,
            *caches,
            k=k,
            v=v,
            cache_seqlens=lengths,
            block_table=table,
            causal=causal,
            window_size=window,
            softcap=softcap,
            return_softmax_lse=True,
        )

    out, lse = run()
    assert calls == [1] and out.shape == (B, 1, H, D) and lse.shape == (B, H, 1)
    monkeypatch.setattr(NativeBackend, "paged_decode", lambda self, step: None)  # composed
    want, want_lse = run()
    assert calls == [1] and torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - want.float()).abs().max() < tol
    assert (lse - want_lse.float()).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_attn_decodes_paged_keys_on_the_kernel_order_invariantly(monkeypatch, dtype):
    """torch's `varlen_attn` and `flash_attn_varlen_func` with a `block_table` and one query
    per sequence run on the paged kernel: what the composed path gives, and each
    sequence's output bitwise the same in another pack (the kernel cuts a history by its
    own length only: 3,000 keys run as parts whatever the pack)."""
    from attnkit.dropins import varlen_attn
    from attnkit.flash_attn import flash_attn_varlen_func

    g = torch.Generator().manual_seed(8)
    H, Hkv, D, page = 4, 2, 16, 16
    keys, values = (torch.randn(600, page, Hkv, D, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(600, generator=g)[: 3 * 190].view(3, 190).int()
    lengths = torch.tensor([3000, 5, 700], dtype=torch.int32)
    q = torch.randn(3, H, D, generator=g).to(dtype)
    calls = []
    kernel = native_backend.paged_kernel
    spy = lambda *a: calls.append(1) or kernel(*a)  # noqa: E731
    monkeypatch.setattr(native_backend, "paged_kernel", spy)

    def run(rows, window=(-1, -1)):
        cu = torch.arange(len(rows) + 1, dtype=torch.int32)
        used, pages = lengths[rows], table[rows]
        return varlen_attn(
            q[rows],
            keys,
            values,
            cu,
            None,
            1,
            3000,
            window_size=window,
            enable_gqa=True,
            seqused_k=used,
            block_table=pages,
        )

    whole, other, alone = run([0, 1, 2]), run([2, 0]), run([0])
    assert torch.equal(whole[0], other[1]) and torch.equal(whole[2], other[0])
    assert torch.equal(whole[0], alone[0])  # alone, it is the step's only sequence
    windowed = run([0, 1, 2], (100, 0))
    cu = torch.arange(4, dtype=torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    flash = flash_attn_varlen_func(
        q, keys, values, cu, cu_k, 1, 3000, causal=True, window_size=(100, 0), block_table=table
    )
    assert len(calls) == 5 and torch.equal(flash, windowed)
    monkeypatch.setattr(NativeBackend, "paged_decode", lambda self, step: None)  # composed
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, window in ((whole, (-1, -1)), (windowed, (100, 0))):
        assert (got.float() - run([0, 1, 2], window).float()).abs().max() < tol
    assert len(calls) == 5


def test_calibration_without_the_kernels_times_nothing(monkeypatch):
    """`attnkit calibrate` on a machine where the kernels are not built (ATTNKIT_NATIVE=off,
    no compiler) keeps native's built-in factors instead of failing on its probe."""
    from attnkit.backends import get_backend

    native = get_backend("native")
    monkeypatch.setattr(native.kernels, "unavailable", lambda: "disabled by a test")
    assert native.calibrate(None) == {}  # type: ignore[arg-type]
