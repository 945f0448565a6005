"""The CPU cost model of the planner: one table of factors, measured on the running CPU.

Unit: the time SDPA's dense fused kernel spends on one query-key pair of one head. The
factors only need to rank the backends, not predict seconds, but their ratios differ
from CPU to CPU (AVX2, AVX512, AMX; the thread count; the torch version), so `table()`
is the one `attnkit.calibrate` measured here, at first use, in one to two seconds, and kept
in the user's cache directory for this CPU, thread count and torch version.
`ATTNKIT_CALIBRATION=off` gives the built-in table (what the tests use);
`ATTNKIT_CALIBRATION=/some/file.json` keeps the measured table in that file instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BUILT_IN", "CostTable", "measure_with", "table", "tiled_pair", "use"]


@dataclass(frozen=True)
class CostTable:
    """Per-pair factors of each kernel in units of dense SDPA's, and where they came from."""

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
    source: str = (
        "built in (timings of a 2-core AVX2 CPU, PyTorch 2.13, float32, D=64; "
        "ATTNKIT_CALIBRATION=off or no calibration yet)"
    )

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


BUILT_IN = CostTable()
_ACTIVE: CostTable | None = None


# where the table comes from at its first use: `attnkit.calibrate.active_table`, set by
# the package (calibrating runs attention, which prices with this module: the measuring
# is handed in, so this module imports none of it)
def _built_in() -> CostTable:
    return BUILT_IN


_MEASURE: Callable[[], CostTable] = _built_in


def measure_with(source: Callable[[], CostTable]) -> None:
    """Take the table from `source()` at its first use (`attnkit` sets the calibration)."""
    global _MEASURE
    _MEASURE = source


def table() -> CostTable:
    """The table the planner prices with: measured on this CPU (`attnkit.calibrate`,
    once per process; from the cache when this CPU was measured before) unless
    `ATTNKIT_CALIBRATION=off`."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = _MEASURE()
    return _ACTIVE


def use(found: CostTable | None) -> None:
    """Price with `found` from now on (None: decide again at the next call of `table`)."""
    global _ACTIVE
    _ACTIVE = found


def tiled_pair(rows: int) -> float:
    """Tiled's per-pair cost on blocks of `rows` query rows: short blocks use the op less well."""
    found = table()
    return float(found.tiled_pair * (256 / min(max(rows, 1), 256)) ** found.tiled_short)
