"""The backend interface is closed: a backend registered from outside (one class, one
`register` line) is found by `auto`, `explain`, the gradients, the compiled op, the
calibration and the fuzz harness, with nothing else touched."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import attnkit as ak
from attnkit import runtime
from attnkit.backends import (
    BACKENDS,
    Backend,
    Probe,
    backend_names,
    get_backend,
    register,
    unregister,
)
from attnkit.backends.protocol import PagedDecode
from attnkit.call import calibrate, cost, dispatch
from attnkit.contracts import AttentionCall
from fuzz import RandomDraw
from fuzz_cases import draw_case
from fuzz_check import run_case


class Toy(Backend):
    """The reference's math, priced as free: auto takes it wherever it is asked."""

    name = "toy"
    cost_factors = cost.Factors({"pair": 1e-9}, {"amx": {"pair": 2e-9}})

    def __init__(self) -> None:
        self.runs = 0
        self.probed: list[float] = []

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None:
        return "toy serves no dropout" if call.dropout_p > 0 else None

    def cost(self, call: AttentionCall, *, need_lse: bool) -> float:
        return (
            self.factors(call.table)["pair"] * call.dims.B * call.dims.H * call.dims.L * call.dims.S
        )

    def calibrate(self, probe: Probe) -> dict[str, float]:
        self.probed.append(probe.time(lambda: None))
        return {"pair": 3e-9}

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int:
        return 0

    def run(self, call: AttentionCall, *, need_lse: bool) -> tuple[Tensor, Tensor | None]:
        self.runs += 1
        return get_backend("reference").run(call, need_lse=need_lse)


@pytest.fixture
def toy():
    backend = Toy()
    register(backend)
    dispatch.clear()
    yield backend
    unregister("toy")
    dispatch.clear()


def _qkv(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, 16, 8, generator=g).requires_grad_(requires_grad) for _ in range(3)]


def test_auto_and_explain_find_a_registered_backend(toy):
    q, k, v = _qkv()
    mask = ak.causal() & ak.sliding_window(3)
    assert "toy" in backend_names()
    plan = ak.explain(q, k, v, mask)
    assert plan.backend == "toy" and plan.reasons["toy"] is None
    assert "toy" in str(plan)
    want = ak.attention(q, k, v, mask, backend="reference")
    torch.testing.assert_close(ak.attention(q, k, v, mask), want)
    assert toy.runs == 1
    reason = ak.explain(q, k, v, mask, dropout_p=0.1).reasons["toy"]
    assert reason == "toy serves no dropout"


def test_gradients_and_the_compiled_op_run_a_registered_backend(toy):
    q, k, v = _qkv(requires_grad=True)
    mask = ak.causal() & ak.sliding_window(3)
    ak.attention(q, k, v, mask).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    runs = toy.runs
    for t in (q, k, v):
        t.grad = None
    ak.attention(q, k, v, mask, backend="reference").sum().backward()
    for got, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(got, t.grad)
    compiled = torch.compile(lambda q, k, v: ak.attention(q, k, v, mask), fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v), ak.attention(q, k, v, mask))
    assert toy.runs > runs


def test_the_fuzz_harness_runs_a_registered_backend(toy):
    outcomes = [o for i in range(4) for o in run_case(draw_case(RandomDraw(11, i)))]
    ran = [o for o in outcomes if o.backend == "toy"]
    assert ran and all(not o.failed for o in ran)


def test_the_calibration_times_a_registered_backends_own_factors(toy, monkeypatch, tmp_path):
    """Its factors are built in per kind, timed by its own probe, kept, read back and
    named by `explain`, with nothing in cost.py or calibrate.py naming it."""
    assert toy.factors(runtime.current().costs.table()) == {
        "pair": 1e-9
    }  # the tests price with avx2's table
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(tmp_path / "cost.json"))
    monkeypatch.setattr(calibrate.time, "sleep", lambda s: None)  # a busy CPU: again at once
    before = runtime.current().costs.table()
    try:
        measured = calibrate.measure()
        assert toy.probed and measured.measured["toy"] == {"pair": 3e-9}
        # factors that move with another backend's were timed after it, whatever the order
        timed = measured.measured
        assert timed["tiled"]["causal"] == pytest.approx(1.15 * timed["sdpa"]["causal"])
        kept = calibrate._write(tmp_path / "cost.json", measured)
        assert kept.of("toy", Toy.cost_factors) == {"pair": 3e-9}
        runtime.current().costs.use(kept)
        q, k, v = _qkv()
        assert "toy pair 3e-09" in " ".join(ak.explain(q, k, v, ak.causal(), verbose=True).notes)
    finally:
        runtime.current().costs.use(before)
    assert cost.built_in("avx512").of("toy", Toy.cost_factors) == {"pair": 2e-9}  # amx's


class Follower(Toy):
    """Its factor moves with the toy's: it asks the probe, whatever the registry's order."""

    name = "follower"

    def calibrate(self, probe: Probe) -> dict[str, float]:
        return {"pair": 2 * probe.measured("toy")["pair"]}


