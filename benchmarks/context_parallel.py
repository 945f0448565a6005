"""Context parallelism side by side: each strategy at world sizes 1, 2 and 4, in one run.

For S in 16384 and 65536, the masks causal (zigzag layout), sliding window (256 keys)
and packed documents (8, shard-aligned at P = 2 and 4; both contiguous), forward and
forward+backward, every strategy (ring, allgather, ulysses) at each world size (gloo on
127.0.0.1; one process with every core at world 1, one thread a process above it:
world 4 oversubscribes a 2-core machine, which shows the shape of the curve rather than
a speed-up). Reported per cell: the median time of the slowest rank, the time the
ranks take to agree before any traffic (validation, fingerprints and one all_gather:
median of 20, part of the call's time), the speed-up over
`attnkit.attention` in one process (`single`), the bytes each rank sends (the plan's
forward figure; the backward sends K/V again and their gradients back), the peak extra
resident memory of the busiest rank, and the share of the float32 matrix-multiply
roofline (measured in the same run, per core, times the cores in use). Results go to
`results/context_parallel_<kind>.{md,json}`: one table per kind of CPU measured.

    python benchmarks/context_parallel.py                              # about an hour on 2 cores
    python benchmarks/context_parallel.py --sizes 16384 --worlds 1 2   # a quick look
    python benchmarks/context_parallel.py --sizes 16384 --worlds 1 2 --patterns \
        causal sliding --repeats 1 --out benchmarks/results/s16384
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench import _vm, cpu_description, roofline_gflops  # beside this file

import attnkit as ak
import attnkit.distributed as akd
from attnkit._compat import cpu_kind
from attnkit.distributed import comm
from attnkit.distributed.api import agreed

B, H, HKV, D = 1, 4, 4, 64
PATTERNS = ("causal", "sliding", "documents")
PASSES = ("fwd", "fwd+bwd")
RESULTS = Path(__file__).parent / "results"
LONG_CALL = 20.0  # seconds: a call this long is timed once
AGREE_REPEATS = 20


def layout_for(pattern: str) -> str:
    """zigzag balances causal work; a window or shard-sized documents keep to neighbours
    (or to themselves) only when each rank holds one contiguous run of rows."""
    return "zigzag" if pattern == "causal" else "contiguous"


def make_mask(pattern: str, S: int) -> ak.Mask:
    if pattern == "causal":
        return ak.causal()
    if pattern == "sliding":
        return ak.sliding_window(255)
    ids = (torch.arange(S) * 8 // S)[None]  # 8 documents of S/8 tokens
    return ak.document(ids) & ak.causal()


def flops(pattern: str, S: int, grad: bool) -> float:
    """Useful FLOPs (allowed pairs only; backward 2.5× the forward: flash's convention)."""
    q = torch.empty(B, H, S, D)
    plan = ak.explain(q, q[:, :HKV], q[:, :HKV], make_mask(pattern, S))
    return plan.flops * (3.5 if grad else 1.0)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads((os.cpu_count() or 1) if world == 1 else 1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(hours=2),
    )
    rows = []
    for S in args.sizes:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (H, HKV, HKV))
        for pattern in args.patterns:
            mask, layout = make_mask(pattern, S), layout_for(pattern)
            local = [akd.shard(t, layout) for t in (q, k, v)]
            for grad in (False, True):
                for strategy in ("single",) * (world == 1) + akd.STRATEGIES:
                    cell = _cell(world, local, mask, layout, grad, strategy, args)
                    rows.append({"S": S, "pattern": pattern, "layout": layout, **cell})
                    if rank == 0:
                        print(_line(rows[-1]), flush=True)
    if rank == 0:
        out.extend(rows)
    dist.destroy_process_group()


