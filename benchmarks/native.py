"""attnkit's native kernels side by side with their peers, in one run, per CPU kind.

Forward passes (B = 1, or 4 for padding; H = 8, D = 64) of every mask pattern of
`bench.py` in float32 and bfloat16 (and float16: `--dtypes`) at each S: SDPA
(`is_causal` where it applies, else the dense bool mask), FlexAttention compiled
(compile time apart), the composed `tiled` backend, `native` and `auto`. For each it
reports the median time (round-robin), and for native its time per visible pair against
dense SDPA's per pair (`per pair`), its ratio to the best peer, and its share of the
matrix-multiply roofline measured in the same run (useful work 4·pairs·D per head). Then
forward+backward of the same patterns (the output's gradient all ones): SDPA, tiled,
native and auto against dense SDPA's forward+backward per pair (useful work 3.5× the
forward's, flash-attention's convention; FlexAttention has no backward on the CPU). Then
the decoding grid (L = 1, H = 8, Hkv = 2, float32 and bfloat16; B × S, every sequence
full or padded to lengths from S/2 to S; and Hkv = 8, float32, full): SDPA (a bool
padding mask where padded) against attnkit's `auto` and `native`; and the time a fresh
process takes to load the built kernels. Results go to
`results/native_<kind>.{md,json}`: one table per kind of CPU measured.

    python benchmarks/native.py                        # S = 1024 4096
    python benchmarks/native.py --sizes 1024 --no-flex --repeats 3   # a quick look
    python benchmarks/native.py --decode-only     # the decoding grid again, same table
    python benchmarks/native.py --train-only      # forward+backward again, same table
    python benchmarks/native.py --forward-only --half amx --dtypes bfloat16 float16
    python benchmarks/native.py --sizes 16384 --patterns causal sliding documents \
        --no-decode --out results/s16384
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from bench import (  # beside this file
    DTYPES,
    RESULTS,
    Peers,
    cpu_description,
    inputs,
    make_case,
    peer_recompile_limit,
    repeats_for,
    roofline_gflops,
    time_peers,
)

import attnkit as ak
from attnkit import runtime
from attnkit._compat import cpu_kind, half_matmul_is_fast
from attnkit.call.precision import MODES
from attnkit.learn.benchmark import round_robin
from attnkit.native import unavailable

H, D = 8, 64
KINDS = {**DTYPES, "float16": torch.float16}  # float16 rows where asked (`--dtypes`)
PATTERNS = ("none", "causal", "sliding", "documents", "padding", "prefix")
DECODE_B = (1, 4, 8, 32)
DECODE_S = (512, 2048, 8192)


def kernel_row(pattern: str, S: int, dtype: str, repeats: int, flex: bool) -> dict[str, object]:
    case = make_case(pattern, S, KINDS[dtype])
    peers = Peers(case)
    q, k, v = inputs(case, grad=False)
    fns: dict[str, Callable[[], object]] = {}
    sdpa = peers.call("sdpa", grad=False)
    assert not isinstance(sdpa, str)
    fns["sdpa"] = lambda: sdpa(q, k, v)
    fns["dense sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v)
    if flex:
        compiled = peers.call("flex", grad=False)
        if not isinstance(compiled, str):
            fns["flex"] = lambda: compiled(q, k, v)
    for backend in ("tiled", "native", "auto"):
        name = backend if backend != "auto" else "auto"
        fns[name] = lambda b=backend: ak.attention(q, k, v, case.mask, backend=b)
    with torch.no_grad():
        medians = round_robin(fns, repeats)
    dense_pair = medians.pop("dense sdpa") / (case.B * S * S)
    native = medians["native"]
    best_peer = min(t for n, t in medians.items() if n in ("sdpa", "flex", "tiled"))
    row: dict[str, object] = {
        "pattern": pattern,
        "S": S,
        "dtype": dtype,
        "pairs": case.pairs,
        **{f"{n}_ms": t * 1e3 for n, t in medians.items()},
        "per_pair": dense_pair * case.pairs / native,
        "vs_best_peer": best_peer / native,
        "gflops": 4 * case.pairs * H * D / native / 1e9,
        "compile_s": peers.compile_s,
        "auto": ak.explain(q, k, v, case.mask).backend,
    }
    print(
        f"{dtype} {pattern} S={S}: native {native * 1e3:.1f} ms, per pair "
        f"{row['per_pair']:.2f} of dense SDPA, {row['vs_best_peer']:.2f}× the best peer",
        file=sys.stderr,
        flush=True,
    )
    return row


def train_row(pattern: str, S: int, dtype: str, repeats: int) -> dict[str, object]:
    """Forward+backward of one pattern: SDPA, tiled, native, auto and dense SDPA."""
    case = make_case(pattern, S, KINDS[dtype])
    sdpa = Peers(case).call("sdpa", grad=True)
    assert not isinstance(sdpa, str)
    fns: dict[str, Callable[..., torch.Tensor]] = {"sdpa": sdpa}
    fns["dense sdpa"] = F.scaled_dot_product_attention
    for backend in ("tiled", "native", "auto"):
        fns[backend] = lambda q, k, v, b=backend: ak.attention(q, k, v, case.mask, backend=b)
    long = S >= 16384  # calls of seconds: no warm-up round, fewer runs
    medians = time_peers(fns, case, True, repeats_for(S, repeats), warmup=not long)
    dense_pair = medians.pop("dense sdpa") / (case.B * S * S)
    native = medians["native"]
    best_peer = min(medians["sdpa"], medians["tiled"])
    row: dict[str, object] = {
        "pattern": pattern,
        "S": S,
        "dtype": dtype,
        "pairs": case.pairs,
        **{f"{n}_ms": t * 1e3 for n, t in medians.items()},
        "per_pair": dense_pair * case.pairs / native,
        "vs_best_peer": best_peer / native,
        "gflops": 3.5 * 4 * case.pairs * H * D / native / 1e9,
        "auto": ak.explain(*inputs(case, grad=True), case.mask).backend,
    }
    print(
        f"{dtype} {pattern} S={S} fwd+bwd: native {native * 1e3:.1f} ms, per pair "
        f"{row['per_pair']:.2f} of dense SDPA, {row['vs_best_peer']:.2f}× the best peer",
        file=sys.stderr,
        flush=True,
    )
    return row


def decode_rows(repeats: int) -> list[dict[str, object]]:
    """GQA (Hkv = 2) in both dtypes, full and padded; MHA (Hkv = H) float32, full."""
    grid = [(*c, 2) for c in itertools.product(DTYPES, (False, True), DECODE_B, DECODE_S)]
    grid += [("float32", False, B, S, H) for B, S in itertools.product(DECODE_B, DECODE_S)]
    return [decode_row(dtype, padded, B, S, Hkv, repeats) for dtype, padded, B, S, Hkv in grid]


def decode_row(
    dtype: str, padded: bool, B: int, S: int, Hkv: int, repeats: int
) -> dict[str, object]:
    g = torch.Generator().manual_seed(S + B)
    q = torch.randn(B, H, 1, D, generator=g).to(KINDS[dtype])
    k, v = (torch.randn(B, Hkv, S, D, generator=g).to(KINDS[dtype]) for _ in range(2))
    lengths = torch.randint(S // 2, S + 1, (B,), generator=g) if padded else None
    mask = ak.causal(align="bottom_right")
    attn_mask = None
    if lengths is not None:
        mask = mask & ak.key_padding(lengths)
        attn_mask = (torch.arange(S)[None] < lengths[:, None])[:, None, None]
    fns = {
        "sdpa": lambda q=q, k=k, v=v, m=attn_mask: F.scaled_dot_product_attention(
            q, k, v, attn_mask=m, enable_gqa=True
        ),
        "auto": lambda q=q, k=k, v=v, m=mask: ak.attention(q, k, v, m),
        "native": lambda q=q, k=k, v=v, m=mask: ak.attention(q, k, v, m, backend="native"),
    }
    with torch.no_grad():
        us = {n: t * 1e6 for n, t in round_robin(fns, 20 * repeats).items()}
    row = {"dtype": dtype, "padded": padded, "B": B, "S": S, "Hkv": Hkv}
    row.update({f"{n}_us": t for n, t in us.items()})
    row["auto_ratio"] = us["sdpa"] / us["auto"]
    row["native_ratio"] = us["sdpa"] / us["native"]
    print(
        f"decode {dtype} B={B} S={S} Hkv={Hkv} padded={padded}: SDPA {us['sdpa']:.0f} µs, auto "
        f"{us['auto']:.0f}, native {us['native']:.0f}",
        file=sys.stderr,
        flush=True,
    )
    return row


def load_seconds(runs: int = 5) -> float:
    """The median time a fresh process spends making the built kernels usable."""
    code = (
        "import time, attnkit.native as b; t = time.perf_counter(); b.library(); "
        "print(time.perf_counter() - t)"
    )
    command = [sys.executable, "-c", code]
    times = [
        float(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
        for _ in range(runs)
    ]
    return sorted(times)[runs // 2]


def half_units() -> bool:
    """Whether this process's kernels multiply bfloat16 on the CPU's half units: the CPU
    has them, and the runtime's half kernels run bfloat16 natively."""
    q = torch.empty(0, dtype=torch.bfloat16)
    return half_matmul_is_fast(q.dtype, "cpu") and runtime.current().half.on_half_units(
        q, alibi=False
    )