def test_a_factor_that_moves_with_another_backends_is_timed_after_it(monkeypatch):
    monkeypatch.setattr(Toy, "calibrate", lambda self, probe: {"pair": 5e-9})
    register(Follower())  # before the toy: it asks for the toy's factor first
    register(Toy())
    try:
        probe = calibrate._Probe()
        assert probe.measured("follower") == {"pair": 1e-8}
        assert probe.measured("toy") == {"pair": 5e-9}  # timed once, kept
        assert probe.measured("nothing") == {}
    finally:
        unregister("toy")
        unregister("follower")
        dispatch.clear()


def test_a_calibration_naming_factors_the_backend_has_not_fails_and_prices_built_in(
    toy, monkeypatch, tmp_path
):
    """A factor a backend does not declare would make a kept table unreadable."""
    monkeypatch.setattr(calibrate, "_measured", lambda: ({"toy": {"nope": 1.0}}, 0.97))
    with pytest.raises(ValueError, match="'toy' timed"):
        calibrate.measure()
    monkeypatch.setenv("ATTNKIT_CALIBRATION", "measure")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    before = runtime.current().costs.table()
    runtime.current().costs.use(None)
    try:
        found = (
            runtime.current().costs.table()
        )  # the calibration failed: the built-in table, saying why
        kind = found.kind  # this CPU's: its built-in factors (the nearest measured kind's)
        assert found.of("toy", Toy.cost_factors) == Toy.cost_factors.built_in(kind)
        assert "calibration failed" in found.source and not list(tmp_path.iterdir())
    finally:
        runtime.current().costs.use(before)


def test_register_refuses_a_taken_name_and_other_objects():
    with pytest.raises(ValueError, match="registered already"):
        register(BACKENDS["sdpa"])
    with pytest.raises(TypeError, match="Backend"):
        register(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown backend"):
        unregister("nothing")


def _heads(t: Tensor) -> Tensor:
    """(n, heads, d) -> (1, heads, n, d)."""
    return t.transpose(0, 1)[None]


class PagedToy(Backend):
    """A paged decoding kernel only: each sequence's keys gathered by the table, then
    the reference's math (it serves no call)."""

    name = "paged_toy"

    def __init__(self) -> None:
        self.steps = 0

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None:
        return "paged_toy decodes pages only"

    def paged_decode(self, step: PagedDecode) -> tuple[Tensor, Tensor] | None:
        self.steps += 1
        outs, lses = [], []
        for n in range(step.q.shape[0]):
            p = torch.arange(int(step.lo[n]), int(step.hi[n]))  # the key positions it sees
            page = step.table[step.starts[n] + p // step.page_size]
            slots = page * step.page_size + p % step.page_size
            q, k, v = (_heads(t) for t in (step.q[n : n + 1], step.keys[slots], step.values[slots]))
            out, lse = ak.attention_with_lse(q, k, v, scale=step.scale, backend="reference")
            outs.append(out[0, :, 0])  # (H, Dv)
            lses.append(lse[0, :, 0])
        return torch.stack(outs), torch.stack(lses)


def _paged_decode_twice() -> Tensor:
    """Two sequences of 5 and 4 keys prefilled, then one decoding token each (float64)."""
    g = torch.Generator().manual_seed(3)
    pages = ak.PagedKVCache(1, 2, 8, num_blocks=8, block_size=4, dtype=torch.float64)
    ids = [pages.add(), pages.add()]
    q, k, v = torch.randn(9, 4, 8, generator=g), *torch.randn(2, 9, 2, 8, generator=g)
    ak.paged_attention(q.double(), k.double(), v.double(), pages, pages.step(ids, [5, 4]), 0)
    q, k, v = torch.randn(2, 4, 8, generator=g), *torch.randn(2, 2, 2, 8, generator=g)
    return ak.paged_attention(q.double(), k.double(), v.double(), pages, pages.step(ids, [1, 1]), 0)


def _flash_decode() -> Tensor:
    """flash_attn_with_kvcache: one query per sequence over 6 and 7 keys of its pages."""
    from attnkit.flash_attn import flash_attn_with_kvcache

    g = torch.Generator().manual_seed(4)
    k_cache, v_cache = torch.randn(2, 6, 4, 2, 8, generator=g)
    q = torch.randn(2, 1, 4, 8, generator=g)
    table, lengths = torch.tensor([[5, 0], [2, 3]]), torch.tensor([6, 7])
    return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)


def test_paged_decoding_asks_the_registry_for_its_kernel():
    """`paged_attention` and `flash_attn_with_kvcache` find the paged kernel as `attention`
    finds a backend: through the registry (`Backend.paged_decode`), here a toy's, and
    gather the pages where no backend has one."""
    with runtime.fresh() as mine:
        mine.backends.unregister("native")
        want = _paged_decode_twice(), _flash_decode()  # gathered: no backend has a kernel
        toy = PagedToy()
        mine.backends.register(toy)
        got = _paged_decode_twice(), _flash_decode()
    assert toy.steps == 2  # one paged step, one flash-attention call
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