def _cell(world, local, mask, layout, grad, strategy, args) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    single = strategy == "single"  # plain attnkit.attention in one process: the baseline
    plan = akd.explain(*local, mask, layout=layout, strategy="ring" if single else strategy)
    tensors = [t.detach().requires_grad_(grad) for t in local]

    def call() -> None:
        if single:
            out = ak.attention(*tensors, mask)
        else:
            out = akd.attention(*tensors, mask, layout=layout, strategy=strategy)
        if grad:
            out.sum().backward()

    agree = (
        []
        if single
        else [_agreement(tensors, mask, layout, strategy) for _ in range(AGREE_REPEATS)]
    )
    times = []
    for i in range(args.repeats + 1):
        dist.barrier()
        before = _vm("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
        start = time.perf_counter()
        call()
        took = torch.tensor([time.perf_counter() - start, _vm("VmHWM") - before])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank, the busiest rank
        if i == 0:
            peak = int(took[1])
            if took[0] > LONG_CALL:  # the warm-up call is the measurement
                times.append(float(took[0]))
                break
            continue
        times.append(float(took[0]))
    return {
        "world": world,
        "pass": "fwd+bwd" if grad else "fwd",
        "strategy": strategy,
        "seconds": statistics.median(times),
        "runs": len(times),
        "bytes_sent": 0 if single else plan.bytes_sent[strategy],
        "peak_extra_bytes": peak,
        "skipped": plan.skipped,
        "agree_seconds": statistics.median(agree) if agree else 0.0,
    }


def _agreement(tensors, mask, layout, strategy) -> float:  # type: ignore[no-untyped-def]
    """Seconds the ranks take to agree on a call (the slowest rank's)."""
    dist.barrier()
    start = time.perf_counter()
    agreed(*tensors, mask, comm.group_of(None), layout, strategy, None, None)
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _line(r: dict[str, Any]) -> str:
    return (
        f"P={r['world']} S={r['S']:>6} {r['pattern']:<9} {r['layout']:<10} {r['pass']:<7} "
        f"{r['strategy']:<9} "
        f"{r['seconds']:8.3f} s  agree {r.get('agree_seconds', 0) * 1e3:6.2f} ms  "
        f"sent {r['bytes_sent'] / 2**20:8.1f} MiB  "
        f"peak {r['peak_extra_bytes'] / 2**20:8.1f} MiB"
    )


def run_world(world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    with mp.Manager() as manager:
        rows = manager.list()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(world, port, args, rows), nprocs=world)
        return list(rows)


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    one = {
        (r["S"], r["pattern"], r["pass"]): r["seconds"]
        for r in rows
        if r["world"] == 1 and r["strategy"] == "single"  # attnkit.attention, one process
    }
    lines = [
        f"CPU kind: **{meta.get('kind', 'avx2')}** ({meta['cpu']['model']}, {meta['cores']} "
        "cores); float32 matmul roofline "
        f"{meta['roofline_gflops_per_core']:.1f} GFLOP/s per core; B={B}, H={H}, Hkv={HKV}, "
        f"D={D}, float32, causal on the zigzag layout, the others contiguous; median of "
        f"{meta['repeats']} runs (calls over {LONG_CALL:.0f} s: one).",
        "",
        "| S | mask | pass | P | strategy | time (s) | agree (ms) | × one process "
        "| sent per rank (MiB) | peak per rank (MiB) | % roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = one.get((r["S"], r["pattern"], r["pass"]))
        speedup = f"{base / r['seconds']:.2f}" if base else "-"
        cores = min(r["world"], meta["cores"]) if r["world"] > 1 else meta["cores"]
        useful = flops(r["pattern"], r["S"], r["pass"] == "fwd+bwd") / r["seconds"] / 1e9
        share = useful / (meta["roofline_gflops_per_core"] * cores)
        lines.append(
            f"| {r['S']} | {r['pattern']} | {r['pass']} | {r['world']} | {r['strategy']} | "
            f"{r['seconds']:.3f} | {r.get('agree_seconds', 0) * 1e3:.2f} | {speedup} | "
            f"{r['bytes_sent'] / 2**20:.1f} | "
            f"{r['peak_extra_bytes'] / 2**20:.0f} | {share:.0%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--patterns", nargs="+", choices=PATTERNS, default=list(PATTERNS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    cpu = cpu_description()
    torch.set_num_threads(1)
    meta = {
        "cpu": cpu,
        "kind": cpu_kind(),
        "cores": os.cpu_count() or 1,
        "repeats": args.repeats,
        "roofline_gflops_per_core": roofline_gflops(3),
        "torch": torch.__version__,
    }
    units = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["features"].items())  # type: ignore[attr-defined]
    print(
        f"CPU {cpu['model']}: {units}; "
        f"roofline {meta['roofline_gflops_per_core']:.1f} GFLOP/s a core"
    )
    rows: list[dict[str, Any]] = []
    for world in args.worlds:
        rows.extend(run_world(world, args))
    args.out.mkdir(parents=True, exist_ok=True)
    kept = args.out / f"context_parallel_{meta['kind']}"
    kept.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = markdown(meta, rows)
    kept.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    sys.exit(main())
