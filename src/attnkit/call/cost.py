"""The CPU cost model of the planner: per-pair factors, each owned by the backend it
prices, and the one table of them a process prices with.

Unit: the time SDPA's dense fused kernel spends on one query-key pair of one head. The
factors only need to rank the backends, not predict seconds, but their ratios differ
from CPU to CPU (AVX2, AVX512, AMX; the thread count; the torch version). Each backend
declares its factors as built in (`Factors`: the values timed on a 2-core AVX2 CPU, and
each other measured kind's values that differ) and how to time them on this CPU
(`Backend.calibrate`); this module names no backend.

A runtime's table (`Costs.table()`) is chosen, never measured, at its first use: the one
`attnkit calibrate` measured on this machine and kept, if there is one, else the one
built in for this CPU's kind (`built_in`, `_compat.cpu_kind`), measured on a CPU of that
kind or, for a kind not measured yet, the nearest measured kind's. No call measures unless asked
(`ATTNKIT_CALIBRATION=measure`), so the same call picks the same backend in every
process, however loaded the machine; `explain` names the table. `attnkit.call.calibrate`
reads `ATTNKIT_CALIBRATION` (`off`: the built-in table; a kind: that kind's; a path: the
table kept there).

Kinds (`_compat.cpu_kind`): `amx`, `avx512_bf16`, `avx512`, `avx2`, `other`; measured so
far: `avx2` and `amx`. The AVX512 kinds take `amx`'s factors (their float32 kernels are
the same AVX512 code), `other` takes `avx2`'s, and the table's source says so. A
backend's `cost_floor` lets the planner skip pricing it (tiled plans no tiles for a
decoding step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from attnkit._compat import CPU_KINDS, cpu_kind

__all__ = [
    "BUILT_IN",
    "NEAREST",
    "TABLES",
    "CostTable",
    "Costs",
    "Factors",
    "built_in",
    "rescaled",
]

# where each measured kind's factors were timed
_MEASURED_ON = {
    "avx2": "timings of a 2-core AVX2 CPU, PyTorch 2.13, float32, D=64",
    "amx": "timings of a 2-core Intel Xeon with AMX, PyTorch 2.13, float32, D=64, 2026-12-02",
}

# A kind not measured yet prices with the nearest measured kind. AVX512 CPUs without AMX
# take the AMX factors: every AMX CPU has AVX512 and AVX512-BF16 too, and the float32
# kernels the factors price run the same AVX512 code on both (torch's CPU capability is
# "AVX512" on an AMX Xeon: AMX multiplies only bfloat16 and int8 tiles), where an AVX2 CPU
# runs vectors half as wide. A CPU without AVX2 (ARM, an old x86) takes the AVX2 factors.
NEAREST = {"avx512_bf16": "amx", "avx512": "amx", "other": "avx2"}


@dataclass(frozen=True)
class Factors:
    """One backend's cost factors as built in: `default`, timed on a 2-core AVX2 CPU, and
    for each other measured kind (`amx`) the values that differ there; a kind priced
    with its nearest measured kind's factors may still have some of its own (the native
    kernel's bfloat16 factor on `avx512_bf16`), which take precedence."""

    default: Mapping[str, float] = field(default_factory=dict)
    kinds: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def built_in(self, kind: str) -> dict[str, float]:
        """The factors built in for a kind of CPU (the nearest measured kind's, then its
        own)."""
        nearest = self.kinds.get(NEAREST.get(kind, kind), {})
        return {**self.default, **nearest, **self.kinds.get(kind, {})}


@dataclass(frozen=True)
class CostTable:
    """What the planner prices with: the factors built in for a kind of CPU, over them the
    ones `attnkit calibrate` measured on this machine (by backend name), and where they
    came from."""

    kind: str
    source: str
    measured: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def of(self, name: str, factors: Factors) -> dict[str, float]:
        """The factors of the backend called `name`, whose built-in ones are `factors`."""
        return {**factors.built_in(self.kind), **self.measured.get(name, {})}


def rescaled(default: float, predicted: float, spent: float) -> float:
    """A factor timed on one call: its default scaled by the time the call took over the
    time the defaults predict (at least 5% of it: a timer's hiccup never prices a
    backend as free)."""
    return default * max(spent, 0.05 * predicted) / predicted


def _built_in_source(kind: str) -> str:
    near = NEAREST.get(kind, kind)
    nearest = f"nearest measured: {near}; " if near != kind else ""
    return f"built in for {kind} ({nearest}{_MEASURED_ON[near]})"


TABLES: dict[str, CostTable] = {kind: CostTable(kind, _built_in_source(kind)) for kind in CPU_KINDS}
BUILT_IN = TABLES["avx2"]  # every backend's defaults: what prices while `attnkit calibrate` times


def built_in(kind: str | None = None) -> CostTable:
    """The table built in for a kind of CPU (`_compat.CPU_KINDS`; None: this CPU's)."""
    chosen = kind or cpu_kind()
    if chosen not in TABLES:
        raise ValueError(f"unknown CPU kind {chosen!r}: expected one of {', '.join(TABLES)}")
    return TABLES[chosen]


class Costs:
    """The table a runtime prices with (`attnkit.runtime`): `choose()` picks it at its
    first use (`attnkit.call.calibrate.active_table`: a kept table, or the one built in,
    as `ATTNKIT_CALIBRATION` says), and it stays until `use` gives another. `changes`
    counts the tables given, so plans made on an older one are made again."""

    def __init__(self, choose: Callable[[], CostTable] = built_in) -> None:
        self.choose = choose
        self.chosen: CostTable | None = None
        self.changes = 0

    def table(self) -> CostTable:
        """The table the planner prices with, chosen once: the one `attnkit calibrate`
        kept for this machine, else the one built in for this CPU's kind."""
        if self.chosen is None:
            self.chosen = self.choose()
        return self.chosen

    def use(self, chosen: CostTable | None) -> None:
        """Price with `chosen` from now on (None: choose again at the next `table()`)."""
        self.chosen = chosen
        self.changes += 1
