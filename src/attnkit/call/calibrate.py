"""Measure the planner's cost table on this CPU, when asked, and keep it (`attnkit.call.cost`).

`auto` never measures on its own: it prices with the table `attnkit calibrate` measured on
this machine and kept, if there is one, else with the table built in for the CPU's kind
(`cost.built_in`), so the same call picks the same backend in every process, however
loaded the machine, and a first call costs what a second does.

The unit, dense SDPA per pair, is timed first; then each registered backend times its
own factors (`Backend.calibrate`, through a `Probe` that times in that unit), in the
registry's order (a factor that moves with another backend's asks the probe for it,
which times that backend first), while the planner prices with the built-in defaults:
SDPA with a mask tensor and with `is_causal`; tiled per group on a tiny call, per pair
on a sliding window, its short blocks from the flash op on blocks of 64 and 256 rows,
its causal runs moved with SDPA's; blockwise and the reference per call on a tiny
causal call and per pair on a small one, net of it. A factor timed on one call is the
built-in default scaled by measured time over the time the defaults predict
(`cost.rescaled`). What a backend does not time stays built in for
the CPU's kind (FlexAttention's: measuring it compiles). One to two seconds on a quiet
CPU; the table is kept as JSON in `$XDG_CACHE_HOME/attnkit` (else `~/.cache/attnkit`)
under the machine's key (CPU model and units, threads, torch and attnkit versions),
every backend's factors by name. Measure on a quiet machine: another program on the same
cores slows short calls many times more than long ones, so a busy measurement is kept
but warned about.

`ATTNKIT_CALIBRATION`: unset, the table kept for this machine, else the built-in one for
its kind; `off` (or `builtin`), the built-in table for this CPU's kind, kept tables
ignored; a kind (`amx`, `avx512_bf16`, `avx512`, `avx2`, `other`), that kind's built-in
table (the tests price with `avx2`); `measure`, measure at the first call that prices and
keep the table; a file path, the table kept in that file (else the built-in one), where
`attnkit calibrate` then writes.

    attnkit calibrate                  # measure now, keep the table, print it
    python -m attnkit.call.calibrate        # the same

Calls are timed at L = 4096, where large calls are decided (SDPA's per-pair efficiency
varies with L). A calibration that fails logs a warning and prices with the built-in
table, never failing the call. A table measured while the process got less than 0.8 of a
CPU per thread is measured once more after a pause and, still busy, kept with a warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from attnkit import runtime
from attnkit._compat import CPU_KINDS, TORCH_SDPA, cpu_features, cpu_kind
from attnkit.backends import Backend, Inputs
from attnkit.call import cost
from attnkit.call.cost import BUILT_IN, CostTable
from attnkit.call.functional import attention
from attnkit.masks import Mask

__all__ = ["active_table", "cache_path", "factors", "main", "measure"]

OFF = ("off", "0", "false", "builtin", "built-in")
MEASURE = "measure"
_log = logging.getLogger("attnkit")


def active_table() -> CostTable:
    """The table a runtime chooses to price with (`Costs.table()`), as
    `ATTNKIT_CALIBRATION` says (it measures only when that says `measure`).

    Returns:
        A `CostTable`: the CPU `kind` (`amx`, `avx512_bf16`, `avx512`, `avx2`, `other`),
        its `source` in words and the factors `attnkit calibrate` measured, if any.

    Examples:
        >>> table = ak.calibrate.active_table()
        >>> table.kind in ("amx", "avx512_bf16", "avx512", "avx2", "other")
        True
    """
    setting = os.environ.get("ATTNKIT_CALIBRATION", "").strip()
    word = setting.lower()
    if word in OFF:
        return cost.built_in()
    if word in CPU_KINDS:
        return cost.built_in(word)
    if word == MEASURE:
        return _measure_and_keep(cache_path())
    path = Path(setting).expanduser() if setting else cache_path()
    kept = _read(path)
    if kept is not None:
        return kept
    if not setting:
        return cost.built_in()
    _log.warning(
        "attnkit: ATTNKIT_CALIBRATION names %s, which holds no cost table for this machine "
        "(`attnkit calibrate` writes one there); pricing with the built-in table",
        path,
    )
    return _built_in_because(f"no table for this machine in {path}")


def _built_in_because(why: str) -> CostTable:
    """This CPU's built-in table, its source saying why no measured one prices."""
    table = cost.built_in()
    return dataclasses.replace(table, source=f"{table.source}; {why}")


def _measure_and_keep(path: Path) -> CostTable:
    """`ATTNKIT_CALIBRATION=measure`: the table measured now, kept at `path`."""
    _log.info("attnkit: measuring the cost model on this CPU (one to two seconds) ...")
    try:
        measured = measure()
    except Exception as err:  # a timing that fails must never fail the call that prices
        _log.warning("attnkit: cost calibration failed (%s); the built-in table prices", err)
        return _built_in_because(f"calibration failed: {err}")
    if BUSY in measured.source:
        _log.warning("attnkit: %s; %s", measured.source, AGAIN)
    try:
        return _write(path, measured)
    except OSError as err:  # a read-only home: this process prices with it all the same
        _log.warning("attnkit: cannot keep the cost table at %s (%s)", path, err)
        return measured


