"""Where the paged decoding kernel's time goes: the kernel alone on one step's pages.

The step of `paged.py` (32 sequences of 128-4096 tokens, H=8, Hkv=2, D=64, blocks of
16 in shuffled order), as `attnkit.native.ops.paged_decode` alone, four ways, timed
round-robin in one process:
- `pool`: keys and values side by side in one pool, as `PagedKVCache` keeps them;
- `apart`: keys and values in two tensors (flash-attention's pages);
- `in order`: the pool with each sequence's blocks in order, one after another;
- `in cache`: every block table entry naming one block, so every read hits the cache:
  the kernel's compute alone, the floor no placement of the pages can beat.
Reported per dtype: the median time, the K/V bytes a step reads over that time and its
share of the read bandwidth measured in the same run.

    python benchmarks/paged_kernel.py
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from bench import cpu_description  # beside this file
from paged import read_bandwidth

from attnkit.learn.benchmark import round_robin
from attnkit.native import ops, unavailable

N, H, HKV, D, BLOCK = 32, 8, 2, 64, 16
RESULTS = Path(__file__).parent / "results"


def calls(dtype: torch.dtype) -> tuple[dict[str, Callable[[], object]], int]:
    """The four placements' kernel calls, and the K/V bytes one step reads."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(128, 4097, (N,), generator=g)
    pages = -(-lengths // BLOCK)
    at = torch.cumsum(pages, 0) - pages
    lo, total = torch.zeros(N, dtype=torch.long), int(pages.sum())
    q = torch.randn(N, H, D, generator=g).to(dtype)
    pool = torch.randn(total * BLOCK, HKV, 2 * D, generator=g).to(dtype)
    keys, values = pool[..., :D].contiguous(), pool[..., D:].contiguous()
    shuffled, ordered = torch.randperm(total, generator=g), torch.arange(total)
    one = torch.zeros(total, dtype=torch.long)

    def step(k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor) -> Callable[[], object]:
        return lambda: ops.paged_decode(q, k, v, blocks, at, lo, lengths, BLOCK, D**-0.5)

    fns = {
        "pool": step(pool[..., :D], pool[..., D:], shuffled),
        "apart": step(keys, values, shuffled),
        "in order": step(pool[..., :D], pool[..., D:], ordered),
        "in cache": step(pool[..., :D], pool[..., D:], one),
    }
    return fns, int(lengths.sum()) * HKV * 2 * D * q.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if (reason := unavailable()) is not None:
        sys.exit(f"the native kernels are unavailable: {reason}")
    cpu, bandwidth = cpu_description(), read_bandwidth()
    units = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["features"].items())  # type: ignore[attr-defined]
    lines = [
        f"CPU: {cpu['model']} ({units}); {torch.get_num_threads()} threads; one decoding "
        f"step of {N} sequences of 128-4096 tokens, H={H}, Hkv={HKV}, D={D}, blocks of "
        f"{BLOCK}; the kernel alone, median of {args.repeats} round-robin runs; read "
        f"bandwidth measured {bandwidth / 1e9:.1f} GB/s (sums over 512 MiB).",
        "",
        "| dtype | pages | kernel (ms) | K/V read / time | share of read bandwidth |",
        "|---|---|---|---|---|",
    ]
    for dtype in (torch.float32, torch.bfloat16):
        fns, nbytes = calls(dtype)
        for name, seconds in round_robin(fns, args.repeats).items():
            rate = nbytes / seconds
            share = "- (reads hit the cache)" if name == "in cache" else f"{rate / bandwidth:.0%}"
            lines.append(
                f"| {str(dtype)[6:]} | {name} | {seconds * 1e3:.2f} | {rate / 1e9:.1f} GB/s | "
                f"{share} |"
            )
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paged_kernel.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
