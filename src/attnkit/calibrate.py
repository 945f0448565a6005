"""Measure the planner's cost table on the CPU it runs on (`attnkit.cost`).

Each factor of the table is measured by timing one representative call against dense
SDPA on the same machine: SDPA with a mask tensor and with `is_causal` (tiled's causal
runs are that kernel: their factor moves with it), the tiled backend on a tiny call (its
per-call cost) and a sliding window (per pair in blocks), the flash op on blocks of 64
and 256 rows (how much more short blocks cost: the tile heights' ranking), blockwise and
the reference on a small causal call. A tiled or blockwise factor is the built-in one
scaled by measured time over the time the built-in table predicts for that call. One to
two seconds, once per CPU model, thread count and torch version: the table is kept as
JSON in `$XDG_CACHE_HOME/attnkit` (else `~/.cache/attnkit`). FlexAttention's factor
stays built in (measuring it compiles).

`ATTNKIT_CALIBRATION`: unset, measure (or read the cache); `off`, the built-in table;
a file path, measure once and keep the table there.

    python -m attnkit.calibrate        # measure now, keep the table (whatever the load), print it
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from attnkit import cost
from attnkit._compat import cpu_features
from attnkit._version import __version__
from attnkit.backends import get_backend
from attnkit.contracts import normalize_call
from attnkit.cost import BUILT_IN, CostTable
from attnkit.functional import attention
from attnkit.masks import Mask, causal, sliding_window

__all__ = ["active_table", "cache_path", "measure"]

OFF = ("off", "0", "false", "builtin", "built-in")
_log = logging.getLogger("attnkit")


def active_table() -> CostTable:
    """The table `cost.table()` prices with, as `ATTNKIT_CALIBRATION` says."""
    setting = os.environ.get("ATTNKIT_CALIBRATION", "").strip()
    if setting.lower() in OFF:
        return BUILT_IN
    path = Path(setting).expanduser() if setting else cache_path()
    found = _read(path)
    if found is not None:
        return found
    _log.info("attnkit: measuring the cost model on this CPU (one to two seconds, once) ...")
    try:
        measured = measure()
    except Exception as err:  # a timing that fails must never fail the call that prices
        _log.warning("attnkit: cost calibration failed (%s); the built-in table prices", err)
        return dataclasses.replace(BUILT_IN, source=f"built in (calibration failed: {err})")
    if BUSY in measured.source:  # another program shared the CPU: measure next time
        _log.info("attnkit: %s", measured.source)
    else:
        _write(path, measured)
    return measured


def machine_key() -> dict[str, object]:
    """What a table is measured for: the CPU, its units, the threads, torch, attnkit."""

    return {
        "cpu": _cpu_model(), "features": cpu_features(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "attnkit": __version__,
    }  # fmt: skip


def cache_path() -> Path:
    """This machine's table in the user's cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    digest = hashlib.sha1(json.dumps(machine_key(), sort_keys=True).encode()).hexdigest()
    return Path(base) / "attnkit" / f"cost-{digest[:16]}.json"


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _read(path: Path) -> CostTable | None:
    """The table kept at `path` for this machine, or None (absent, unreadable, or
    measured on another machine, thread count or version)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("machine") != machine_key():
        return None
    factors = data.get("factors")
    names = set(BUILT_IN.factors())
    if not isinstance(factors, dict) or set(factors) != names:
        return None
    if not all(isinstance(x, (int, float)) and 0 < x < 1e12 for x in factors.values()):
        return None
    return CostTable(**factors, source=f"measured on this CPU, kept in {path}")


def _write(path: Path, found: CostTable) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"machine": machine_key(), "factors": found.factors(), "when": time.time()}
        path.write_text(json.dumps(data, indent=1))
    except OSError as err:  # a read-only home: measured again by the next process
        _log.info("attnkit: cannot keep the cost table at %s (%s)", path, err)


# ------------------------------------------------------------------ the measurements


BUSY = "the CPU was busy while measured"
QUIET_SHARE = 0.8  # CPU time over wall time per thread below this: other programs ran too
ATTEMPTS = 2


def measure() -> CostTable:
    """The cost table of this CPU, timed now (the built-in table prices meanwhile).

    A measurement is only as good as the machine is quiet: another program on the same
    cores slows short calls many times more than long ones (a tiny call waits for its
    threads), and a kept table would misprice every later process. So the process's CPU
    share is watched while the calls run; on a busy CPU the measurement is repeated once
    after a pause, and if it never ran quiet the table serves this process only (its
    source says so; `active_table` does not keep it, so a CPU that stays busy measures
    in every process: `python -m attnkit.calibrate` keeps a table whatever the load).
    """
    previous = cost._ACTIVE
    cost.use(BUILT_IN)  # the backends plan with it while they are timed
    try:
        with torch.no_grad():
            for _ in range(ATTEMPTS):
                factors, share = _measured()
                if share >= QUIET_SHARE:
                    break
                time.sleep(1.0)  # a compile's workers, another program: often short
    finally:
        cost.use(previous)
    when = time.strftime("%Y-%m-%d")
    source = f"measured on this CPU ({_cpu_model()}, {when})"
    if share < QUIET_SHARE:
        source += f"; {BUSY} (CPU share {share:.2f} per thread): not kept, measured again next time"
    return CostTable(**factors, source=source)


Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _measured() -> tuple[dict[str, float], float]:
    """The factors, and the process's CPU share per thread while they were timed (about 1
    on a quiet CPU: the kernels' threads run, or spin, all along)."""
    g = torch.Generator().manual_seed(0)

    def qkv(L: int, H: int = 8) -> Inputs:
        q, k, v = (torch.randn(1, H, L, 64, generator=g) for _ in range(3))
        return q, k, v

    # SDPA's efficiency per pair depends on L (its causal kernel: 1.5× dense per pair at
    # L=1024, 0.94× at 4096 on a 2-core AVX2 CPU): timed where large calls are decided
    L = 4096
    q, k, v = qkv(L, H=2)
    pairs = 2 * L * L
    cpu, wall = time.process_time(), time.perf_counter()
    unit = _best(lambda: F.scaled_dot_product_attention(q, k, v)) / pairs  # s per pair
    band = (causal() & sliding_window(L // 8)).dense(1, 1, L, L)  # (1, 1, L, S)
    masked = _best(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=band)) / pairs
    causal_pairs = 2 * L * (L + 1) / 2
    is_causal = _best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    found = BUILT_IN.factors()
    found["sdpa_masked"] = masked / unit
    found["sdpa_causal"] = is_causal / causal_pairs / unit
    # tiled's causal runs are SDPA's causal kernel: their factor moves with SDPA's (timed
    # apart, the two would rank one kernel against itself by timing noise)
    found["tiled_causal"] = BUILT_IN.tiled_causal * found["sdpa_causal"] / BUILT_IN.sdpa_causal
    found["tiled_call"] = _seconds(qkv(64), causal(), "tiled", runs=20) / unit  # short: more runs
    found["tiled_short"] = _short_blocks(qkv(2048))
    scaled: dict[str, tuple[Inputs, Mask, str]] = {
        "tiled_pair": (qkv(4096), sliding_window(255) & causal(), "tiled"),
        "blockwise": (qkv(512), causal(), "blockwise"),
        "reference": (qkv(512), causal(), "reference"),
    }
    for name, (inputs, mask, backend) in scaled.items():
        predicted, calls, tile = _predicted(inputs, mask, backend)
        spent = _seconds(inputs, mask, backend) / unit
        if backend == "tiled":  # the pairs' share: the calls' cost as just measured
            predicted -= BUILT_IN.tiled_call * calls
            spent -= found["tiled_call"] * calls
            # ... on blocks of `tile` rows: priced with the short-block exponent just found
            predicted *= (256 / tile) ** (found["tiled_short"] - BUILT_IN.tiled_short)
        found[name] = BUILT_IN.factors()[name] * max(spent, 0.05 * predicted) / predicted
    share = (time.process_time() - cpu) / (time.perf_counter() - wall) / torch.get_num_threads()
    return found, share


def _predicted(inputs: Inputs, mask: Mask, backend: str) -> tuple[float, int, int]:
    """The built-in table's cost of a call, and its tiled groups and tile height (0 and
    256 for other backends)."""
    call = normalize_call(*inputs, mask, scale=None, softcap=None, dropout_p=0.0)
    chosen = get_backend(backend)
    work = chosen.work(call)
    if work is None:
        return chosen.cost(call, need_lse=False), 0, 256
    return chosen.cost(call, need_lse=False), work.calls, min(work.tile, 256)


def _short_blocks(inputs: Inputs, window: int = 256) -> float:
    """The exponent e of short blocks' per-pair cost, (256 / R) ** e: the flash op timed on
    one sliding band in blocks of R = 64 and of R = 256 rows (window + R keys each, one
    call, no mask: the mask's cost is in `tiled_pair`)."""
    from attnkit._compat import cpu_flash_attention

    flash = cpu_flash_attention()
    if flash is None:
        return BUILT_IN.tiled_short
    q, k, v = (t[0] for t in inputs)  # (H, L, D)
    calls, pairs = [], []
    for R in (64, 256):
        W = window + R
        qb = q[:, window:].unfold(1, R, R).permute(1, 0, 3, 2)  # (n, H, R, D), a view
        kb, vb = (t[:, window - W + R :].unfold(1, W, R).permute(1, 0, 3, 2) for t in (k, v))
        n = min(qb.shape[0], kb.shape[0])
        calls.append(lambda a=qb[:n], b=kb[:n], c=vb[:n]: flash(a, b, c, 0.0, False, scale=0.125))
        pairs.append(n * R * W)
    short, tall = _interleaved(calls)  # the two alike disturbed: their ratio is steadier
    ratio = (short / pairs[0]) / (tall / pairs[1])
    return min(max(math.log(ratio) / math.log(4), 0.01), 0.5)


def _interleaved(fns: Sequence[Callable[[], object]], runs: int = 7) -> list[float]:
    """The shortest time of each call over `runs` rounds that call each once in turn."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(runs):
        for fn, spent in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [min(t) for t in times]


def _seconds(inputs: Inputs, mask: Mask, backend: str, runs: int = 3) -> float:
    return _best(lambda: attention(*inputs, mask, backend=backend), runs)


def _best(fn: Callable[[], object], runs: int = 3) -> float:
    """The shortest of `runs` timed calls after one untimed (the least disturbed)."""
    return _interleaved([fn], runs)[0]


def main() -> int:
    """Measure now and keep the table where `cost.table()` reads it (also when busy)."""
    found = measure()
    setting = os.environ.get("ATTNKIT_CALIBRATION", "").strip()
    path = Path(setting).expanduser() if setting and setting.lower() not in OFF else cache_path()
    _write(path, found)
    print(json.dumps({"machine": machine_key(), "factors": found.factors()}, indent=1))
    print(f"{found.source}; kept in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
