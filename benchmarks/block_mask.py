"""FlexAttention block masks: `Mask.to_block_mask` against `create_block_mask`, in one run.

For each mask (B=1, H=1, blocks of 128) and S in `--sizes`: the median time of
`mask.to_block_mask(1, 1, S, S)` and of FlexAttention's `create_block_mask` with the
mask's own `mask_mod` (it evaluates the predicate on all S² pairs), their ratio, and
whether both give the same present and full blocks. Every mask here has rows that each
see one key interval, so all take the span path: the structured kinds from their
fields, the banded bool tensor from its runs (read off the tensor in one pass, kept per
tensor object and version, so the first of the timed calls pays it).

    python benchmarks/block_mask.py
    python benchmarks/block_mask.py --sizes 4096 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench import cpu_description  # beside this file

import attnkit as ak
from attnkit.masks import as_mask, blocks

RESULTS = Path(__file__).parent / "results"


def masks(S: int) -> dict[str, ak.Mask]:
    ids = (torch.arange(S) // (S // 8))[None]  # 8 packed documents
    band = (torch.arange(S)[None] - torch.arange(S)[:, None]).abs() < 256
    return {
        "sliding window 256 (causal)": ak.sliding_window(256) & ak.causal(),
        "8 documents (causal)": ak.document(ids) & ak.causal(),
        "causal & padding": ak.causal() & ak.key_padding(torch.tensor([S * 3 // 4])),
        "causal": ak.causal(),
        "banded bool tensor": as_mask(band),
    }


def median_seconds(fn: Any, runs: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def same_blocks(a: Any, b: Any) -> bool:
    counts = [
        torch.equal(getattr(a, n), getattr(b, n)) for n in ("kv_num_blocks", "full_kv_num_blocks")
    ]
    used = torch.arange(a.kv_indices.shape[-1]) < a.kv_num_blocks[..., None]
    full = torch.arange(a.kv_indices.shape[-1]) < a.full_kv_num_blocks[..., None]
    return (
        all(counts)
        and torch.equal(a.kv_indices[used], b.kv_indices[used])
        and torch.equal(a.full_kv_indices[full], b.full_kv_indices[full])
    )


def row(name: str, mask: ak.Mask, S: int, runs: int) -> dict[str, Any]:
    from torch.nn.attention.flex_attention import create_block_mask

    mod = blocks.mask_mod(mask, 1, 1, S, S, torch.device("cpu"))
    ours, got = median_seconds(lambda: mask.to_block_mask(1, 1, S, S), runs)
    theirs, want = median_seconds(lambda: create_block_mask(mod, 1, 1, S, S, device="cpu"), runs)
    return {
        "mask": name,
        "S": S,
        "to_block_mask_ms": ours * 1e3,
        "create_block_mask_ms": theirs * 1e3,
        "ratio": theirs / ours,
        "same": same_blocks(got, want),
    }


def markdown(cpu: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    features = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["features"].items())
    lines = [
        f"CPU: {cpu['model']} ({features}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; medians.",
        "",
        "| mask | S | to_block_mask (ms) | create_block_mask (ms) | × faster | same blocks |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mask']} | {r['S']} | {r['to_block_mask_ms']:.1f} | "
            f"{r['create_block_mask_ms']:.0f} | {r['ratio']:.0f}× | "
            f"{'yes' if r['same'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for S in args.sizes:
        for name, mask in masks(S).items():
            rows.append(row(name, mask, S, args.runs))
            r = rows[-1]
            print(
                f"S={S:6d} {name:30s} ours {r['to_block_mask_ms']:9.1f} ms  "
                f"create_block_mask {r['create_block_mask_ms']:9.1f} ms  {r['ratio']:6.0f}×  "
                f"same {r['same']}",
                flush=True,
            )
    cpu = cpu_description()
    text = markdown(cpu, rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "block_mask.md").write_text(text)
    (args.out / "block_mask.json").write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))
    print(text)
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
