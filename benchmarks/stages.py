"""Where the native forward's thread-time goes, stage by stage, per product engine.

The kernels built with stage timers (`ATTNKIT_NATIVE=stages`: the build flag
ATTNKIT_STAGES, a build key of its own, built in the foreground when missing; this
script sets it) add each stage's thread-nanoseconds to a process total that the op
`stage_times` reads (`native/csrc/stages.h`). Each case runs once untimed, then
`--repeats` times between two reads, and each stage is given in thread-nanoseconds per
score (per query-key pair computed and head: the budget's unit), with the products'
GFLOP/s per thread, the unattributed rest of the work items and the threads' idle time.
Cases: dense, causal and GQA (H = 32, Hkv = 8), B = 1, H = 8, at each S and D, for each
engine this CPU has: `fp32` (float32 inputs), `convert` (bfloat16 converted to float32
block by block), `pairs` (bfloat16 on AVX512-BF16's pair dots) and `tiles` (bfloat16
on AMX's tiles). Results go to `results/stages_<kind>.{md,json}`.

    python benchmarks/stages.py                         # S = 1024 4096 16384, D = 64 128
    python benchmarks/stages.py --sizes 4096 --dims 64  # the budget's case alone
    python benchmarks/stages.py --table benchmarks/results/stages_avx2.json  # its table again
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["ATTNKIT_NATIVE"] = "stages"  # before attnkit reads it: the timed build

import torch
from bench import RESULTS, cpu_description

from attnkit import runtime
from attnkit._compat import cpu_features, cpu_kind
from attnkit.native import library, unavailable
from attnkit.native.ops import blocking, row_intervals, span_forward, stage_times

CASES = {"dense": (8, 8, False), "causal": (8, 8, True), "gqa": (32, 8, False)}  # H, Hkv, causal
STAGES = ("load_q", "pack_k", "pack_v", "finite", "scores", "softmax", "convert", "values")
STAGES += ("cut", "finish")
PRODUCTS = ("scores", "values")
# the budget for dense bfloat16, S = 4096, H = 8, D = 64, 2 threads (thread-ns per score)
BUDGET = {"softmax+convert": 0.15, "pack_k+pack_v": 0.03, "not products": 0.22}


def engines() -> dict[str, tuple[torch.dtype, str]]:
    """The engines this CPU has: name -> (input dtype, the runtime's half mode)."""
    units = cpu_features()
    found = {"fp32": (torch.float32, "float32"), "convert": (torch.bfloat16, "float32")}
    if units["AVX512-BF16"]:
        found["pairs"] = (torch.bfloat16, "native")
    if units["AMX"]:
        found["tiles"] = (torch.bfloat16, "amx")
    return found


def run_case(case: str, S: int, D: int, engine: str, repeats: int) -> dict[str, object]:
    """One case on one engine: its stage totals per score and per thread."""
    dtype, mode = engines()[engine]
    runtime.current().half.use(mode)
    H, Hkv, is_causal = CASES[case]
    g = torch.Generator().manual_seed(S + D)
    q = torch.randn(1, H, S, D, generator=g).to(dtype)
    k, v = (torch.randn(1, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    visible, pairs = None, S * S
    if is_causal:
        lo = torch.zeros(1, S, dtype=torch.long)
        visible, pairs = row_intervals(lo, torch.arange(1, S + 1)[None], 1, S, S), S * (S + 1) // 2
    half = runtime.current().half
    units, tiles = half.on_half_units(q, alibi=False), half.on_amx_tiles(q, alibi=False)

    def call() -> None:
        span_forward(
            q, k, v, visible, D**-0.5, 0.0, blocking(S, H // Hkv)[:2], half=units, amx=tiles
        )

    with torch.no_grad():
        call()
        stage_times(reset=True)
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        wall = (time.perf_counter() - start) / repeats
    times = {name: ns / repeats for name, ns in stage_times(reset=True).items()}
    scores = pairs * H  # query-key pairs computed per call, every head
    row: dict[str, object] = {"case": case, "S": S, "D": D, "engine": engine, "ms": wall * 1e3}
    row |= {f"{s}_ns": times.get(s, 0.0) / scores for s in STAGES}
    staged = sum(times.get(s, 0.0) for s in STAGES)
    row["rest_ns"] = (times["item"] - staged) / scores
    row["idle_ns"] = (times["threads"] - times["item"]) / scores
    row["total_ns"] = times["threads"] / scores
    for s in PRODUCTS:  # 2·D flops a score (Q·Kᵀ), 2·D a weight (P·V), per thread: whole
        # blocks' rates, so only where no block is cut (a cut block's products are `cut`'s)
        whole = times.get(s) and not times.get("cut")
        row[f"{s}_gflops"] = 2 * D * scores / times[s] if whole else None
    return row


def budget_lines(rows: list[dict[str, object]]) -> list[str]:
    """The budget's case (dense bfloat16, S = 4096, D = 64) on each bfloat16 engine."""
    lines = []
    for r in rows:
        if (r["case"], r["S"], r["D"]) != ("dense", 4096, 64) or r["engine"] == "fp32":
            continue
        got = {
            "softmax+convert": r["softmax_ns"] + r["convert_ns"],  # type: ignore[operator]
            "pack_k+pack_v": r["pack_k_ns"] + r["pack_v_ns"],  # type: ignore[operator]
            "not products": r["total_ns"] - r["scores_ns"] - r["values_ns"],  # type: ignore[operator]
        }
        parts = [f"{k} {v:.3f} (budget {BUDGET[k]})" for k, v in got.items()]
        lines.append(f"- {r['engine']}: " + "; ".join(parts))
    return lines


def markdown(result: dict[str, object]) -> str:
    cpu = result["cpu"]
    rows: list[dict[str, object]] = result["rows"]  # type: ignore[assignment]
    lines = [
        f"CPU kind: **{result['kind']}** ({cpu['model']}; {result['threads']} threads; "  # type: ignore[index]
        f"torch {result['torch']}). Native forward, B = 1, H = 8 (GQA: H = 32, Hkv = 8): "
        "thread-nanoseconds per score (query-key pair computed, per head) of each stage; "
        "GFLOP/s of the products per thread (where no block is cut); rest = the work items' "
        "time outside every stage; idle = the threads' time outside the work items.",
        "",
        "| case | S | D | engine | ms | load_q | pack_k | pack_v | finite | scores | softmax "
        "| convert | values | cut | finish | rest | idle | total | scores GFLOP/s "
        "| values GFLOP/s |",
        "|---|---|---|---|---|" + "---|" * 15,
    ]
    for r in rows:
        stages = " | ".join(f"{r[f'{s}_ns']:.3f}" for s in (*STAGES, "rest", "idle", "total"))
        rates = " | ".join(f"{r[f'{s}_gflops']:.0f}" if r[f"{s}_gflops"] else "" for s in PRODUCTS)
        lines.append(
            f"| {r['case']} | {r['S']} | {r['D']} | {r['engine']} | {r['ms']:.1f} | {stages} "
            f"| {rates} |"
        )
    budget = budget_lines(rows)
    if budget:
        lines += [
            "",
            "The budget (dense bfloat16, S = 4096, D = 64; thread-ns per score):",
            *budget,
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--engines", nargs="+", default=None, help="default: every one here")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--table", type=Path, help="only write the table of a kept JSON again")
    args = parser.parse_args()
    if args.table is not None:
        args.table.with_suffix(".md").write_text(markdown(json.loads(args.table.read_text())))
        return
    if (reason := unavailable()) is not None:
        sys.exit(f"the native kernels are unavailable: {reason}")
    library()
    if not stage_times():
        sys.exit("these kernels were built without stage timers (ATTNKIT_NATIVE=stages)")
    rows = []
    for S in args.sizes:
        for D in args.dims:
            for case in args.cases:
                for engine in args.engines or engines():
                    rows.append(run_case(case, S, D, engine, args.repeats))
                    print(f"stages: {case} S={S} D={D} {engine}", file=sys.stderr, flush=True)
    result = {
        "kind": cpu_kind(),
        "cpu": cpu_description(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"stages_{result['kind']}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (args.out / f"stages_{result['kind']}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
