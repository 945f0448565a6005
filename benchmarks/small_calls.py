"""Small calls side by side: one decoding step against a cache, attnkit vs the plain call.

The decode grid: B in {1, 4, 8, 32}, S in {512, 2048, 8192}, H=8, Hkv=2, D=64, one
query per row, float32, without padding (`causal(align="bottom_right")` against SDPA
unmasked) and with padding (`& key_padding(lengths)`, lengths drawn in [S/2, S], against
SDPA with the same bool mask). Round-robin medians (`timing.round_robin`) of `--runs`
calls each, under `torch.no_grad()` as generation runs; the ratio is SDPA's time over
attnkit's (>= 1: attnkit at least as fast); `overhead` is attnkit's time minus SDPA's, in
microseconds (the planning and checks a call pays beyond the kernel).

    python benchmarks/small_calls.py                       # the grid, a few minutes
    python benchmarks/small_calls.py --batches 1 --sizes 512 --runs 50
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench import cpu_description  # beside this file
from timing import round_robin

import attnkit as ak

H, HKV, D = 8, 2, 64
RESULTS = Path(__file__).parent / "results"


def decode_row(B: int, S: int, padded: bool, runs: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(B * 100003 + S)
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, HKV, S, D, generator=g), torch.randn(B, HKV, S, D, generator=g)
    mask = ak.causal(align="bottom_right")
    bool_mask = None
    if padded:
        lengths = torch.randint(S // 2, S + 1, (B,), generator=g)
        mask = mask & ak.key_padding(lengths)
        bool_mask = (torch.arange(S)[None] < lengths[:, None])[:, None, None, :]  # (B,1,1,S)
    with torch.no_grad():
        times = round_robin(
            {
                "sdpa": lambda: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=bool_mask, enable_gqa=True
                ),
                "attnkit": lambda: ak.attention(q, k, v, mask),
            },
            runs,
        )
    return {
        "B": B, "S": S, "padding": padded, "sdpa_us": times["sdpa"] * 1e6,
        "attnkit_us": times["attnkit"] * 1e6, "ratio": times["sdpa"] / times["attnkit"],
        "overhead_us": (times["attnkit"] - times["sdpa"]) * 1e6,
    }  # fmt: skip


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    cpu = meta["cpu"]
    features = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["features"].items())
    lines = [
        f"CPU: {cpu['model']} ({features}); torch {meta['torch']}, {meta['threads']} threads; "
        f"decode step H={H}, Hkv={HKV}, D={D}, L=1, float32, median of {meta['runs']} "
        "round-robin calls.",
        "",
        "| B | S | padding | SDPA (µs) | attnkit (µs) | × SDPA | overhead (µs) |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['B']} | {r['S']} | {'yes' if r['padding'] else 'no'} | {r['sdpa_us']:.0f} | "
        f"{r['attnkit_us']:.0f} | {r['ratio']:.2f} | {r['overhead_us']:.0f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    meta = {"cpu": cpu_description(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "runs": args.runs}  # fmt: skip
    rows = []
    for B in args.batches:
        for S in args.sizes:
            for padded in (False, True):
                rows.append(decode_row(B, S, padded, args.runs))
                r = rows[-1]
                line = f"B={B:>2} S={S:>5} padding={padded!s:<5} SDPA {r['sdpa_us']:8.0f} µs"
                print(f"{line}  attnkit {r['attnkit_us']:8.0f} µs  {r['ratio']:.2f}×", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "small_calls.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = markdown(meta, rows)
    (args.out / "small_calls.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
