"""`attnkit bench`: `attention` against PyTorch's SDPA with the same mask, on this machine.

Each pattern runs `attention` with attnkit's mask and `F.scaled_dot_product_attention`
with what a framework passes it (`is_causal=True` for causal, else the dense (1, 1, S, S)
bool tensor), forward and, with `backward=True`, forward+backward, timed round-robin
(each round in a shuffled order, so a slow spell of the machine falls on both alike);
a row gives the medians, their ratio and the backend `attention` chose. The repository's
`benchmarks/` hold the full side-by-side suite (FlexAttention, the padded batch, memory,
decode, training).
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.learn.console import Progress

__all__ = ["PATTERNS", "Row", "round_robin", "run_bench", "table"]

PATTERNS: dict[str, Callable[[int], ak.Mask]] = {
    "causal": lambda S: ak.causal(),
    "sliding": lambda S: ak.sliding_window(max(S // 16, 1)),
    "documents": lambda S: ak.document(torch.arange(S) * 8 // S) & ak.causal(),
    "padding": lambda S: ak.key_padding(torch.tensor([S * 3 // 4])),
}


@dataclass(frozen=True)
class Row:
    pattern: str
    grad: bool
    attnkit_s: float  # median seconds
    sdpa_s: float
    backend: str  # what attention() chose

    @property
    def speedup(self) -> float:
        """SDPA's time over attnkit's: above 1, attnkit is faster."""
        return self.sdpa_s / self.attnkit_s


def round_robin(
    fns: dict[str, Callable[[], object]], runs: int, *, warmup: bool = True
) -> dict[str, float]:
    """Median seconds of each callable over `runs` rounds, each round in a shuffled order.

    Interleaving makes a slow spell of the machine (other load, frequency changes) fall
    on every peer alike instead of on whichever peer ran during it; each is called once
    first (thread pools, allocator, caches; `warmup=False` skips that for calls of many
    seconds, where it costs a round and changes nothing) and the garbage collector stays
    off while timing. Every table of the repository's `benchmarks/` is timed this way.
    """
    for fn in fns.values() if warmup else ():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    gc.collect()
    gc.disable()
    try:
        order = list(fns)
        for r in range(runs):
            random.Random(r).shuffle(order)  # no peer always runs after the same one
            for name in order:
                start = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return {name: statistics.median(t) for name, t in times.items()}


def _calls(
    pattern: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: bool
) -> dict[str, Callable[[], object]]:
    B, _, L, _ = q.shape
    S = k.shape[-2]
    mask = PATTERNS[pattern](S)
    is_causal = pattern == "causal"
    dense = None if is_causal else mask.materialize(B, 1, L, S)  # (B, 1, L, S)

    def run(out: Callable[[], torch.Tensor]) -> Callable[[], object]:
        if not grad:
            return lambda: out()
        return lambda: torch.autograd.backward(out().sum())

    context = torch.enable_grad() if grad else torch.no_grad()

    def attnkit() -> torch.Tensor:
        with context:
            return ak.attention(q, k, v, mask)

    def sdpa() -> torch.Tensor:
        with context:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, is_causal=is_causal)

    return {"attnkit": run(attnkit), "sdpa": run(sdpa)}


def run_bench(
    S: int = 2048,
    *,
    heads: int = 8,
    dim: int = 64,
    dtype: torch.dtype = torch.float32,
    patterns: tuple[str, ...] = tuple(PATTERNS),
    backward: bool = False,
    runs: int = 5,
    progress: TextIO | None = None,
) -> list[Row]:
    """Time every pattern (and pass) at B=1, H=`heads`, L=S, D=`dim`; a bar on `progress`."""
    unknown = sorted(set(patterns) - set(PATTERNS))
    if unknown:
        raise ValueError(f"unknown patterns {unknown}; choose from {sorted(PATTERNS)}.")
    passes = (False, True) if backward else (False,)
    bar = Progress(len(patterns) * len(passes), progress)
    rows = []
    for pattern in patterns:
        for grad in passes:
            q, k, v = (
                torch.randn(1, heads, S, dim, dtype=dtype).requires_grad_(grad) for _ in range(3)
            )
            times = round_robin(_calls(pattern, q, k, v, grad), runs)
            backend = ak.explain(q, k, v, PATTERNS[pattern](S)).backend
            rows.append(Row(pattern, grad, times["attnkit"], times["sdpa"], backend))
            bar.step(f"{pattern} {'forward+backward' if grad else 'forward'}")
    bar.close()
    return rows


def table(rows: list[Row], S: int, dtype: torch.dtype, *, heads: int, dim: int) -> str:
    """The rows as a text table, with what was measured and how to read it: the sizes,
    each pattern's mask, the medians, their ratio and the backend `auto` chose."""
    patterns = dict.fromkeys(r.pattern for r in rows)
    lines = [
        f"attnkit {ak.__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; B=1, H={heads}, L=S={S}, D={dim}, "
        f"{str(dtype).removeprefix('torch.')}",
        *(f"  {p:<10} {PATTERNS[p](S)}" for p in patterns),
        f"{'pattern':<10} {'pass':<17} {'attnkit':>10} {'SDPA':>10} {'speedup':>8}  backend",
    ]
    for r in rows:
        lines.append(
            f"{r.pattern:<10} {'forward+backward' if r.grad else 'forward':<17} "
            f"{r.attnkit_s * 1e3:>8.2f}ms {r.sdpa_s * 1e3:>8.2f}ms {r.speedup:>7.2f}×  {r.backend}"
        )
    lines.append("speedup = SDPA's median time over attnkit's (above 1: attnkit is faster)")
    return "\n".join(lines)