def machine_key() -> dict[str, object]:
    """What a table is measured for: the CPU, its units, the threads, torch, attnkit."""

    return {
        "cpu": _cpu_model(),
        "features": cpu_features(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "attnkit": _installed_version(),
    }


def cache_path() -> Path:
    """This machine's table in the user's cache directory.

    Returns:
        A `Path`: `$XDG_CACHE_HOME/attnkit/cost-<key>.json` (else `~/.cache/attnkit`),
        the key a digest of the CPU, its units, the threads, torch and attnkit.

    Examples:
        >>> path = ak.calibrate.cache_path()
        >>> path.parent.name, path.name.startswith("cost-"), path.suffix
        ('attnkit', True, '.json')
    """
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


def factors(table: CostTable) -> dict[str, dict[str, float]]:
    """Every registered backend's factors in `table`, by backend name (those with any).

    Args:
        table: a `CostTable` (`active_table()`, `measure()`, `cost.built_in(kind)`).

    Returns:
        A dict of backend name to its factors (name to float, in units of dense SDPA's
        time per pair), built in for the table's kind where it measured none.

    Examples:
        >>> table = ak.cost.built_in("avx2")
        >>> sorted(ak.calibrate.factors(table)["sdpa"])
        ['backward', 'backward_half', 'causal', 'convert', 'masked']
    """
    return {
        b.name: table.of(b.name, b.cost_factors)
        for b in runtime.current().backends
        if b.cost_factors.default
    }


def _read(path: Path) -> CostTable | None:
    """The table kept at `path` for this machine, or None (absent, unreadable, measured on
    another machine, thread count or version, or naming other factors than a registered
    backend has)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("machine") != machine_key():
        return None
    kept = data.get("factors")
    if not isinstance(kept, dict) or not kept or not all(_numbers(f) for f in kept.values()):
        return None
    names = {b.name: set(b.cost_factors.default) for b in runtime.current().backends}
    if any(name in names and set(f) != names[name] for name, f in kept.items()):
        return None
    when = data.get("when")
    date = time.strftime(" (%Y-%m-%d)", time.localtime(when)) if isinstance(when, float) else ""
    busy = f"; {BUSY}" if data.get("busy") else ""
    source = f"measured on this CPU, kept in {path}{date}{busy}"
    return CostTable(cpu_kind(), source, measured=kept)


def _installed_version() -> str:
    """attnkit's version as installed (`attnkit.__version__`, which the metadata reads)."""
    try:
        return importlib.metadata.version("attnkit")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "not installed"


def _numbers(backend_factors: object) -> bool:
    """A backend's kept factors: names to positive finite numbers."""
    if not isinstance(backend_factors, dict):
        return False
    return all(isinstance(x, (int, float)) and 0 < x < 1e12 for x in backend_factors.values())


def _write(path: Path, table: CostTable) -> CostTable:
    """Keep `table` at `path` (OSError where it cannot), and the table as read back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "machine": machine_key(),
        "factors": factors(table),
        "when": time.time(),
        "busy": BUSY in table.source,
    }
    path.write_text(json.dumps(data, indent=1))
    kept = _read(path)
    return kept if kept is not None else table


# ------------------------------------------------------------------ the measurements


BUSY = "the CPU was busy while measured"
AGAIN = "run `attnkit calibrate` again when the machine is quiet"
QUIET_SHARE = 0.8  # CPU time over wall time per thread below this: other programs ran too
ATTEMPTS = 2


def measure() -> CostTable:
    """The cost table of this CPU, timed now (the built-in defaults price meanwhile).

    A measurement is only as good as the machine is quiet: another program on the same
    cores slows short calls many times more than long ones (a tiny call waits for its
    threads), and a kept table misprices every later process. So the process's CPU share
    is watched while the calls run; on a busy CPU the measurement is repeated once after
    a pause, and if it never ran quiet the table's source says so (`main` and
    `ATTNKIT_CALIBRATION=measure` keep it all the same, with a warning).

    Returns:
        A `CostTable` of this CPU's kind holding the measured factors; nothing is kept
        on disk and the planner's table is left as it was.

    Examples:
        >>> table = ak.calibrate.measure()  # one to two seconds on a quiet CPU
        >>> table.source.startswith("measured on this CPU"), "sdpa" in table.measured
        (True, True)
    """
    costs, backends = runtime.current().costs, runtime.current().backends
    previous = costs.chosen
    costs.use(BUILT_IN)  # the backends plan with the defaults while they are timed
    try:
        with torch.no_grad():
            for _ in range(ATTEMPTS):
                timed, share = _measured()
                measured = {
                    n: _checked(backends.get(n), f) for n, f in timed.items() if n in backends
                }
                if share >= QUIET_SHARE:
                    break
                time.sleep(1.0)  # a compile's workers, another program: often short
    finally:
        costs.use(previous)
    when = time.strftime("%Y-%m-%d")
    source = f"measured on this CPU ({_cpu_model()}, {when})"
    if share < QUIET_SHARE:
        source += f"; {BUSY} (CPU share {share:.2f} per thread)"
    return CostTable(cpu_kind(), source, measured=measured)


def _measured() -> tuple[dict[str, dict[str, float]], float]:
    """Each backend's timed factors, and the process's CPU share per thread while they
    were timed (about 1 on a quiet CPU: the kernels' threads run, or spin, all along)."""
    cpu, wall = time.process_time(), time.perf_counter()
    probe = _Probe()
    measured = {b.name: dict(probe.measured(b.name)) for b in runtime.current().backends}
    share = (time.process_time() - cpu) / (time.perf_counter() - wall) / torch.get_num_threads()
    return {name: factors for name, factors in measured.items() if factors}, share


class _Probe:
    """`backends.Probe` on this CPU: times in units of dense SDPA's time per pair, timed
    at L = 4096 when made (SDPA's efficiency per pair depends on L: timed where large
    calls are decided)."""

    def __init__(self) -> None:
        self._generator = torch.Generator().manual_seed(0)
        self._timed: dict[str, dict[str, float]] = {}  # by backend, as each is timed
        L = 4096
        q, k, v = self.inputs(L, H=2)
        self._unit = 1.0
        self._unit = self.time(lambda: TORCH_SDPA(q, k, v)) / (2 * L * L)

    def measured(self, backend: str) -> dict[str, float]:
        backends = runtime.current().backends
        if backend not in self._timed and backend in backends:
            self._timed[backend] = {}  # being timed: a cycle of asks ends here
            self._timed[backend] = backends.get(backend).calibrate(self)
        return self._timed.get(backend, {})

    def inputs(self, L: int, H: int = 8) -> Inputs:
        q, k, v = (torch.randn(1, H, L, 64, generator=self._generator) for _ in range(3))
        return q, k, v

    def interleaved(self, fns: Sequence[Callable[[], object]], runs: int = 7) -> list[float]:
        return [seconds / self._unit for seconds in _interleaved(fns, runs)]

    def time(self, fn: Callable[[], object], runs: int = 3) -> float:
        return self.interleaved([fn], runs)[0]

    def attention(self, inputs: Inputs, mask: Mask | None, backend: str, runs: int = 3) -> float:
        return self.time(lambda: attention(*inputs, mask, backend=backend), runs)


def _checked(backend: Backend, timed: dict[str, float]) -> dict[str, float]:
    """What a backend timed, if it names its own factors with positive finite numbers; a
    `ValueError` otherwise (a kept table would not be read back)."""
    if set(timed) - set(backend.cost_factors.default) or not _numbers(timed):
        raise ValueError(
            f"backend {backend.name!r} timed {timed}: expected positive numbers for its own "
            f"factors ({', '.join(backend.cost_factors.default) or 'none'})"
        )
    return dict(timed)


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


def main() -> int:
    """`attnkit calibrate`: measure now, keep the table where the runtime's cost table is read from
    (`ATTNKIT_CALIBRATION`'s file if it names one, else this machine's in the cache
    directory), print it; a busy CPU gets a warning, and its table is kept all the same.

    Returns:
        The exit status: 0, or 1 where the table cannot be written (the reason on
        stderr). The process then prices with the table measured.

    Examples:
        >>> import os, tempfile
        >>> from unittest import mock
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = os.path.join(folder.name, "cost.json")
        >>> with mock.patch.dict(os.environ, ATTNKIT_CALIBRATION=path):
        ...     status = ak.calibrate.main()
        {...}
        measured on this CPU ...; kept in .../cost.json
        >>> status, os.path.exists(path)
        (0, True)
        >>> ak.runtime.current().costs.use(None)  # price as the environment says again
        >>> folder.cleanup()
    """
    setting = os.environ.get("ATTNKIT_CALIBRATION", "").strip()
    keyword = setting.lower() in (*OFF, *CPU_KINDS, MEASURE)
    path = Path(setting).expanduser() if setting and not keyword else cache_path()
    threads = torch.get_num_threads()
    print(
        f"measuring the cost model on this CPU ({_cpu_model()}, {threads} threads) ...",
        file=sys.stderr,
        flush=True,
    )
    table = measure()
    try:
        kept = _write(path, table)
    except OSError as err:
        print(f"attnkit calibrate: cannot keep the table at {path} ({err})", file=sys.stderr)
        return 1
    runtime.current().costs.use(kept)
    print(json.dumps({"machine": machine_key(), "factors": factors(table)}, indent=1))
    print(f"{table.source}; kept in {path}")
    if BUSY in table.source:
        warning = "another program shared its cores, which slows small calls more than large ones"
        print(f"attnkit calibrate: warning: {BUSY}: {warning}; {AGAIN}", file=sys.stderr)
    if keyword and setting.lower() != MEASURE:  # off or a kind: kept, but not read
        print(
            f"note: ATTNKIT_CALIBRATION={setting} prices with a built-in table, not this one",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
