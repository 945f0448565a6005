"""`make fuzz`: a long differential campaign against a float64 oracle, on every surface,
with a summary table per surface.

    python tests/fuzz.py --cases 10000 --seed 0                  # every surface
    python tests/fuzz.py --cases 500 --surface distributed       # one surface
    python tests/fuzz.py --seed 0 --case 1234                    # one core case again
    python tests/fuzz.py --seed 0 --case 17 --surface paged      # one case of a surface

Surfaces: `core` (`attention`, `attention_with_lse`, `attention_probs`, `explain` on every
backend: tests/fuzz_check.py), `native` (the core cases on attnkit's own C++ kernels
alone: a case they refuse counts as refused), `half` (the core cases in bfloat16 on
those kernels with half computed natively: the half units' products, and AMX's tiles
where the CPU has them), `distributed` (`attnkit.distributed` in 2-4 gloo
processes: tests/fuzz_distributed.py), `paged` (`PagedKVCache` + `paged_attention`
programs: tests/fuzz_paged.py), `transformers` (the mask bridge against transformers'
own masks: tests/fuzz_transformers.py), `dropins` (`attnkit.sdpa` against torch's SDPA,
`attnkit.varlen_attn` against its documented formula: tests/fuzz_dropins.py). Case `i`
of seed `s` of a surface is always the same (see fuzz_cases.RandomDraw). Exit status 1
if anything was wrong or crashed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

import fuzz_distributed
import fuzz_dropins
import fuzz_paged
import fuzz_transformers
from attnkit import runtime
from attnkit._compat import cpu_features
from fuzz_cases import Draw, RandomDraw, draw_case
from fuzz_check import Outcome, run_case

SURFACES = ("core", "native", "half", "distributed", "paged", "transformers", "dropins")
Results = Iterator[tuple[int, str, list[Outcome]]]


def _core(seed: int, indices: Iterable[int], flex_percent: int) -> Results:
    for index in indices:
        case = draw_case(RandomDraw(seed, index), flex_percent=flex_percent)
        yield index, str(case), run_case(case)


def _native(seed: int, indices: Iterable[int], flex_percent: int) -> Results:
    """The core cases on attnkit's own kernels alone (`core` runs them among the rest)."""
    for index in indices:
        case = draw_case(RandomDraw(seed, index), flex_percent=0)
        yield index, str(case), run_case(case, only=("native",))


def _half(seed: int, indices: Iterable[int], flex_percent: int) -> Results:
    """The core cases in bfloat16 on attnkit's own kernels, half computed natively: each
    case in mode "native" (the half units' products where built) and, on a CPU with AMX,
    "amx" (whole blocks on the tiles), counted as native/<mode>."""
    modes = ("native", "amx") if cpu_features()["AMX"] else ("native",)
    half = runtime.current().half
    before = half.mode
    try:
        for index in indices:
            case = draw_case(RandomDraw(seed, index), flex_percent=0)
            case = dataclasses.replace(case, dtype=torch.bfloat16)
            outcomes = []
            for mode in modes:
                half.use(mode)
                for outcome in run_case(case, only=("native",)):
                    outcomes.append(dataclasses.replace(outcome, backend=f"native/{mode}"))
            yield index, str(case), outcomes
    finally:
        half.use(before)


def _programs(name: str, program: Callable[[Draw], str]) -> Callable[..., Results]:
    """A surface whose case is one call of `program`: ok, wrong (AssertionError) or crash."""

    def run(seed: int, indices: Iterable[int], flex_percent: int) -> Results:
        for index in indices:
            try:
                text, outcome = program(RandomDraw(seed, index)), Outcome(name, "run", "ok")
            except AssertionError as err:
                text, outcome = f"case {index}", Outcome(name, "run", "wrong", str(err)[:300])
            except Exception as err:
                detail = f"{type(err).__name__}: {str(err)[:300]}"
                text, outcome = f"case {index}", Outcome(name, "run", "crash", detail)
            yield index, text, [outcome]

    return run


