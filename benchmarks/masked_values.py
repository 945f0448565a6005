"""What keeping a non-finite key or value to the rows that see it costs an all-finite call.

Backends whose kernels multiply hidden weights by the values (`sdpa`, `tiled`, `flex`)
run after one check of K and V: a sum over the keys not every row sees (none for a
decoding step; a chunk of L new queries sums its last L - 1 keys). This times that check
beside the call it guards (`attention(..., backend="sdpa")`, prepared as a repeated call
is), round-robin, and reports its share of the call's time, per CPU kind:

    python benchmarks/masked_values.py     # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench import RESULTS, cpu_description  # beside this file

import attnkit as ak
from attnkit._compat import cpu_kind
from attnkit.call.visibility import all_finite, may_leak
from attnkit.contracts import normalize_call
from attnkit.learn.benchmark import round_robin

H, HKV, D = 8, 2, 64
# (name, B, L, S, mask): prefill, a chunk of new queries against a cache, a decoding step
CALLS = (
    ("prefill causal", 1, 1024, 1024, "causal"),
    ("prefill causal", 1, 4096, 4096, "causal"),
    ("prefill window 256", 1, 4096, 4096, "window"),
    ("chunk of 16, cache", 1, 16, 4096, "chunk"),
    ("chunk of 16, padded cache", 4, 16, 2048, "padded"),
    ("decoding step, padded cache", 4, 1, 2048, "padded"),
)


def mask_of(kind: str, B: int, S: int) -> ak.Mask:
    bottom = ak.causal(align="bottom_right")
    if kind == "causal":
        return ak.causal()
    if kind == "window":
        return ak.causal() & ak.sliding_window(255)
    if kind == "chunk":
        return bottom
    return bottom & ak.key_padding(torch.tensor([S - 37 * b for b in range(B)]))


def row(name: str, B: int, L: int, S: int, kind: str, dtype: torch.dtype, runs: int) -> dict:
    q = torch.randn(B, H, L, D, dtype=dtype)
    k, v = torch.randn(B, HKV, S, D, dtype=dtype), torch.randn(B, HKV, S, D, dtype=dtype)
    mask = mask_of(kind, B, S)
    keys = may_leak(normalize_call(q, k, v, mask))
    fns = {"call": lambda: ak.attention(q, k, v, mask, backend="sdpa")}
    if keys is not None:
        fns["check"] = lambda: all_finite(k, v, keys)
    with torch.no_grad():
        times = round_robin(fns, runs)
    checked = 0 if keys is None else (S if keys[0] >= keys[1] else S - (keys[1] - keys[0]))
    result = {"call": name, "dtype": str(dtype)[6:], "B": B, "L": L, "S": S}
    result["keys_checked"] = checked
    result["call_us"], result["check_us"] = times["call"] * 1e6, times.get("check", 0.0) * 1e6
    result["share"] = result["check_us"] / result["call_us"]
    check, call = result["check_us"], result["call_us"]
    print(f"{name} {result['dtype']}: check {check:.0f} µs of {call:.0f} µs", flush=True)
    return result


def markdown(meta: dict, rows: list[dict]) -> str:
    cpu = meta["cpu"]
    lines = [
        f"CPU kind: **{meta['kind']}** ({cpu['model']}; {meta['threads']} threads; torch "
        f"{meta['torch']}); H = {H}, Hkv = {HKV}, D = {D}; medians of {meta['runs']} "
        'round-robin runs; the call is `attention(..., backend="sdpa")` as a repeated '
        "call runs it, the check one sum over the keys not every row sees.",
        "",
        "| call | dtype | B | L | S | keys checked | call µs | check µs | share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['call']} | {r['dtype']} | {r['B']} | {r['L']} | {r['S']} | "
            f"{r['keys_checked']} | {r['call_us']:.0f} | {r['check_us']:.0f} | "
            f"{r['share']:.1%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=21, help="rounds, median (default: 21)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    meta = {"kind": cpu_kind(), "cpu": cpu_description(), "torch": torch.__version__}
    meta.update(threads=torch.get_num_threads(), runs=args.runs)
    rows = [
        row(name, B, L, S, kind, dtype, args.runs)
        for dtype in (torch.float32, torch.bfloat16)
        for name, B, L, S, kind in CALLS
    ]
    stem = args.out / f"masked_values_{meta['kind']}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = markdown(meta, rows)
    stem.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
