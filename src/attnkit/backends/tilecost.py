"""The `tiled` backend's cost model: its factors, its per-pair cost on blocks of a given
height, and how `attnkit calibrate` times them on this CPU.

A tile plan's cost (`tileplan.TilePlan.cost`) is its pairs by the kernel's efficiency on
blocks of their height, plus a cost per group of blocks (one operator call with its
masks, copies and Python). The factors are measured against dense SDPA on the same
machine: the per-group cost on a tiny call; how much more short blocks cost per pair,
from the flash op on one sliding band in blocks of 64 and of 256 rows; the per-pair cost
from a sliding window, net of the groups' cost just measured; and the cost of long causal
runs, which are SDPA's causal kernel, moved with SDPA's causal factor (timed apart, the
two would rank one kernel against itself by timing noise).
"""

from __future__ import annotations

import math

from attnkit._compat import cpu_flash_attention
from attnkit.backends.protocol import Backend, Probe
from attnkit.backends.sdpa import SdpaBackend
from attnkit.call import cost
from attnkit.masks import causal, sliding_window

__all__ = ["FACTORS", "calibrate", "pair_cost"]

# tiled's cost factors (in units of dense SDPA's per pair), built in per kind of CPU:
# `pair` per pair inside blocks of 256+ rows; `short`: blocks of R < 256 rows cost
# (256 / R) ** short per pair more, the op runs short blocks less well (fp32 sliding band:
# R=64 0.78, R=256 0.88-0.91 of dense SDPA's per-pair speed on a 2-core AVX2 CPU,
# benchmarks/tile_levers.py); `causal` per pair of a long causal run
# (is_causal, 768+ rows); `predicate` on masks whose blocks are gathered from an L×S
# tensor (no spans): more than the pairs it skips (a (2, 1, 2048, 2048) random bool mask,
# fp32, H=4: tiled 276 ms, sdpa 134 ms); `call` per group of blocks (masks,
# copies, Python: as `attnkit calibrate` times it on a 2-core AVX2 CPU and on AMX);
# `backward`, `backward_half`: forward+backward over forward (the
# medians over every pattern at S = 4096 on a 2-core AVX512-BF16 CPU)
FACTORS = cost.Factors(
    {"pair": 1.2, "short": 0.1, "causal": 1.15, "predicate": 2.2, "call": 200_000.0}
    | {"backward": 3.7, "backward_half": 3.5},
    {
        "amx": {"pair": 1.33, "short": 0.099, "causal": 1.30, "call": 176_600.0}
        | {"backward_half": 5.4},  # SDPA's blocks on AMX's tiles (native_amx.json: 2.8-9.3)
        "avx512_bf16": {"backward_half": 3.5},
        "avx512": {"backward_half": 3.5},
    },
)


def pair_cost(rows: int, priced: dict[str, float]) -> float:
    """Tiled's per-pair cost on blocks of `rows` query rows: short blocks use the op less well."""
    return float(priced["pair"] * (256 / min(max(rows, 1), 256)) ** priced["short"])


def calibrate(tiled: Backend, probe: Probe) -> dict[str, float]:
    """Tiled's factors timed on this CPU (the module doc says how)."""
    default = FACTORS.default
    measured = {
        "call": probe.attention(probe.inputs(64), causal(), tiled.name, runs=20),  # short: more
        "short": _short_blocks(probe),
    }
    sdpa_causal = probe.measured("sdpa").get("causal")
    if sdpa_causal is not None:
        moved = sdpa_causal / SdpaBackend.cost_factors.default["causal"]
        measured["causal"] = default["causal"] * moved
    call, predicted, spent = tiled.timed(probe, probe.inputs(4096), sliding_window(255) & causal())
    work = tiled.work(call)
    assert work is not None  # tiled says the blocks it computes
    # the pairs' share: the groups' cost as just measured, on blocks of `work.tile` rows
    # priced with the short-block exponent just found
    predicted -= default["call"] * work.calls
    spent -= measured["call"] * work.calls
    predicted *= (256 / min(work.tile, 256)) ** (measured["short"] - default["short"])
    measured["pair"] = cost.rescaled(default["pair"], predicted, spent)
    return measured


def _short_blocks(probe: Probe, window: int = 256) -> float:
    """The exponent e of short blocks' per-pair cost, (256 / R) ** e: the flash op timed on
    one sliding band in blocks of R = 64 and of R = 256 rows (window + R keys each, one
    call, no mask: the mask's cost is in `pair`)."""
    flash = cpu_flash_attention()
    if flash is None:
        return FACTORS.default["short"]
    q, k, v = (t[0] for t in probe.inputs(2048))  # (H, L, D)
    calls, pairs = [], []
    for R in (64, 256):
        W = window + R
        qb = q[:, window:].unfold(1, R, R).permute(1, 0, 3, 2)  # (n, H, R, D), a view
        kb, vb = (t[:, window - W + R :].unfold(1, W, R).permute(1, 0, 3, 2) for t in (k, v))
        n = min(qb.shape[0], kb.shape[0])
        calls.append(lambda a=qb[:n], b=kb[:n], c=vb[:n]: flash(a, b, c, 0.0, False, scale=0.125))
        pairs.append(n * R * W)
    short, tall = probe.interleaved(calls)
    ratio = (short / pairs[0]) / (tall / pairs[1])
    return min(max(math.log(ratio) / math.log(4), 0.01), 0.5)