def roofline_of(result: dict[str, object], dtype: str) -> float:
    """The matrix-product roofline of the dtype the kernel multiplies a row's inputs in."""
    half = dtype == "bfloat16" and result.get("half_units")
    return float(result["roofline_bf16" if half else "roofline_fp32"])  # type: ignore[arg-type]


def markdown(result: dict[str, object]) -> str:
    cpu = result["cpu"]
    lines = [
        f"CPU kind: **{result['kind']}** ({cpu['model']}; {result['threads']} threads; "  # type: ignore[index]
        f"torch {result['torch']}); fp32 roofline {result['roofline_fp32']:.0f} GFLOP/s, "
        f"bf16 {result['roofline_bf16']:.0f} GFLOP/s (matrix products measured in the run; "
        "roofline = native's useful GFLOP/s over the one of the dtype it multiplies in: "
        f"{'bf16 for bfloat16' if result.get('half_units') else 'fp32 for every dtype'}"
        f"; half inputs in mode {result.get('half_mode', 'auto')!r}); the built kernels "
        f"load in {result['load_s'] * 1e3:.0f} ms in a fresh process."
        + (f" Source: {result['source']}." if result.get("source") else ""),
        "",
        "Forward, B = 1 (4 for padding), H = 8, D = 64: median ms; per pair = native's time "
        "per visible pair against dense SDPA's; vs best = the best of SDPA, Flex compiled "
        "and tiled over native.",
        "",
        "| dtype | pattern | S | SDPA | Flex | tiled | native | auto (picks) | per pair "
        "| vs best | roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["kernels"]:  # type: ignore[attr-defined]
        roof = roofline_of(result, r["dtype"])
        flex = f"{r['flex_ms']:.1f}" if "flex_ms" in r else "-"
        lines.append(
            f"| {r['dtype']} | {r['pattern']} | {r['S']} | {r['sdpa_ms']:.1f} | {flex} | "
            f"{r['tiled_ms']:.1f} | {r['native_ms']:.1f} | {r['auto_ms']:.1f} ({r['auto']}) | "
            f"{r['per_pair']:.2f} | {r['vs_best_peer']:.2f}× | {r['gflops'] / roof:.0%} |"
        )
    lines += train_markdown(result)
    if not result["decode"]:  # a run with --no-decode
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "Decoding, L = 1, H = 8, D = 64, Hkv = 2 (GQA) or 8 (MHA): median µs; ratio = SDPA "
        "/ attnkit.",
        "",
        "| dtype | Hkv | padded | B | S | SDPA µs | auto µs | native µs | auto ratio "
        "| native ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["decode"]:  # type: ignore[attr-defined]
        lines.append(
            f"| {r.get('dtype', 'float32')} | {r.get('Hkv', 2)} | {'yes' if r['padded'] else 'no'}"
            f" | {r['B']} | "
            f"{r['S']} | {r['sdpa_us']:.0f} | "
            f"{r['auto_us']:.0f} | {r['native_us']:.0f} | {r['auto_ratio']:.2f}× | "
            f"{r['native_ratio']:.2f}× |"
        )
    return "\n".join(lines) + "\n"


def train_markdown(result: dict[str, object]) -> list[str]:
    rows = result.get("train") or []
    if not rows:  # a run with --no-train
        return []
    lines = [
        "",
        "Forward+backward, the same calls (the output's gradient all ones): median ms; per "
        "pair = native's time per visible pair against dense SDPA's forward+backward; vs "
        "best = the better of SDPA and tiled over native; roofline = useful work (3.5× the "
        "forward's) over the roofline of the dtype it multiplies in.",
        "",
        "| dtype | pattern | S | SDPA | tiled | native | auto (picks) | per pair | vs best "
        "| roofline |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:  # type: ignore[attr-defined]
        roof = roofline_of(result, r["dtype"])
        lines.append(
            f"| {r['dtype']} | {r['pattern']} | {r['S']} | {r['sdpa_ms']:.1f} | "
            f"{r['tiled_ms']:.1f} | {r['native_ms']:.1f} | {r['auto_ms']:.1f} ({r['auto']}) | "
            f"{r['per_pair']:.2f} | {r['vs_best_peer']:.2f}× | {r['gflops'] / roof:.0%} |"
        )
    return lines


def train_rows(args: argparse.Namespace) -> list[dict[str, object]]:
    """Forward+backward of every pattern, size and dtype asked for."""
    return [
        train_row(p, S, dtype, args.repeats)
        for dtype in args.dtypes
        for S in args.sizes
        for p in args.patterns
    ]


def kernel_rows(args: argparse.Namespace) -> list[dict[str, object]]:
    """The forward rows: every dtype, size and pattern asked."""
    return [
        kernel_row(p, S, dtype, args.repeats, not args.no_flex)
        for dtype in args.dtypes
        for S in args.sizes
        for p in args.patterns
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--no-train", action="store_true", help="skip forward+backward")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the tables go")
    parser.add_argument(
        "--dtypes", nargs="+", default=list(DTYPES), choices=KINDS, help="forward and train rows"
    )
    parser.add_argument(
        "--half", choices=MODES, help="what half inputs compute in (default: the runtime's)"
    )
    parser.add_argument("--table", type=Path, help="only write the table of a kept JSON")
    parser.add_argument(
        "--decode-only", action="store_true", help="rerun the decoding grid of this kind's JSON"
    )
    parser.add_argument(
        "--train-only", action="store_true", help="rerun forward+backward into this kind's JSON"
    )
    parser.add_argument(
        "--forward-only", action="store_true", help="rerun the forward rows into this kind's JSON"
    )
    args = parser.parse_args()
    if args.table is not None:
        return rewrite(args.table)
    if (reason := unavailable()) is not None:
        sys.exit(f"the native kernels are unavailable: {reason}")
    peer_recompile_limit()
    if args.half is not None:
        runtime.current().half.use(args.half)
    kind = cpu_kind()
    kept = args.out / f"native_{kind}.json"
    if args.decode_only:
        return rerun(kept, "decode", lambda: decode_rows(args.repeats))
    if args.train_only:
        return rerun(kept, "train", lambda: train_rows(args))
    if args.forward_only:
        return rerun(kept, "kernels", lambda: kernel_rows(args))
    kernels = kernel_rows(args)
    result = {
        "kind": kind,
        "cpu": cpu_description(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "roofline_fp32": roofline_gflops(args.repeats),
        "roofline_bf16": roofline_gflops(args.repeats, torch.bfloat16),
        "half_units": half_units(),
        "half_mode": runtime.current().half.mode,
        "load_s": load_seconds(),
        "kernels": kernels,
        "train": [] if args.no_train else train_rows(args),
        "decode": [] if args.no_decode else decode_rows(args.repeats),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(result, indent=1, default=str))
    text = markdown(result)
    (args.out / f"native_{kind}.md").write_text(text)
    print(text)


def rerun(path: Path, part: str, rows: Callable[[], list[dict[str, object]]]) -> None:
    """Rows of one part of a kept JSON of this kind again (`kernels`, `decode`, `train`), each in
    the place of the kept row that measured the same cell (new cells at the end), and
    its table."""
    result = json.loads(path.read_text())
    result["half_units"] = half_units()  # the kernels the fresh rows ran
    result["half_mode"] = runtime.current().half.mode
    result.pop("source", None)  # a table measured elsewhere now holds this machine's rows
    fresh = {_cell(r): r for r in rows()}
    kept = [fresh.pop(_cell(r), r) for r in result.get(part, [])]
    result[part] = kept + list(fresh.values())
    path.write_text(json.dumps(result, indent=1, default=str))
    rewrite(path)


def _cell(row: dict[str, object]) -> tuple[object, ...]:
    """What a row measures: its pattern, S and dtype (train), its grid point (decode)."""
    return tuple(row.get(k) for k in ("pattern", "S", "dtype", "Hkv", "padded", "B"))


def rewrite(path: Path) -> None:
    """The table again from a kept JSON (`--table results/native_avx2.json`)."""
    path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))


if __name__ == "__main__":
    main()
