"""Fit the `native` backend's cost factors (pair, piece, call, bf16) on this CPU.

Times the kernel (float32, B = 1, H = 8, D = 64) over windows, causal, chunks, prefix-LM
and no mask at L = 256 to 4096, in units of dense SDPA's time per query-key pair and head
measured in the same run, and fits `pair·H·pairs + piece·Hkv·pieces + call` (the backend's
cost, with its blocking's pairs and pieces) by least squares on the relative error. Then
the same calls in bfloat16 give `bf16`, the median of their time over float32's (net of
the call), the factor the backend prices bfloat16 by where it runs on the half units. The
built-in factors of `backends/native.py` come from this command on the kind of CPU its
table names; `attnkit calibrate` rescales them on any machine.

    python benchmarks/native_fit.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit import runtime
from attnkit._compat import cpu_kind
from attnkit.backends.native import _tiles
from attnkit.learn.benchmark import round_robin
from attnkit.masks.spans import exact_spans
from attnkit.native.ops import blocking

H, D = 8, 64
MASKS = {
    "none": None,
    "causal": ak.causal(),
    "window 64": ak.sliding_window(63) & ak.causal(),
    "window 256": ak.sliding_window(255) & ak.causal(),
    "window 1024": ak.sliding_window(1023) & ak.causal(),
    "two-sided 128": ak.sliding_window(64),
    "chunks 512": ak.chunked(512) & ak.causal(),
    "prefix 1/4": None,  # made per L
}


def _mask(name: str, L: int) -> ak.Mask | None:
    return ak.prefix_lm(L // 4) if name == "prefix 1/4" else MASKS[name]


def _work(mask: ak.Mask | None, L: int) -> tuple[int, int]:
    if mask is None:
        lo, hi = torch.zeros(1, L, dtype=torch.long), torch.full((1, L), L)
    else:
        spans = exact_spans(mask, 1, L, L, "cpu")
        assert spans is not None
        lo, hi = (t.to(torch.long).expand(1, L).contiguous() for t in spans)
    tiles = _tiles(lo, hi, *blocking(L, 1))
    return tiles.pairs, tiles.pieces


def _timed(dtype: torch.dtype, unit: float) -> tuple[list[tuple[str, int, int, int]], list[float]]:
    """Every mask at every L on the kernel in `dtype`: (name, L, pairs, pieces) and times in
    units of dense SDPA's time per pair and head."""
    rows, times = [], []
    for L in (256, 1024, 4096):
        x = torch.randn(1, H, L, D).to(dtype)
        masks = {name: _mask(name, L) for name in MASKS}
        fns = {
            name: lambda x=x, m=mask: ak.attention(x, x, x, m, backend="native")
            for name, mask in masks.items()
        }
        with torch.no_grad():
            medians = round_robin(fns, 5)
        for name, seconds in medians.items():
            pairs, pieces = _work(masks[name], L)
            rows.append((name, L, pairs, pieces))
            times.append(seconds / unit)
    return rows, times


def main() -> None:
    torch.manual_seed(0)
    q = torch.randn(1, H, 4096, D)
    with torch.no_grad():
        dense = round_robin({"sdpa": lambda: F.scaled_dot_product_attention(q, q, q)}, 5)["sdpa"]
    unit = dense / (4096 * 4096 * H)  # seconds per pair and head
    rows, times = _timed(torch.float32, unit)
    A = torch.tensor([[H * p, H * n, 1.0] for _, _, p, n in rows], dtype=torch.float64)
    t = torch.tensor(times, dtype=torch.float64)
    fit = torch.linalg.lstsq(A / t[:, None], torch.ones_like(t)).solution.clamp(min=0)
    print(f"native cost factors on {cpu_kind()} (dense SDPA {dense * 1e3:.1f} ms at 4096):")
    print(f"  pair {fit[0]:.3g}, piece {fit[1]:.3g}, call {fit[2]:.3g}")
    for (name, L, _, _), measured, predicted in zip(rows, t, A @ fit, strict=True):
        ratio = predicted / measured
        print(f"  {name:>14} L={L:<5} measured {measured:12.4g}  fit/measured {ratio:.2f}")
    # bf16: the kernel's bfloat16 work over its float32 work, net of the call, median of the
    # rows (the factor the backend prices bfloat16 by where it runs on the half units)
    _, half_times = _timed(torch.bfloat16, unit)
    ratios = torch.tensor(
        [(h - fit[2]) / (f - fit[2]) for h, f in zip(half_times, times, strict=True) if f > fit[2]]
    )
    units = runtime.current().half.on_half_units(q.bfloat16(), alibi=False)
    print(
        f"  bf16 {ratios.median():.3g} (rows {ratios.min():.2f}-{ratios.max():.2f}; bfloat16 "
        f"{'on the half units' if units else 'converted to float32: the factor is not read'})"
    )


if __name__ == "__main__":
    main()
