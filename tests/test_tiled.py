"""The tiled backend: spans from structure, no L×S tensor, exact results, honest refusals."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import runtime
from attnkit.backends.tileplan import plan_tiles
from attnkit.call.prepared import mask_state as state
from helpers import count_tile_plans, out_and_grads, small_qkv, span_backend


def qkv(B=2, H=4, Hkv=2, L=300, S=300, D=16, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(B, h, n, D, generator=g, dtype=dtype) for h, n in ((H, L), (Hkv, S), (Hkv, S))
    )


@pytest.mark.parametrize(
    "mask",
    [
        ak.sliding_window(37),
        ak.causal() & ak.key_padding(torch.tensor([300, 123])),
        ak.document(torch.arange(300) // 45) & ak.causal(),
        ak.prefix_lm(torch.tensor([20, 90])),
        ak.sliding_window(10, 5) | ak.prefix_lm(7),
        ak.document(torch.randint(0, 3, (300,))),  # unsorted ids: a loose span, still exact
    ],
    ids=str,
)
def test_tiled_is_exact_and_never_builds_an_l_by_s_mask(monkeypatch, mask):
    q, k, v = (t.requires_grad_() for t in qkv())
    expected = ak.attention(q, k, v, mask, backend="reference")
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))

    def refuse(*args, **kwargs):
        raise AssertionError("tiled evaluated the whole mask")

    monkeypatch.setattr(ak.Mask, "dense", refuse)
    monkeypatch.setattr(ak.Mask, "materialize", refuse)
    got = ak.attention(q, k, v, mask, backend="tiled")
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    torch.testing.assert_close(got, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)


def test_auto_picks_block_sparse_for_sparse_masks_and_sdpa_for_dense_or_causal():
    """tiled where the native kernel is not built (it serves a window where it is), and
    SDPA for causal calls (priced by its blocks: 0.63 of the dense pairs at 2048, where
    the native kernel, when built, is cheaper still)."""
    q = torch.empty(1, 8, 2048, 64)
    sparse = span_backend()
    assert ak.explain(q, q, q, ak.sliding_window(255)).backend == sparse
    documents = ak.explain(q, q, q, ak.document(torch.arange(2048) // 256)).backend
    assert documents == "sdpa"  # packed documents run a call each: here each one dense
    causal = "sdpa" if sparse == "tiled" else sparse
    assert ak.explain(q, q, q, ak.causal()).backend == causal
    assert ak.explain(q, q, q).backend == "sdpa"
    plan = ak.explain(q, q, q, ak.sliding_window(255))
    assert "slower here" in plan.reasons["sdpa"] and plan.density < 0.13
    assert f"backend '{sparse}'" in str(plan)
    training = ak.explain(q.requires_grad_(), q, q, ak.sliding_window(255))
    assert training.backend == sparse  # the native kernels have the backward too


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"mask": torch.zeros(300, 300)}, "additive float bias"),
        ({"softcap": 5.0}, "no softcap or dropout"),
        ({"dropout_p": 0.1}, "no softcap or dropout"),
        ({"mask": torch.ones(1, 4, 300, 300, dtype=torch.bool)}, "differs between heads"),
    ],
)
def test_tiled_refuses_what_it_cannot_compute_and_says_why(kwargs, reason):
    q, k, v = qkv(dtype=torch.float32)
    mask = kwargs.pop("mask", None)
    plan = ak.explain(q, k, v, mask, **kwargs)
    assert reason in plan.reasons["tiled"]
    with pytest.raises(ValueError, match=reason):
        ak.attention(q, k, v, mask, backend="tiled", **kwargs)


def test_tiled_refuses_different_value_head_dim():
    q, k, _ = qkv(dtype=torch.float32)
    v = torch.randn(2, 2, 300, 8)
    assert "D == Dv" in ak.explain(q, k, v).reasons["tiled"]


def test_tiled_runs_chunks_and_irregular_blocks_exactly(monkeypatch):
    """Small chunks, gathered windows, GQA rows, cut key spans: still the reference."""
    import attnkit.backends.tiled as tiled

    monkeypatch.setattr(tiled, "CHUNK_BYTES", 1)  # one block per kernel call
    monkeypatch.setattr(tiled, "FORWARD_CHUNK_BYTES", 1)
    monkeypatch.setattr(tiled, "BACKWARD_KEYS", 40)  # the backward cuts spans, uneven tail
    ids = torch.tensor([0] * 70 + [1] * 13 + [2] * 150 + [3] * 67)
    mask = ak.document(ids) & ak.causal() & ak.key_padding(torch.tensor([300, 250]))
    q, k, v = (t.requires_grad_() for t in qkv())
    expected = ak.attention(q, k, v, mask, backend="reference")
    got, lse = ak.attention_with_lse(q, k, v, mask, backend="tiled")
    _, expected_lse = ak.attention_with_lse(q, k, v, mask, backend="reference")
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(lse, expected_lse)
    grads = torch.autograd.grad((got.sum() + lse.clamp(min=-1e4).sum()), (q, k, v))
    ref = ak.attention_with_lse(q, k, v, mask, backend="reference")
    expected_grads = torch.autograd.grad((ref[0].sum() + ref[1].clamp(min=-1e4).sum()), (q, k, v))
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("band", [None, 64], ids=["whole", "bands"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["MHA", "GQA"])
def test_long_causal_runs_run_whole_with_is_causal_and_stay_exact(monkeypatch, heads, band):
    """Documents (and padded causal rows) as `is_causal` blocks, the rest tiled; the
    forward cuts long runs into bands merged by log-sum-exp."""
    import attnkit.backends.tileplan as tileplan

    monkeypatch.setattr(tileplan, "SEGMENT_MIN", 40)
    H, Hkv = heads
    ids = torch.tensor([0] * 70 + [1] * 13 + [2] * 150 + [3] * 67)
    mask = ak.document(ids) & ak.causal() & ak.key_padding(torch.tensor([300, 250]))
    segments = tileplan.Segments.find(mask, 2, 300, 300)
    assert segments is not None and segments.runs[0] == [
        (0, 0, 70, 0),
        (83, 83, 150, 0),
        (233, 233, 67, 0),
    ]
    assert segments.runs[1] == [(0, 0, 70, 0), (83, 83, 150, 0)]  # the padded document is cut
    plan = plan_tiles(mask, 2, 300, 300, 64, segments)
    assert sum(g.size for g in plan.groups if g.causal) == 5
    import attnkit.backends.tiled as tiled

    monkeypatch.setattr(tiled, "best_plan", lambda *args: plan)  # this plan, not the cheapest
    monkeypatch.setattr(tiled, "BACKWARD_KEYS", 32)  # runs cut into squares and rectangles
    if band is not None:  # 150 rows: bands of 64, 64 and 22 rows, two of them merged
        monkeypatch.setattr(tiled, "_band_rows", lambda heads, Dv: band)
    q, k, v = (t.requires_grad_() for t in qkv(H=H, Hkv=Hkv))
    expected, expected_lse = ak.attention_with_lse(q, k, v, mask, backend="reference")
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    got, lse = ak.attention_with_lse(q, k, v, mask, backend="tiled")
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(lse, expected_lse)
    for g, e in zip(torch.autograd.grad(got.sum(), (q, k, v)), expected_grads, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("band", [None, 64], ids=["whole", "bands"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["MHA", "GQA"])
@pytest.mark.parametrize(
    "mask, L, S",
    [
        (ak.prefix_lm(90), 300, 300),
        (ak.causal(align="bottom_right"), 150, 300),
        (ak.causal(align="bottom_right") & ak.key_padding(torch.tensor([300, 280])), 150, 300),
    ],
    ids=["prefix", "bottom_right", "bottom_right_padded"],
)
def test_causal_runs_after_offset_keys_merge_two_calls_exactly(
    monkeypatch, mask, L, S, heads, band
):
    """A run whose rows all first see `offset` keys: a causal square, then the offset
    rectangle merged into its rows by log-sum-exp; output, lse and gradients exact."""
    import attnkit.backends.tiled as tiled
    from attnkit.backends.tileplan import Segments

    segments = Segments.find(mask, 2, L, S)
    assert segments is not None and all(run[3] > 0 for run in segments.runs[0])
    plan = plan_tiles(mask, 2, L, S, 64, segments)
    assert any(g.merge for g in plan.groups) and plan.groups[-1].merge  # merging groups last
    monkeypatch.setattr(tiled, "best_plan", lambda *args: plan)
    if band is not None:
        monkeypatch.setattr(tiled, "_band_rows", lambda heads, Dv: band)
    H, Hkv = heads
    q, k, v = (t.requires_grad_() for t in qkv(H=H, Hkv=Hkv, L=L, S=S))
    expected, expected_lse = ak.attention_with_lse(q, k, v, mask, backend="reference")
    got, lse = ak.attention_with_lse(q, k, v, mask, backend="tiled")
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(lse, expected_lse)
    grads = torch.autograd.grad(got.sum() + lse.sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.sum() + expected_lse.sum(), (q, k, v))
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize(
    "mask",
    [
        ak.sliding_window(20),
        ak.document(torch.arange(300) // 70) & ak.causal(),
        ak.causal() & ak.key_padding(torch.tensor([300, 0])),  # batch row 1: no rows covered
        ak.key_padding(torch.tensor([0, 120])),
    ],
    ids=str,
)
def test_plans_count_covered_rows_so_uncovered_ones_stay_zero(mask):
    plan = plan_tiles(mask, 2, 300, 300, 64)
    rows = torch.zeros(2, 300, dtype=torch.bool)
    for g in plan.groups:
        for r in g.row0:
            rows[g.batch, r : r + g.rows] = True
    assert plan.covered == int(rows.sum())
    q, k, v = qkv()
    torch.testing.assert_close(
        ak.attention(q, k, v, mask, backend="tiled"),
        ak.attention(q, k, v, mask, backend="reference"),
    )


def test_plans_are_reused_per_mask_and_renewed_when_its_tensors_change(monkeypatch):
    planned = count_tile_plans(monkeypatch)
    lengths = torch.tensor([300, 120])
    mask = ak.causal() & ak.key_padding(lengths)
    q, k, v = qkv()
    first = ak.attention(q, k, v, mask, backend="tiled")
    before = state(mask)
    torch.testing.assert_close(first, ak.attention(q, k, v, mask, backend="reference"))
    torch.testing.assert_close(ak.attention(q, k, v, mask, backend="tiled"), first)
    assert len(planned) == 1  # the second call reused the plan
    lengths[1] = 7  # in place: the mask now hides more keys
    assert state(mask) != before
    torch.testing.assert_close(
        ak.attention(q, k, v, mask, backend="tiled"),
        ak.attention(q, k, v, mask, backend="reference"),
    )
    assert len(planned) == 2  # planned again for the new state


@pytest.mark.parametrize(
    "shape",
    [(1, 8, 128, 128), (2, 4, 2048, 2048), (1, 8, 4096, 1024), (4, 8, 512, 512), (2, 8, 1, 600)],
)
@pytest.mark.parametrize(
    "mask", [ak.causal(align="top_left"), ak.sliding_window(63, align="bottom_right"), None]
)
def test_the_cost_floor_is_a_lower_bound_of_the_cost(shape, mask):
    """The planner leaves tiled unpriced where its floor is no better than another's cost:
    that is right only if no plan costs less than the floor."""
    from attnkit.backends import BACKENDS
    from attnkit.contracts import normalize_call

    B, H, L, S = shape
    q, k = torch.empty(B, H, L, 8), torch.empty(B, H, S, 8)
    call = normalize_call(q, k, k, mask, table=runtime.current().costs.table())
    tiled = BACKENDS["tiled"]
    assert tiled.cost_floor(call) <= tiled.cost(call, need_lse=False)


def test_a_bool_tensor_given_again_is_planned_once_and_again_after_an_in_place_change(
    monkeypatch,
):
    import attnkit.backends.tiled as tiled

    planned = []
    real = tiled.best_plan
    monkeypatch.setattr(tiled, "best_plan", lambda *a: planned.append(1) or real(*a))
    q = torch.randn(1, 2, 96, 16)
    band = ak.sliding_window(20).dense(1, 1, 96, 96)  # (1, 1, L, S): one run of keys a row
    first = ak.attention(q, q, q, band, backend="tiled")
    for _ in range(3):
        torch.testing.assert_close(ak.attention(q, q, q, band, backend="tiled"), first)
    assert len(planned) == 1  # wrapped anew per call, planned once per tensor
    band[..., :10] = False  # in place: a new version, planned again
    changed = ak.attention(q, q, q, band, backend="tiled")
    assert len(planned) == 2
    torch.testing.assert_close(changed, ak.attention(q, q, q, band, backend="reference"))


@pytest.mark.parametrize(
    "mask",
    [torch.ones(1, 1, 4, 1, dtype=torch.bool), torch.tensor(True), torch.tensor([[True], [False]])],
    ids=["last-dim-1", "0-dim", "rows"],
)
def test_bool_masks_broadcast_over_keys_on_tiled(mask):
    q, k, v = small_qkv(L=4 if mask.dim() != 2 else 2, S=4)
    want = out_and_grads(q, k, v, mask, "reference", lse=True)
    for backend in ("tiled", "auto"):
        got = out_and_grads(q, k, v, mask, backend, lse=True)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w)
