"""`make fuzz`: a long differential campaign against a float64 oracle, with a summary table.

    python tests/fuzz.py --cases 10000 --seed 0          # the campaign
    python tests/fuzz.py --seed 0 --case 1234            # one case again, in detail

Case `i` of seed `s` is always the same call (see fuzz_cases.RandomDraw). Exit status 1
if any backend gave a wrong result or crashed.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings

import torch

from fuzz_cases import RandomDraw, draw_case
from fuzz_check import Outcome, run_case


def campaign(cases: int, seed: int, flex_percent: int, every: int) -> int:
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    failures: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    start = time.monotonic()
    for index in range(cases):
        case = draw_case(RandomDraw(seed, index), flex_percent=flex_percent)
        for outcome in run_case(case):
            counts[outcome.backend, outcome.status] += 1
            if outcome.failed:
                failures[_failure_class(outcome)].append((index, str(case)))
        if (index + 1) % every == 0 or index + 1 == cases:
            bad = sum(len(v) for v in failures.values())
            print(
                f"  {index + 1}/{cases} cases, {bad} failures, {time.monotonic() - start:.0f} s",
                flush=True,
            )
    _table(counts, failures, cases, seed, time.monotonic() - start)
    return 1 if failures else 0


def _failure_class(o: Outcome) -> str:
    return f"{o.backend} {o.what} {o.status}: {o.detail.split(':')[0][:60]}"


def _table(
    counts: collections.Counter[tuple[str, str]],
    failures: dict[str, list[tuple[int, str]]],
    cases: int,
    seed: int,
    seconds: float,
) -> None:
    statuses = ("ok", "refused", "wrong", "crash")
    print(f"\nfuzz: {cases} cases, seed {seed}, {seconds:.0f} s, torch {torch.__version__}")
    print(f"| backend | runs | {' | '.join(statuses)} |")
    print(f"|---|---|{'---|' * len(statuses)}")
    for backend in sorted({b for b, _ in counts}):
        row = [counts[backend, s] for s in statuses]
        print(f"| {backend} | {sum(row)} | {' | '.join(map(str, row))} |")
    if not failures:
        print("\nno failures.")
        return
    print("\nfailure classes (count, first case: rerun with --case):")
    for name, hits in sorted(failures.items(), key=lambda item: -len(item[1])):
        print(f"  {len(hits):5d}  {name}\n         case {hits[0][0]}: {hits[0][1]}")


def replay(seed: int, index: int, flex_percent: int) -> int:
    case = draw_case(RandomDraw(seed, index), flex_percent=flex_percent)
    print(case)
    failed = 0
    for o in run_case(case):
        print(f"  {o.backend:9} {o.what:12} {o.status:8} {o.detail}")
        failed += o.failed
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", type=int, default=None, help="replay one case in detail")
    parser.add_argument("--flex", type=int, default=1, help="percent of cases also run on flex")
    parser.add_argument("--every", type=int, default=250, help="progress every N cases")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # flex's compile warnings would drown the table
    if args.case is not None:
        return replay(args.seed, args.case, args.flex)
    return campaign(args.cases, args.seed, args.flex, args.every)


if __name__ == "__main__":
    sys.exit(main())
