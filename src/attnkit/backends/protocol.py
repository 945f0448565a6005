"""What a backend is: the interface the planner, the dispatcher, the gradients and the
pictures call, so none of them reaches for a backend by its class.

Every backend answers `can_use` (None = can serve, else why not), `cost` (estimated
time, in units of one query-key pair of one head in SDPA's dense kernel: see
`attnkit.call.cost`), `peak_bytes` and `run`. It owns the factors it prices with
(`cost_factors`, built in per kind of CPU; `factors()`, as the table of the process has
them) and their measurement (`calibrate`, timed through a `Probe` by `attnkit
calibrate`). The rest has defaults a backend overrides
where it has more to say: a cheap lower bound on its cost (`cost_floor`), a kernel
prepared for repeated calls (`prepare`), gradients from a call's output and lse
(`backward`), lines for `explain` (`notes`), the blocks of L×S it computes (`work`),
and a number that changes when its own state changes what it costs (`version`: flex's
kernels turning warm), which cached plans carry. Besides calls, a backend may declare
another kind of problem it solves in place: a decoding step over a pool of pages
(`PagedDecode`, asked by `paged_attention` and `flash_attn_with_kvcache` through the
registry: `native`).

`serves_backward` says whether `backward` takes a call (`sdpa`: one fused call for dense
and causal calls; `tiled`: block by block; `gradients.fused_gradients` takes the first
in the registry that serves); `fastest_on_dense` marks the backend cheapest per pair on a
dense call, which `auto` takes for such a call and for a decoding step (`attnkit.call.steps`)
without pricing (`sdpa`), unless a backend `takes_step` that step (`native`: the steps it
wins, by a rule that reads S only by its bucket); `work` is read
by `plot.computed_regions` and the calibration. A backend keeps no cache of its own:
what it derives lives in the call's `plan_values`. Nothing outside `backends/` names a
concrete backend class or looks one up by a literal name; `backends.register(backend)`
adds one, and `auto`, `explain`, the gradients, the compiled op and the fuzz harness
take it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from torch import Tensor

from attnkit.call import cost
from attnkit.call.precision import HALF
from attnkit.contracts import AttentionCall, normalize_call
from attnkit.masks import Mask

__all__ = ["Backend", "Block", "Inputs", "Kernel", "PagedDecode", "Probe", "Work"]

Inputs = tuple[Tensor, Tensor, Tensor]


class Kernel(Protocol):
    """A backend's call with everything but q, k, v decided (`Backend.prepare`); it
    returns None where the full path must decide (a check of its output failed)."""

    @property
    def serves_any_length(self) -> bool:
        """Nothing of the key length S is in it (no mask tensor, no `is_causal`): it
        serves the next step of a growing cache as well."""
        ...

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor | None: ...


class Probe(Protocol):
    """What a backend's calibration times with (`attnkit.call.calibrate`). Times are in the
    cost model's unit: one query-key pair of one head in SDPA's dense kernel, timed on
    this CPU just before."""

    def measured(self, backend: str) -> Mapping[str, float]:
        """The factors the backend called `backend` times on this CPU (timed at the first
        ask, whatever the registry's order; {} for one that times none, or is not
        registered, or is being timed: a factor that moves with another's asks for it)."""
        ...

    def inputs(self, L: int, H: int = 8) -> Inputs:
        """Random q, k, v of (1, H, L, 64), float32."""
        ...

    def time(self, fn: Callable[[], object], runs: int = 3) -> float:
        """The shortest of `runs` calls of `fn` after one untimed, in units."""
        ...

    def interleaved(self, fns: Sequence[Callable[[], object]], runs: int = 7) -> list[float]:
        """The shortest time of each call over `runs` rounds calling each once in turn
        (two alike disturbed: their ratio is steadier), in units."""
        ...

    def attention(self, inputs: Inputs, mask: Mask | None, backend: str, runs: int = 3) -> float:
        """`attention(*inputs, mask, backend=backend)` timed, in units."""
        ...


@dataclass(frozen=True)
class Block:
    """`rows` queries from `row0` against `keys` keys from `key0`, in batch row `batch`
    (`causal`: row m sees keys 0..m of the block)."""

    batch: int
    row0: int
    rows: int
    key0: int
    keys: int
    causal: bool = False


@dataclass(frozen=True)
class Work:
    """The blocks of L×S a backend computes for a call (the rest it skips), in how
    many kernel calls, with tiles of how many query rows."""

    blocks: tuple[Block, ...]
    calls: int
    tile: int


@dataclass(frozen=True)
class PagedDecode:
    """One new query per sequence against keys read in place from a pool of pages (no
    gather), autograd not recording: sequence n's key p sits at slot
    `table[starts[n] + p // page_size] · page_size + p % page_size`.

    q: (N, H, D); keys (slots, Hkv, D) and values (slots, Hkv, Dv): views of the pool;
    table: the pages in order, int64; starts, lo, hi: (N,) int64, where each sequence's
    pages start in `table` and the key positions [lo, hi) it sees (on any device: a
    kernel moves what it reads where it runs).
    """

    q: Tensor
    keys: Tensor
    values: Tensor
    table: Tensor
    starts: Tensor
    lo: Tensor
    hi: Tensor
    page_size: int
    scale: float
    softcap: float  # 0: none


# forward+backward work over the forward's (flash-attention's count: the backward does
# 2.5× the forward's multiplies): a backend's training factor where it declares none
WORK_WITH_BACKWARD = 3.5


class Backend:
    """The base of every backend: the four calls it must answer, and defaults."""

    name: str
    # the cheapest per pair on a dense call (no mask reaches a kernel): `auto` takes it
    # for such a call without pricing the others, where it can serve
    fastest_on_dense: bool = False
    # its kernel never multiplies a hidden weight by a value (0·NaN): a non-finite key or
    # value reaches only the rows that see it; else `execute.run_backend` runs it on K and V
    # with those entries zeroed where a check finds one (`visibility.run_masking_values`)
    values_exact: bool = False
    # the factors `cost` prices with, as built in per kind of CPU (none: its cost needs none)
    cost_factors: ClassVar[cost.Factors] = cost.Factors()

    def factors(self, table: cost.CostTable | None) -> dict[str, float]:
        """Its factors in `table` (a call's: `AttentionCall.table`, the runtime's table
        when it was planned): measured on this machine where `attnkit calibrate` kept
        them, else built in for the CPU's kind."""
        if table is None:
            raise RuntimeError(
                f"{self.name} was asked its cost factors for a call made without a cost "
                "table (normalize_call(..., table=attnkit.runtime.current().costs.table()))."
            )
        return table.of(self.name, self.cost_factors)

    def calibrate(self, probe: Probe) -> dict[str, float]:
        """Its factors timed on this CPU (`attnkit calibrate`), while the planner prices
        with the built-in defaults (`cost.BUILT_IN`); the ones it leaves out stay built in."""
        return {}

    def timed(
        self, probe: Probe, inputs: Inputs, mask: Mask | None, runs: int = 3
    ) -> tuple[AttentionCall, float, float]:
        """One call of this backend: the call, the cost the table prices it at (during a
        calibration: the built-in defaults'), and the time it took, in units."""
        call = normalize_call(*inputs, mask, scale=None, softcap=None, table=cost.BUILT_IN)
        spent = probe.attention(inputs, mask, self.name, runs=runs)
        return call, self.cost(call, need_lse=False), spent

    def timed_call_and_pair(
        self, probe: Probe, mask: Mask, calls: Callable[[AttentionCall], int] = lambda c: 1
    ) -> dict[str, float]:
        """Its factors `call` and `pair` on this CPU, for a backend priced per pair plus
        `call` times `calls(call)`: `call` from a tiny call (64 rows under `mask`, one
        call) less what its pairs cost at the built-in factors (at least 5% of its time:
        a timer's hiccup never makes a call free); `pair` from a small one (512 rows), net
        of its calls."""
        default = self.cost_factors.default
        _, predicted, spent = self.timed(probe, probe.inputs(64), mask, runs=20)
        per_call = max(spent - (predicted - default["call"]), 0.05 * spent)
        call, predicted, spent = self.timed(probe, probe.inputs(512), mask)
        n = calls(call)
        pair = cost.rescaled(default["pair"], predicted - default["call"] * n, spent - per_call * n)
        return {"pair": pair, "call": per_call}

    @property
    def version(self) -> int:
        """Changes when this backend's own state changes what it costs (cached plans
        key on it); 0 for a backend without such state."""
        return 0

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None:
        raise NotImplementedError

    def cost(self, call: AttentionCall, *, need_lse: bool) -> float:
        raise NotImplementedError

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int:
        raise NotImplementedError

    def training_factor(self, call: AttentionCall) -> float:
        """What a call autograd records costs over its forward's `cost`: the factor
        `backward` (forward+backward time over forward time), `backward_half` for half
        inputs where the backend has one, `WORK_WITH_BACKWARD` where it declares neither;
        1 for a call without gradient."""
        if not call.requires_grad:
            return 1.0
        factors = self.factors(call.table)
        half = call.q.dtype in HALF and "backward_half" in factors
        return factors.get("backward_half" if half else "backward", WORK_WITH_BACKWARD)

    def run(self, call: AttentionCall, *, need_lse: bool) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError

    def takes_step(self, call: AttentionCall) -> bool:
        """Whether `auto` runs this decoding step (`steps.step_of`) here, unpriced, ahead
        of the `fastest_on_dense` backend: O(1), reading neither the mask's tensors nor S
        but by its `steps.bucket` (a plan made for one step of a growing cache serves the
        steps of its bucket, and chooses as a plan made afresh)."""
        return False

    def beats_dense(self, call: AttentionCall) -> bool:
        """Whether this backend may beat the `fastest_on_dense` one on this dense call (not a
        decoding step), so `auto` prices the call instead of taking that one unpriced."""
        return False

    def cost_floor(self, call: AttentionCall) -> float:
        """A lower bound on `cost` in O(1) (the planner skips `cost` where another
        backend's whole call costs no more); -inf: none cheaper than `cost` itself."""
        return -math.inf

    def prepare(self, call: AttentionCall, *, need_lse: bool) -> Kernel | None:
        """The call `run` makes, decided once for repeated calls, or None."""
        return None

    def serves_backward(self, call: AttentionCall) -> bool:
        """True if `backward` takes `call` (`gradients.fused_gradients` asks)."""
        return False

    def backward(
        self, call: AttentionCall, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """dq, dk, dv of `call` from its output and log-sum-exp (whichever backend
        computed them), or None where this backend cannot."""
        return None

    def paged_decode(self, step: PagedDecode) -> tuple[Tensor, Tensor] | None:
        """out (N, H, Dv) in q's dtype and lse (N, H) float32 of a paged decoding step,
        read in place, or None where this backend has no kernel for it (the caller then
        gathers the pages and attends)."""
        return None

    def notes(self, call: AttentionCall) -> list[str]:
        """Lines `explain` adds when this backend serves `call`."""
        return []

    def work(self, call: AttentionCall) -> Work | None:
        """The blocks it computes for `call`, or None (the whole matrix)."""
        return None

    def intermediates(self, call: AttentionCall) -> dict[str, tuple[int, ...]]:
        """The tensors of L×S it materializes, by name and shape (`explain` lists them
        beside q, k, v and out); none by default."""
        return {}