def _distributed(seed: int, indices: Iterable[int], flex_percent: int) -> Results:
    with tempfile.TemporaryDirectory() as workdir:
        yield from fuzz_distributed.run(seed, list(indices), Path(workdir))


RUNNERS: dict[str, Callable[..., Results]] = {
    "core": _core,
    "native": _native,
    "half": _half,
    "distributed": _distributed,
    "paged": _programs("paged", fuzz_paged.program),
    "transformers": _programs("transformers", fuzz_transformers.check),
    "dropins": _programs("dropins", fuzz_dropins.check),
}


def campaign(cases: int, seed: int, flex_percent: int, every: int, surfaces: list[str]) -> int:
    status = 0
    for surface in surfaces:
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        failures: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
        start = time.monotonic()
        print(f"{surface}:", flush=True)
        results = RUNNERS[surface](seed, range(cases), flex_percent)
        for done, (index, text, outcomes) in enumerate(results, 1):
            for outcome in outcomes:
                counts[outcome.backend, outcome.status] += 1
                if outcome.failed:
                    failures[_failure_class(outcome)].append((index, text))
            if done % every == 0 or done == cases:
                bad = sum(len(v) for v in failures.values())
                print(
                    f"  {done}/{cases} cases, {bad} failures, {time.monotonic() - start:.0f} s",
                    flush=True,
                )
        _table(surface, counts, failures, cases, seed, time.monotonic() - start)
        status |= bool(failures)
    return status


def _failure_class(o: Outcome) -> str:
    return f"{o.backend} {o.what} {o.status}: {o.detail.split(':')[0][:60]}"


def _table(
    surface: str,
    counts: collections.Counter[tuple[str, str]],
    failures: dict[str, list[tuple[int, str]]],
    cases: int,
    seed: int,
    seconds: float,
) -> None:
    statuses = ("ok", "refused", "wrong", "crash")
    print(
        f"\nfuzz {surface}: {cases} cases, seed {seed}, {seconds:.0f} s, torch {torch.__version__}"
    )
    print(f"| {'backend' if surface == 'core' else 'runs of'} | runs | {' | '.join(statuses)} |")
    print(f"|---|---|{'---|' * len(statuses)}")
    for backend in sorted({b for b, _ in counts}):
        row = [counts[backend, s] for s in statuses]
        print(f"| {backend} | {sum(row)} | {' | '.join(map(str, row))} |")
    if not failures:
        print("\nno failures.\n")
        return
    print(f"\nfailure classes (count, first case: rerun with --surface {surface} --case):")
    for name, hits in sorted(failures.items(), key=lambda item: -len(item[1])):
        print(f"  {len(hits):5d}  {name}\n         case {hits[0][0]}: {hits[0][1]}")
    print()


def replay(seed: int, index: int, flex_percent: int, surface: str) -> int:
    failed = 0
    for _, text, outcomes in RUNNERS[surface](seed, [index], flex_percent):
        print(text)
        for o in outcomes:
            print(f"  {o.backend:9} {o.what:12} {o.status:8} {o.detail}")
            failed += o.failed
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=10_000, help="cases per surface")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", type=int, default=None, help="replay one case in detail")
    parser.add_argument(
        "--surface",
        choices=(*SURFACES, "all"),
        default=None,
        help="one surface (default: all; core for --case)",
    )
    parser.add_argument("--flex", type=int, default=1, help="percent of cases also run on flex")
    parser.add_argument("--every", type=int, default=250, help="progress every N cases")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # flex's compile warnings would drown the table
    if args.case is not None:
        return replay(args.seed, args.case, args.flex, args.surface or "core")
    surfaces = list(SURFACES) if args.surface in (None, "all") else [args.surface]
    return campaign(args.cases, args.seed, args.flex, args.every, surfaces)


if __name__ == "__main__":
    sys.exit(main())
