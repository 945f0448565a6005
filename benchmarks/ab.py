"""Two versions of attnkit side by side: `auto` on bench.py's cases, old tree against new.

A change that must keep the speed (a refactor) is checked here: each round runs one
process per source tree, in turns (old, new, new, old, ...), so the drift of a shared
machine falls on both alike. A process times `attnkit.attention` (backend "auto", as
bench.py's `auto` column calls it: the mask object reused across calls) on every case of
bench.py's patterns at the given sizes, dtypes and passes, and SDPA's forward with the
same mask as the yardstick of that process (the ratio auto/SDPA cancels most of the
drift between processes). Each cell is the median of `--repeats` timed calls after one
warm-up; the table gives, per row, the median over rounds of each tree's time, the
spread over rounds, and new/old, flagged where it leaves the spread of both.

    python benchmarks/ab.py OLD_SRC NEW_SRC                # S 1024 4096, 3 rounds
    python benchmarks/ab.py /tmp/old/src ../src --sizes 1024 --rounds 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def worker(args: argparse.Namespace) -> None:
    """Time every case with the attnkit found first on sys.path; one JSON line out."""
    import torch
    from bench import DTYPES, PATTERNS, make_case  # beside this file

    import attnkit as ak

    rows = []
    for dtype_name in args.dtypes:
        for S in args.sizes:
            for pattern in args.patterns or PATTERNS:
                case = make_case(pattern, S, DTYPES[dtype_name])
                mask = case.mask
                dense = mask.dense(case.B, 1, S, S) if isinstance(mask, ak.Mask) else mask
                for grad in (False, True):
                    rows.append(_row(case, mask, dense, grad, args.repeats))
    print(json.dumps({"torch": torch.__version__, "rows": rows}))


def _row(case: Any, mask: Any, dense: Any, grad: bool, repeats: int) -> dict[str, Any]:
    """One case's times: auto (forward, or forward and backward), SDPA's forward."""
    import torch.nn.functional as F
    from bench import inputs

    import attnkit as ak

    tensors = inputs(case, grad)
    auto = _seconds(lambda: ak.attention(*tensors, mask), grad, repeats)
    sdpa = None
    if not grad:
        sdpa = _seconds(
            lambda: F.scaled_dot_product_attention(*tensors, attn_mask=dense), False, repeats
        )
    return {
        "dtype": str(case.dtype).removeprefix("torch."),
        "S": case.S,
        "pattern": case.pattern,
        "pass": "fwd+bwd" if grad else "fwd",
        "auto": auto,
        "sdpa": sdpa,
        "backend": ak.explain(*tensors, mask).backend,
    }


def _seconds(fn: Callable[[], Any], grad: bool, repeats: int) -> float:
    """Median seconds of `repeats` calls (forward, or forward and backward) after one."""

    def once() -> None:
        out = fn()
        if grad:
            out.sum().backward()

    once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_tree(src: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{HERE}")
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--sizes",
        *map(str, args.sizes),
        "--dtypes",
        *args.dtypes,
        *(["--patterns", *args.patterns] if args.patterns else []),
        "--repeats",
        str(args.repeats),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    rows: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    return rows


def _ms(t: float, lo: float, hi: float) -> str:
    return f"{t * 1e3:.1f} ({lo * 1e3:.1f}-{hi * 1e3:.1f})"


def table(runs: dict[str, list[list[dict[str, Any]]]]) -> str:
    """One markdown row per case: each tree's median over rounds (ms), its spread, the
    auto/SDPA ratio of each, new/old, and a flag where new/old leaves both spreads."""
    head = (
        "| dtype | S | pattern | pass | backend old/new | old ms (spread) | new ms (spread) "
        "| old/SDPA | new/SDPA | new/old |\n" + "|---" * 10 + "|"
    )
    lines = [head]
    for i, row in enumerate(runs["old"][0]):
        cell = {}
        for tree in ("old", "new"):
            times = [r[i]["auto"] for r in runs[tree]]
            sdpa = [r[i]["sdpa"] for r in runs[tree] if r[i]["sdpa"] is not None]
            ratios = [r[i]["auto"] / r[i]["sdpa"] for r in runs[tree] if r[i]["sdpa"]]
            cell[tree] = (
                statistics.median(times),
                min(times),
                max(times),
                statistics.median(ratios) if sdpa else None,
            )
        (o, o_lo, o_hi, o_r), (n, n_lo, n_hi, n_r) = cell["old"], cell["new"]
        ratio = n / o
        outside = n_lo > o_hi or n_hi < o_lo
        r_old = "–" if o_r is None else f"{o_r:.2f}"
        r_new = "–" if n_r is None else f"{n_r:.2f}"
        backends = f"{runs['old'][0][i]['backend']}/{runs['new'][0][i]['backend']}"
        lines.append(
            f"| {row['dtype']} | {row['S']} | {row['pattern']} | {row['pass']} | {backends} "
            f"| {_ms(o, o_lo, o_hi)} | {_ms(n, n_lo, n_hi)} | {r_old} | {r_new} "
            f"| {ratio:.2f}{' **outside**' if outside else ''} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("old", type=Path, nargs="?", help="the old tree's src/ folder")
    parser.add_argument("new", type=Path, nargs="?", help="the new tree's src/ folder")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--patterns", nargs="+", help="bench.py's patterns (default: all)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per cell (median)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per tree, in turns")
    parser.add_argument("--out", type=Path, help="also write the JSON of every round here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.old is None or args.new is None:
        parser.error("give the old and the new tree's src/ folders")
    runs: dict[str, list[list[dict[str, Any]]]] = {"old": [], "new": []}
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for tree in order:
            start = time.perf_counter()
            runs[tree].append(run_tree(getattr(args, tree), args))
            took = time.perf_counter() - start
            print(f"round {r + 1}/{args.rounds}: {tree} in {took:.0f} s", file=sys.stderr)
    if args.out is not None:
        args.out.write_text(json.dumps(runs, indent=1))
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
