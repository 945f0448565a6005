"""Decoding many sequences of mixed lengths: a paged cache against the usual ways, in one run.

32 sequences with lengths drawn uniformly from 128 to 4096 each decode one token a
step (H=8 query heads sharing Hkv=2 K/V heads, D=64, one layer). Side by side:
- `padded sdpa`: one `F.scaled_dot_product_attention` over the batch padded to the
  longest sequence, with a padding mask (what a plain batch of KV caches does);
- `kvcache`: attnkit's attention over each sequence's own contiguous cache, one call
  per sequence (attnkit's `KVCache` per sequence);
- `paged`: `PagedKVCache.step` and `paged_attention` (writes the new keys and values,
  then attends), blocks of 16 tokens placed in shuffled order.
Reported: median time of a decode step, tokens/s, the ratio to padded SDPA, and the
memory each holds for the keys and values against the tokens stored, and the stored
keys and values over the step's time as a share of this machine's read bandwidth
(measured in the same run: sums over 512 MiB). float32 and
bfloat16. The machines these run on are shared and their memory bandwidth wanders
(the same paged step measured 16 to 33 ms in one session), so the whole comparison runs
`--trials` times on fresh caches: the ratio's range is over all trials.

The whole measurement runs in `--processes` fresh processes (4 by default): times here
differ from process to process, stable within one, so the table gives each process's
median step and the median over processes.

    python benchmarks/paged.py
    python benchmarks/paged.py --processes 0 --trials 2     # one process: a quick look
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench import cpu_description  # beside this file

import attnkit as ak
from attnkit.learn.benchmark import round_robin

H, HKV, D, BLOCK = 8, 2, 64, 16
RESULTS = Path(__file__).parent / "results"


def workload(dtype: torch.dtype, steps: int, B: int, longest: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(min(128, longest), longest + 1, (B,), generator=g).tolist()
    keys = [torch.randn(n, HKV, D, generator=g).to(dtype) for n in lengths]
    values = [torch.randn(n, HKV, D, generator=g).to(dtype) for n in lengths]
    q = torch.randn(B, H, D, generator=g).to(dtype)
    return {"lengths": lengths, "keys": keys, "values": values, "q": q, "steps": steps}


def padded(w: dict) -> tuple:  # type: ignore[type-arg]
    S, B = max(w["lengths"]), len(w["lengths"])
    k = torch.zeros(B, HKV, S, D, dtype=w["q"].dtype)
    v = torch.zeros_like(k)
    for b, (kb, vb) in enumerate(zip(w["keys"], w["values"], strict=True)):
        k[b, :, : len(kb)], v[b, :, : len(vb)] = kb.transpose(0, 1), vb.transpose(0, 1)
    mask = torch.arange(S)[None, :] < torch.tensor(w["lengths"])[:, None]  # (B, S)
    q = w["q"][:, :, None]  # (B, H, 1, D)

    def call() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None], enable_gqa=True)

    return call, 2 * k.numel() * k.element_size()


def per_sequence(w: dict) -> tuple:  # type: ignore[type-arg]
    caches = [
        (kb.transpose(0, 1)[None].contiguous(), vb.transpose(0, 1)[None].contiguous())
        for kb, vb in zip(w["keys"], w["values"], strict=True)
    ]
    qs = [w["q"][b][None, :, None] for b in range(len(w["lengths"]))]  # (1, H, 1, D) each
    mask = ak.causal(align="bottom_right")

    def call() -> None:
        for q, (k, v) in zip(qs, caches, strict=True):
            ak.attention(q, k, v, mask)

    return call, sum(2 * k.numel() * k.element_size() for k, _ in caches)


def paged(w: dict) -> tuple:  # type: ignore[type-arg]
    need = sum(-(-(n + w["steps"] + 8) // BLOCK) for n in w["lengths"])
    pages = ak.PagedKVCache(1, HKV, D, num_blocks=need, block_size=BLOCK, dtype=w["q"].dtype)
    random.Random(0).shuffle(pages._free)  # blocks of a sequence scattered over the pool
    B = len(w["lengths"])
    ids = [pages.add() for _ in range(B)]
    step = pages.step(ids, w["lengths"])
    pages.keys[0].index_copy_(0, step.slots, torch.cat(w["keys"]))  # the prompts' history
    pages.values[0].index_copy_(0, step.slots, torch.cat(w["values"]))
    new_k = torch.zeros(B, HKV, D, dtype=w["q"].dtype)

    def call() -> None:
        s = pages.step(ids, [1] * B)
        ak.paged_attention(w["q"], new_k, new_k, pages, s, 0)

    held = (pages.num_blocks - pages.free_blocks) * BLOCK * HKV * 2 * D * w["q"].element_size()
    return call, held


def measure(dtype: torch.dtype, args: argparse.Namespace) -> dict[str, object]:
    trials = []
    for _ in range(args.trials):  # each on fresh caches (a paged one fills as it decodes)
        w = workload(dtype, args.repeats + 2, args.sequences, args.longest)
        calls, memory = {}, {}
        for name, make in (("padded sdpa", padded), ("kvcache", per_sequence), ("paged", paged)):
            calls[name], memory[name] = make(w)
        trials.append(round_robin(calls, args.repeats))
    tokens = sum(w["lengths"])
    ratios = {name: sorted(t["padded sdpa"] / t[name] for t in trials) for name in calls}
    return {
        "dtype": str(dtype)[6:],
        "sequences": args.sequences,
        "longest": args.longest,
        "tokens_stored": tokens,
        "bytes_stored": tokens * HKV * 2 * D * w["q"].element_size(),
        "seconds": {name: statistics.median(t[name] for t in trials) for name in calls},
        "ratio_range": {name: (r[0], r[-1]) for name, r in ratios.items()},
        "trials": trials,
        "held_bytes": memory,
    }


def read_bandwidth(mib: int = 512, runs: int = 5) -> float:
    """Bytes per second this machine reads: the fastest of `runs` sums over `mib` MiB of
    float32 (all of torch's threads), beyond any cache."""
    x = torch.ones(mib * 2**20 // 4)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / min(times)


def combine(runs: list[list[dict]]) -> list[dict]:  # type: ignore[type-arg]
    """One row per dtype from the rows of several processes: the median over processes of
    each one's median step, each process's median, and the ratio's range over every trial."""
    rows = []
    for per_process in zip(*runs, strict=True):
        row = dict(per_process[0])
        peers = list(row["seconds"])
        row["process_seconds"] = {n: [r["seconds"][n] for r in per_process] for n in peers}
        row["seconds"] = {n: statistics.median(t) for n, t in row["process_seconds"].items()}
        row["trials"] = [t for r in per_process for t in r["trials"]]
        row["ratio_range"] = {
            n: (
                min(r["ratio_range"][n][0] for r in per_process),
                max(r["ratio_range"][n][1] for r in per_process),
            )
            for n in peers
        }
        rows.append(row)
    return rows


def in_processes(args: argparse.Namespace) -> list[dict]:  # type: ignore[type-arg]
    """`measure` in `args.processes` fresh processes, one after another (times here differ
    2-3x from process to process and hold within one: one process is half a result)."""
    runs = []
    for p in range(args.processes):
        with tempfile.TemporaryDirectory() as tmp:
            command = [
                sys.executable,
                __file__,
                "--processes",
                "0",
                "--repeats",
                str(args.repeats),
                "--trials",
                str(args.trials),
                "--sequences",
                str(args.sequences),
                "--longest",
                str(args.longest),
                "--out",
                tmp,
            ]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            runs.append(json.loads((Path(tmp) / "paged.json").read_text())["rows"])
        steps = ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in runs[-1][0]["seconds"].items())
        print(f"process {p + 1}/{args.processes} (float32): {steps}", flush=True)
    return combine(runs)


def markdown(cpu: dict, rows: list[dict]) -> str:  # type: ignore[type-arg]
    processes = len(rows[0].get("process_seconds", {}).get("padded sdpa", [0]))
    bandwidth = cpu.get("read_bytes_per_s")

    def share(rate: float) -> str:  # the history read once per step, over the bandwidth
        return f"{rate / 1e9:.1f} GB/s" + (f", {rate / bandwidth:.0%}" if bandwidth else "")

    units = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["features"].items())
    lines = [
        f"CPU: {cpu['model']} ({units}); {rows[0]['sequences']} sequences, lengths 128 to "
        f"{rows[0]['longest']}, H={H}, Hkv={HKV}, "
        f"D={D}, blocks of {BLOCK}; read bandwidth measured "
        f"{(bandwidth or 0) / 1e9:.1f} GB/s (sums over 512 MiB); step: the median over "
        f"{processes} process(es) of each "
        f"one's median decode step ({len(rows[0]['trials'])} trials in all); by process: "
        "each process's median.",
        "",
        "| dtype | peer | step (ms) | by process (ms) | tokens/s | × padded sdpa | "
        "range over trials | K/V held / stored | K/V stored / step (share of read bandwidth) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = r["seconds"]["padded sdpa"]
        for name, t in r["seconds"].items():
            held = r["held_bytes"][name] / r["bytes_stored"]
            low, high = r["ratio_range"][name]
            each = r.get("process_seconds", {name: [t]})[name]
            spread = ", ".join(f"{x * 1e3:.1f}" for x in each)
            lines.append(
                f"| {r['dtype']} | {name} | {t * 1e3:.2f} | {spread} | {r['sequences'] / t:.0f} | "
                f"{base / t:.2f} | {low:.2f}-{high:.2f} | {held:.2f} | "
                f"{share(r['bytes_stored'] / t)} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=30, help="decode steps a trial times")
    parser.add_argument("--trials", type=int, default=5, help="comparisons on fresh caches")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--longest", type=int, default=4096)
    parser.add_argument(
        "--processes", type=int, default=4, help="fresh processes, one after another (0: this)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    cpu = cpu_description()
    cpu["read_bytes_per_s"] = read_bandwidth()
    if args.processes > 0:
        rows = in_processes(args)
    else:
        rows = [measure(dtype, args) for dtype in (torch.float32, torch.bfloat16)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paged.json").write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))
    table = markdown(cpu, rows)
    (args.out / "paged.md").write_text(table)
    print(table)


if __name__ == "__main__":
    sys.exit(main())
