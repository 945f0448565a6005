"""A non-finite key or value reaches exactly the rows that see its key (DESIGN §2), on
every backend, drop-in and module, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch
from tests.helpers import max_err

import attnkit as ak
from attnkit.backends import get_backend
from attnkit.call.visibility import all_finite, may_leak, run_masking_values
from attnkit.contracts import normalize_call
from attnkit.flash_attn import flash_attn_func, flash_attn_varlen_func

BACKENDS = ["reference", "sdpa", "tiled", "blockwise", "native", "flex", "auto"]
BAD = 40  # the key holding the non-finite entry
L = 64
WINDOW = 8  # causal & sliding_window(8): key 40 is seen by rows 40..48 alone


def _mask():
    return ak.causal() & ak.sliding_window(WINDOW)


def _sees_bad() -> torch.Tensor:
    rows = torch.arange(L)
    return (rows >= BAD) & (rows <= BAD + WINDOW)  # (L,)


def _inputs(dtype, where, value, Hkv=2):
    torch.manual_seed(0)
    q = torch.randn(2, 4, L, 16, dtype=dtype)
    k, v = torch.randn(2, Hkv, L, 16, dtype=dtype), torch.randn(2, Hkv, L, 16, dtype=dtype)
    (k if where == "k" else v)[0, :, BAD, 3] = value
    return q, k, v


def _truth_elsewhere(q, k, v, mask):
    """float64 reference with the entry cleaned: what every row that hides key 40 gets."""
    k, v = (torch.nan_to_num(t.double(), nan=0.0, posinf=0.0, neginf=0.0) for t in (k, v))
    return ak.attention(q.double(), k, v, mask, backend="reference")


def _serves(backend, q, k, v, mask):
    if backend == "auto":
        return
    reason = get_backend(backend).can_use(normalize_call(q, k, v, mask), need_lse=False)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_entry_reaches_only_the_rows_that_see_its_key(backend, dtype, where, value):
    q, k, v = _inputs(dtype, where, value)
    mask = _mask()
    _serves(backend, q, k, v, mask)
    out = ak.attention(q, k, v, mask, backend=backend)
    sees, hides = _sees_bad(), ~_sees_bad()
    truth = _truth_elsewhere(q, k, v, mask)
    assert torch.isfinite(out[:, :, hides]).all()
    assert max_err(out[:, :, hides], truth[:, :, hides]) < (
        1e-5 if dtype == torch.float32 else 5e-2
    )
    assert torch.isfinite(out[1]).all()  # batch row 1 holds no such entry
    if where == "v" or math.isnan(value):  # an infinite key may score -inf: weight 0
        reached = ~torch.isfinite(out[0][:, sees])  # (H, rows, Dv)
        assert reached.any(-1).all()  # every row that sees the key shows it


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled", "blockwise", "native", "auto"])
@pytest.mark.parametrize("where", ["k", "v"])
def test_gradients_of_rows_and_keys_that_never_meet_it_stay_finite(backend, where):
    q, k, v = _inputs(torch.float32, where, math.nan)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = _mask()
    _serves(backend, q, k, v, mask)
    out = ak.attention(q, k, v, mask, backend=backend)
    hides = ~_sees_bad()
    out[:, :, hides].sum().backward()
    assert torch.isfinite(q.grad[:, :, hides]).all()
    # keys 0..31 are seen only by rows 0..39, which hide key 40
    assert torch.isfinite(k.grad[:, :, :32]).all() and torch.isfinite(v.grad[:, :, :32]).all()
    assert torch.isfinite(q.grad[1]).all() and torch.isfinite(k.grad[1]).all()


@pytest.mark.parametrize("backend", ["sdpa", "reference", "blockwise"])
@pytest.mark.parametrize("where", ["k", "v"])
def test_a_float_bias_hides_like_a_mask(backend, where):
    """(the fuzz harness's case 400 of seed 51: a NaN key under a bias's -inf)"""
    q, k, v = _inputs(torch.float32, where, math.nan, Hkv=4)
    bias = torch.zeros(L, L).masked_fill(~_mask().materialize(1, 1, L, L)[0, 0], -math.inf)
    out = ak.attention(q, k, v, bias, backend=backend)
    assert torch.isfinite(out[:, :, ~_sees_bad()]).all()
    assert (~torch.isfinite(out[0][:, _sees_bad()])).any(-1).all()


def test_the_log_sum_exp_of_a_row_that_sees_a_nan_key_is_nan_and_no_other():
    q, k, v = _inputs(torch.float32, "k", math.nan)
    _, lse = ak.attention_with_lse(q, k, v, _mask(), backend="sdpa")
    assert torch.isnan(lse[0][:, _sees_bad()]).all()
    assert torch.isfinite(lse[0][:, ~_sees_bad()]).all() and torch.isfinite(lse[1]).all()


def test_a_prepared_call_and_the_cache_check_each_call():
    q, k, v = _inputs(torch.float32, "v", math.nan)
    clean = torch.randn_like(v)
    run = ak.prepare(q, k, clean, ak.causal(), backend="sdpa")
    assert torch.isfinite(run(q, k, clean)).all()
    out = run(q, k, v)  # a NaN value now: key 40 reaches rows 40.. only
    assert torch.isfinite(out[:, :, :BAD]).all() and not torch.isfinite(out[0, :, BAD:]).all()
    again = ak.attention(q, k, v, ak.causal(), backend="sdpa")
    assert torch.isfinite(again[:, :, :BAD]).all()


def test_drop_ins_and_modules_keep_it_to_its_rows():
    q, k, v = _inputs(torch.float32, "v", math.nan)
    out = ak.sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.isfinite(out[:, :, :BAD]).all() and not torch.isfinite(out[0, :, BAD:]).all()
    bl = [t.transpose(1, 2) for t in (q, k, v)]  # (B, L, H, D)
    out = flash_attn_func(*bl, causal=True)
    assert torch.isfinite(out[:, :BAD]).all() and not torch.isfinite(out[0, BAD:]).all()
    packed = [t.reshape(-1, *t.shape[2:]) for t in bl]  # (B·L, H, D): two sequences
    cu = torch.tensor([0, L, 2 * L], dtype=torch.int32)
    out = flash_attn_varlen_func(*packed, cu, cu, L, L, causal=True)
    assert torch.isfinite(out[:BAD]).all() and torch.isfinite(out[L:]).all()
    module = ak.MultiHeadAttention(32, 4).eval()
    x = torch.randn(1, L, 32)
    x[0, BAD] = math.nan  # one token's embedding: causal rows before it never see it
    with torch.no_grad():
        y = module(x, mask=ak.causal())
    assert torch.isfinite(y[0, :BAD]).all() and (~torch.isfinite(y[0, BAD:])).any(-1).all()


def test_compiled_attention_keeps_it_to_its_rows():
    q, k, v = _inputs(torch.float32, "v", math.nan)

    def f(q, k, v):
        return ak.attention(q, k, v, ak.causal(), backend="sdpa")

    out = torch.compile(f, fullgraph=True)(q, k, v)
    assert torch.isfinite(out[:, :, :BAD]).all() and not torch.isfinite(out[0, :, BAD:]).all()


def test_the_check_sums_again_in_float64_where_the_sum_overflows():
    k = torch.full((1, 1, 4, 2), 3e38)  # finite, but their float32 sum overflows
    v = torch.ones(1, 1, 4, 2)
    assert all_finite(k, v)
    v[0, 0, 1, 1] = math.inf
    assert not all_finite(k, v) and all_finite(k, v, (0, 2))  # keys 0, 1: seen by all


def test_only_the_keys_some_rows_hide_are_checked():
    q, k, v = torch.ones(1, 1, 4, 2), torch.ones(1, 1, 16, 2), torch.ones(1, 1, 16, 2)
    chunk = normalize_call(q, k, v, ak.causal(align="bottom_right"))
    assert may_leak(chunk) == (0, 13)  # the last three keys: seen by some rows only
    step = normalize_call(q[:, :, :1], k, v, ak.causal(align="bottom_right"))
    assert may_leak(step) is None and may_leak(normalize_call(q, k, v, None)) is None


def test_a_call_without_non_finite_entries_runs_as_it_was():
    k = torch.full((1, 1, 4, 2), 3e38)
    call = normalize_call(torch.ones(1, 1, 4, 2), k, torch.ones(1, 1, 4, 2), ak.causal())
    runs = []

    def run(c):
        runs.append(c)
        return c.v.new_zeros(1, 1, 4, 2), None

    run_masking_values(call, run)
    assert runs[0] is call  # nothing to zero: the call as it was


@pytest.mark.parametrize("backend", ["sdpa", "reference", "blockwise"])
def test_a_mask_broadcast_over_the_keys_keeps_it_to_its_rows(backend):
    """A bool mask of one key column (the fuzz harness's case 57 of seed 48): the rows it
    hides see nothing, the others every key."""
    q, k, v = _inputs(torch.float32, "v", math.inf)
    v[0, :, BAD + 1, 0] = math.nan  # two keys: the mask's one column stands for both
    rows = torch.arange(L) % 3 != 0  # (L,): rows 0, 3, 6, ... see nothing
    mask = rows.view(L, 1)  # (L, 1): broadcast over S
    out = ak.attention(q, k, v, mask, backend=backend)
    assert (out[:, :, ~rows] == 0).all()
    assert (~torch.isfinite(out[0][:, rows])).any(-1).all() and torch.isfinite(out[1]).all()


NAN_ROW_CASES = {  # (mask, L, S): row 0 sees only key 0, which holds a NaN
    "causal": (ak.causal(), 4, 4),
    "documents of one token": (ak.document(torch.arange(4)[None]), 4, 4),
    "one key": (None, 1, 1),
}


@pytest.mark.xfail(
    strict=True,
    reason="PyTorch's CPU SDPA gives 0 to a row whose every visible score is NaN, and the "
    "sdpa backend passes that on where the truth is NaN",
)
@pytest.mark.parametrize("case", NAN_ROW_CASES)
def test_a_row_that_sees_only_a_nan_key_is_nan_on_sdpa(case):
    mask, rows, keys = NAN_ROW_CASES[case]
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, rows, 8), torch.randn(1, 2, keys, 8), torch.randn(1, 2, keys, 8)
    k[0, 0, 0, 0] = math.nan
    truth = ak.attention(q, k, v, mask, backend="reference")
    assert truth[0, 0, 0].isnan().all()
    assert ak.attention(q, k, v, mask, backend="sdpa")[0, 0, 0].isnan().all()
