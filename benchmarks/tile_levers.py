"""The levers of `tiled`'s per-pair throughput, each measured on its own, in one run.

`tiled` runs a sliding window as blocks of R query rows × (window + R) keys through
PyTorch's CPU flash op, a few blocks a call (`tiled.CHUNK_BYTES`), each with an additive
mask. Its useful pairs per computed pair are window / (window + R), times how well the
op runs blocks that short. Timed round-robin on the same band (causal sliding window 256,
B=1, H=8, D=64, S=4096), each way to run it:

- `today`: as `tiled` does: masked blocks, a few per call;
- `one call`: every block in one call (more tiles per kernel call);
- `no mask`: one call without the mask (not exact: the ceiling of any scheme that masks
  fewer pairs, such as unmasked interiors);
- `split`: flash-attention's structure: each block's fully visible interior unmasked, its
  left edge masked and its diagonal square with `is_causal`, merged by log-sum-exp.

Per pair: useful pairs per second over dense SDPA's pairs per second in the same run
(1.0: a visible pair costs what a dense one does). The tile height is the third lever:
the rows of the table, weighed per CPU by the cost table's short-block factor
(tiled's `short`: built in per kind of CPU, or measured by `attnkit calibrate`).

    python benchmarks/tile_levers.py
    python benchmarks/tile_levers.py --dtypes float32 --runs 5
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench import cpu_description  # beside this file

from attnkit import runtime
from attnkit._compat import cpu_flash_attention
from attnkit.backends.tiled import CHUNK_BYTES
from attnkit.learn.benchmark import round_robin

RESULTS = Path(__file__).parent / "results"
H, D, WINDOW = 8, 64, 256
WAYS = ("today", "one call", "no mask", "split")


def windows(x: torch.Tensor, first: int, step: int, n: int, size: int) -> torch.Tensor:
    """x (H, S, D) -> (n, H, size, D): windows starting at first + i·step, one view."""
    s = x.stride()
    return x.as_strided((n, H, size, D), (step * s[1], s[0], s[1], s[2]), first * s[1])


def ways(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, R: int) -> dict[str, Any]:
    """The calls of each way to run the band in blocks of R rows (rows from WINDOW on)."""
    flash = cpu_flash_attention()
    assert flash is not None
    S, W = q.shape[1], WINDOW + R
    n = (S - WINDOW) // R
    qb = windows(q, WINDOW, R, n, R)
    kb, vb = (windows(t, WINDOW + R - W, R, n, W) for t in (k, v))  # (n, H, W, D)
    rows, keys = torch.arange(R)[:, None] + (W - R), torch.arange(W)[None]
    visible = (keys <= rows) & (keys > rows - WINDOW)  # (R, W)
    mask = torch.zeros(R, W, dtype=q.dtype).masked_fill_(~visible, -torch.inf)[None, None]
    per_call = max(1, CHUNK_BYTES // (4 * (H * R * (3 * D + 2) + R * W)))  # tiled's chunks

    def call(sl: slice, ks: slice, causal: bool, m: torch.Tensor | None) -> Any:
        return flash(qb[sl], kb[sl, :, ks], vb[sl, :, ks], 0.0, causal, attn_mask=m, scale=0.125)

    every = slice(None)

    def today() -> None:
        for i in range(0, n, per_call):
            call(slice(i, i + per_call), every, False, mask)

    left, right = W - WINDOW, W - R  # keys [left, right) are visible to every row
    edge = mask[..., :left].contiguous()

    def split() -> torch.Tensor:
        out, lse = call(every, slice(right, W), True, None)  # the diagonal square
        parts = ((slice(left, right), None), (slice(0, left), edge)) if right > left else ()
        for ks, m in parts:
            ob, lb = call(every, ks, False, m)
            if m is not None:
                lb[..., -1] = -torch.inf  # the last row sees no left-edge key (the op gives 0)
            new = torch.logaddexp(lse, lb)
            out.mul_((lse - new).exp_()[..., None]).addcmul_(ob, (lb - new).exp_()[..., None])
            lse = new
        return out

    fns: dict[str, Callable[[], object]] = {
        "today": today,
        "one call": lambda: call(every, every, False, mask),
        "no mask": lambda: call(every, every, False, None),
    }
    if right > left:  # blocks shorter than the window have an interior
        exact = call(every, every, False, mask)[0].float()
        tol = 1e-5 if q.dtype == torch.float32 else 2e-2
        assert torch.allclose(split().float(), exact, atol=tol), "split differs"
        fns["split"] = split
    return {"fns": fns, "useful": n * R * WINDOW * H, "computed": n * R * W * H}


def measure(dtype: torch.dtype, S: int, runs: int) -> list[dict[str, Any]]:
    work = runtime.current().half.kernel_dtype(dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(H, S, D, generator=g).to(work) for _ in range(3))
    flash = cpu_flash_attention()
    assert flash is not None
    dense = {"dense": lambda: flash(q[None], k[None], v[None], 0.0, False, scale=0.125)}
    cases = {R: ways(q, k, v, R) for R in (64, 128, 256)}
    fns = dict(dense)
    for R, case in cases.items():
        fns.update({f"{R} {name}": fn for name, fn in case["fns"].items()})
    times = round_robin(fns, runs)
    per_dense_pair = times["dense"] / (H * S * S)
    rows = []
    for R, case in cases.items():
        for name in WAYS:
            if f"{R} {name}" not in times:
                continue
            seconds = times[f"{R} {name}"]
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "kernel": str(work).removeprefix("torch."),
                    "S": S,
                    "rows": R,
                    "way": name,
                    "ms": seconds * 1e3,
                    "per_pair": per_dense_pair * case["useful"] / seconds,
                    "computed_per_pair": per_dense_pair * case["computed"] / seconds,
                }
            )
    return rows


def markdown(cpu: dict[str, Any], rows: list[dict[str, Any]], runs: int) -> str:
    features = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["features"].items())
    lines = [
        f"CPU: {cpu['model']} ({features}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; medians of {runs} round-robin runs; causal "
        f"sliding window {WINDOW}, H={H}, D={D}; per pair: useful pairs/s over dense "
        "SDPA's pairs/s in the same run; computed: every pair the blocks hold.",
        "",
        "| dtype (kernel) | S | rows R | way | ms | per pair | computed per pair |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} ({r['kernel']}) | {r['S']} | {r['rows']} | {r['way']} | "
            f"{r['ms']:.1f} | {r['per_pair']:.2f} | {r['computed_per_pair']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for name in args.dtypes:
        rows += measure(getattr(torch, name), args.size, args.runs)
        print(f"{name} done", flush=True)
    text = markdown(cpu_description(), rows, args.runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tile_levers.md").write_text(text)
    payload = {"cpu": cpu_description(), "runs": args.runs, "rows": rows}
    (args.out / "tile_levers.json").write_text(json.dumps(payload, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
