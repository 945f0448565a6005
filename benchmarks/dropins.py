"""The drop-ins against the calls they replace, side by side in one run.

`attnkit.sdpa` against `F.scaled_dot_product_attention` with the same arguments on the
bench's patterns (`is_causal` for causal, else the pattern's dense bool mask, as code
that calls SDPA passes it), and `attnkit.varlen_attn` on 8 packed causal documents
against what CPU code does without it: a loop of SDPA calls, one per document. H=8,
D=64, float32, forward and forward+backward, medians of round-robin runs
(`attnkit.learn.benchmark.round_robin`);
ratio = the peer's time over attnkit's (above 1: attnkit is faster).

    python benchmarks/dropins.py
    python benchmarks/dropins.py --size 1024 --runs 3
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench import cpu_description, make_case  # beside this file

import attnkit as ak
from attnkit.learn.benchmark import round_robin

RESULTS = Path(__file__).parent / "results"
H, D = 8, 64
PATTERNS = ("none", "causal", "sliding", "documents", "padding", "prefix")


def _step(
    fn: Callable[..., torch.Tensor],
    tensors: list[torch.Tensor],
    grad: bool,
    kwargs: dict[str, Any] | None = None,
) -> Callable[[], None]:
    """One timed call of fn on the tensors (and its backward with `grad`)."""

    def run() -> None:
        out = fn(*tensors, **(kwargs or {}))
        if grad:
            out.backward(torch.ones_like(out))
            for t in tensors:
                t.grad = None

    return run


def sdpa_rows(S: int, runs: int) -> list[dict[str, Any]]:
    rows = []
    for pattern in PATTERNS:
        case = make_case(pattern, S)
        causal = pattern == "causal"
        mask = None if case.mask is None or causal else case.mask.dense(case.B, 1, S, S)
        for grad in (False, True):
            g = torch.Generator().manual_seed(0)
            tensors = [
                torch.randn(case.B, H, S, D, generator=g).requires_grad_(grad) for _ in range(3)
            ]
            kwargs = {"attn_mask": mask, "is_causal": causal}
            calls = {
                "torch": _step(F.scaled_dot_product_attention, tensors, grad, kwargs),
                "attnkit": _step(ak.sdpa, tensors, grad, kwargs),
            }
            times = round_robin(calls, runs)
            rows.append(_row("sdpa", pattern, S, grad, times))
            print(_line(rows[-1]), flush=True)
    return rows


def varlen_rows(S: int, runs: int) -> list[dict[str, Any]]:
    """8 packed causal documents of uneven lengths (the bench's cuts), T = S tokens."""
    case = make_case("documents", S)
    lengths = torch.bincount(case.doc_ids, minlength=8)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    rows = []
    for grad in (False, True):
        g = torch.Generator().manual_seed(0)
        tensors = [torch.randn(S, H, D, generator=g).requires_grad_(grad) for _ in range(3)]

        def loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs = [
                F.scaled_dot_product_attention(
                    *(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True
                )
                for a, b in bounds
            ]
            return torch.cat([o.transpose(0, 1) for o in outs])

        def packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            longest = int(lengths.max())
            out = ak.varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0))
            assert isinstance(out, torch.Tensor)
            return out

        calls = {"torch": _step(loop, tensors, grad), "attnkit": _step(packed, tensors, grad)}
        times = round_robin(calls, runs)
        rows.append(_row("varlen", "8 documents (loop of SDPA)", S, grad, times))
        print(_line(rows[-1]), flush=True)
    return rows


def _row(call: str, pattern: str, S: int, grad: bool, times: dict[str, float]) -> dict[str, Any]:
    return {
        "call": call,
        "pattern": pattern,
        "S": S,
        "pass": "fwd+bwd" if grad else "fwd",
        "torch_ms": times["torch"] * 1e3,
        "attnkit_ms": times["attnkit"] * 1e3,
        "ratio": times["torch"] / times["attnkit"],
    }


def _line(r: dict[str, Any]) -> str:
    return (
        f"| {r['call']} | {r['pattern']} | {r['S']} | {r['pass']} | {r['torch_ms']:.1f} | "
        f"{r['attnkit_ms']:.1f} | {r['ratio']:.2f}× |"
    )


def markdown(cpu: dict[str, Any], rows: list[dict[str, Any]], runs: int) -> str:
    features = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["features"].items())
    lines = [
        f"CPU: {cpu['model']} ({features}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; H={H}, D={D}, float32; medians of {runs} "
        "round-robin runs, ms; ratio = torch's time / attnkit's.",
        "",
        "| call | pattern | S | pass | torch | attnkit | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    return "\n".join(lines + [_line(r) for r in rows]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = sdpa_rows(args.size, args.runs) + varlen_rows(args.size, args.runs)
    cpu = cpu_description()
    text = markdown(cpu, rows, args.runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dropins.md").write_text(text)
    payload = {"cpu": cpu, "runs": args.runs, "rows": rows}
    (args.out / "dropins.json").write_text(json.dumps(payload, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
