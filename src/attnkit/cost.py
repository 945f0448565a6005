"""The CPU cost model of the planner: a table of factors per kind of CPU.

Unit: the time SDPA's dense fused kernel spends on one query-key pair of one head. The
factors only need to rank the backends, not predict seconds, but their ratios differ
from CPU to CPU (AVX2, AVX512, AMX; the thread count; the torch version). So `table()`
is chosen, never measured, at its first use: the one `attnkit calibrate` measured on this
machine and kept, if there is one, else the one built in for this CPU's kind
(`built_in`, `_compat.cpu_kind`), measured on a CPU of that kind or, for a kind not
measured yet, the nearest measured kind's. No call measures unless asked
(`ATTNKIT_CALIBRATION=measure`), so the same call picks the same backend in every
process, however loaded the machine; `explain` names the table. `attnkit.calibrate`
reads `ATTNKIT_CALIBRATION` (`off`: the built-in table; a kind: that kind's; a path: the
table kept there).

Kinds (`_compat.cpu_kind`): `amx`, `avx512_bf16`, `avx512`, `avx2`, `other`; measured so
far: `avx2` and `amx`. The AVX512 kinds take `amx`'s table (their float32 kernels are
the same AVX512 code), `other` takes `avx2`'s, and the table's source says so. A
backend's `cost_floor` lets the planner skip pricing it (tiled plans no tiles for a
decoding step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from attnkit._compat import CPU_KINDS, cpu_kind

__all__ = [
    "BUILT_IN",
    "NEAREST",
    "TABLES",
    "CostTable",
    "built_in",
    "measure_with",
    "table",
    "tiled_pair",
    "use",
]

# where each measured kind's table was timed
_MEASURED_ON = {
    "avx2": "timings of a 2-core AVX2 CPU, PyTorch 2.13, float32, D=64",
    "amx": "timings of a 2-core Intel Xeon with AMX, PyTorch 2.13, float32, D=64, 2026-12-02",
}


@dataclass(frozen=True)
class CostTable:
    """Per-pair factors of each kernel in units of dense SDPA's, and where they came from
    (the defaults: the avx2 table)."""

    sdpa_dense: float = 1.0  # F.scaled_dot_product_attention, no mask (the unit)
    sdpa_causal: float = 1.0  # is_causal=True, per pair it computes (about half of L×S)
    sdpa_masked: float = 1.25  # with a mask tensor: the kernel reads it and skips no block
    tiled_pair: float = 1.2  # tiled, per pair inside blocks of 256+ rows
    # tiled, blocks of R < 256 rows cost (256 / R) ** this per pair more: the op runs
    # short blocks less well (fp32 sliding band: R=64 0.78, R=256 0.88-0.91 of dense
    # SDPA's per-pair speed on a 2-core AVX2 CPU, benchmarks/tile_levers.py; 2026-12-01)
    tiled_short: float = 0.1
    tiled_causal: float = 1.15  # tiled, per pair of a long causal run (is_causal, 768+ rows)
    # tiled, factor on masks whose blocks are gathered from an L×S tensor (no spans): more
    # than the pairs it skips (a (2, 1, 2048, 2048) random bool mask, fp32, H=4: tiled
    # 276 ms, sdpa 134 ms; 2026-11-30)
    tiled_predicate: float = 2.2
    tiled_call: float = 50_000.0  # tiled, per group of blocks (masks, copies, Python)
    flex_pair: float = 2.4  # compiled FlexAttention, per pair in its 128×128 blocks (warm)
    blockwise: float = 4.0  # the reference's math in row blocks over key spans
    reference: float = 6.0  # the readable loop materializes (B, H, L, S) scores
    source: str = f"built in for avx2 ({_MEASURED_ON['avx2']})"  # the defaults: avx2's

    def factors(self) -> dict[str, float]:
        """The numbers alone, by name."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "source"
        }

    def summary(self) -> str:
        """One line for `explain`: the main figures and where they came from."""
        return (
            f"cost model: sdpa masked {self.sdpa_masked:.2f}, causal {self.sdpa_causal:.2f}; "
            f"tiled {self.tiled_pair:.2f} per pair (short blocks ×(256/rows)^"
            f"{self.tiled_short:.2f}), causal runs {self.tiled_causal:.2f}, "
            f"{self.tiled_call:,.0f} per call; blockwise {self.blockwise:.1f}, reference "
            f"{self.reference:.1f} (× dense SDPA per pair); {self.source}"
        )


# each measured kind's factors over the defaults (the avx2 table): `attnkit calibrate` on
# that CPU, the median of three runs per factor (tiled_predicate and flex_pair are not
# measured: they stay avx2's)
_MEASURED: dict[str, dict[str, float]] = {
    "avx2": {},
    "amx": {
        "sdpa_causal": 1.13, "sdpa_masked": 1.88, "tiled_pair": 1.33, "tiled_short": 0.099,
        "tiled_causal": 1.30, "tiled_call": 176_600.0, "blockwise": 4.36, "reference": 4.20,
    },
}  # fmt: skip

# A kind not measured yet prices with the nearest measured kind. AVX512 CPUs without AMX
# take the AMX table: every AMX CPU has AVX512 and AVX512-BF16 too, and the float32 kernels
# the table prices run the same AVX512 code on both (torch's CPU capability is "AVX512" on
# an AMX Xeon: AMX multiplies only bfloat16 and int8 tiles), where an AVX2 CPU runs
# vectors half as wide. A CPU without AVX2 (ARM, an old x86) takes the AVX2 table.
NEAREST = {"avx512_bf16": "amx", "avx512": "amx", "other": "avx2"}


def _built_in_source(kind: str) -> str:
    near = NEAREST.get(kind, kind)
    nearest = f"nearest measured: {near}; " if near != kind else ""
    return f"built in for {kind} ({nearest}{_MEASURED_ON[near]})"


TABLES: dict[str, CostTable] = {
    kind: CostTable(**_MEASURED[NEAREST.get(kind, kind)], source=_built_in_source(kind))
    for kind in CPU_KINDS
}
BUILT_IN = TABLES["avx2"]  # the defaults; what `attnkit.calibrate` scales its timings from
_ACTIVE: CostTable | None = None


def built_in(kind: str | None = None) -> CostTable:
    """The table built in for a kind of CPU (`_compat.CPU_KINDS`; None: this CPU's)."""
    chosen = kind or cpu_kind()
    if chosen not in TABLES:
        raise ValueError(f"unknown CPU kind {chosen!r}: expected one of {', '.join(TABLES)}")
    return TABLES[chosen]


# where the table comes from at its first use: `attnkit.calibrate.active_table` (a kept
# table, or the built-in one, as `ATTNKIT_CALIBRATION` says), set by the package
# (calibrating runs attention, which prices with this module: the choosing is handed in,
# so this module imports none of it)
_MEASURE: Callable[[], CostTable] = built_in


def measure_with(source: Callable[[], CostTable]) -> None:
    """Take the table from `source()` at its first use (`attnkit` sets the calibration)."""
    global _MEASURE
    _MEASURE = source


def table() -> CostTable:
    """The table the planner prices with, chosen once per process: the one `attnkit
    calibrate` kept for this machine, else the one built in for this CPU's kind
    (`ATTNKIT_CALIBRATION` decides otherwise: `attnkit.calibrate`)."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = _MEASURE()
    return _ACTIVE


def use(chosen: CostTable | None) -> None:
    """Price with `chosen` from now on (None: decide again at the next call of `table`)."""
    global _ACTIVE
    _ACTIVE = chosen


def tiled_pair(rows: int) -> float:
    """Tiled's per-pair cost on blocks of `rows` query rows: short blocks use the op less well."""
    active = table()
    return float(active.tiled_pair * (256 / min(max(rows, 1), 256)) ** active.tiled_short)
