"""One training step of `examples/tiny_gpt.py`'s model, eager and compiled, with attnkit's
attention and with `F.scaled_dot_product_attention` in its place (is_causal, GQA):
the compiled-vs-eager rows of `bench.py`; alone, one table per CPU kind:

    python benchmarks/compiled.py     # results/tiny_gpt_<kind>.md
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import attnkit.kv.attender
from attnkit._compat import cpu_kind
from attnkit.learn.benchmark import round_robin

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from tiny_gpt import TinyGPT

VOCAB, BATCH, BLOCK = 96, 16, 128


def _sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, **_: Any) -> Any:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _step(model: TinyGPT, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def training_steps(repeats: int) -> list[dict[str, object]]:
    """Median ms of a training step for attnkit / SDPA, eager / compiled (timed round-robin)."""
    tokens = torch.randint(0, VOCAB, (BATCH, BLOCK + 1), generator=torch.Generator().manual_seed(0))
    steps: dict[str, Callable[[], None]] = {}
    compile_s: dict[str, float] = {}
    original = attnkit.kv.attender.attention
    for attn in ("attnkit", "sdpa"):
        for mode in ("eager", "compiled"):
            torch.manual_seed(0)
            model = TinyGPT(VOCAB)
            model.eval()  # no dropout: both sides compute the same thing
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            fn = torch.compile(model) if mode == "compiled" else model
            name = f"{attn} {mode}"

            def step(fn: Any = fn, optimizer: Any = optimizer, attn: str = attn) -> None:
                attnkit.kv.attender.attention = _sdpa_attention if attn == "sdpa" else original
                try:
                    _step(fn, optimizer, tokens)
                finally:
                    attnkit.kv.attender.attention = original

            start = time.perf_counter()
            step()  # compiles (round_robin calls each once more before timing)
            compile_s[name] = time.perf_counter() - start
            steps[name] = step
    ms = {name: seconds * 1e3 for name, seconds in round_robin(steps, repeats).items()}
    return [
        {
            "attention": name.split()[0],
            "mode": name.split()[1],
            "ms": value,
            "first_step_s": compile_s[name],
        }
        for name, value in ms.items()
    ]


def compiled_markdown(rows: list[dict[str, Any]]) -> str:
    ms = {(r["attention"], r["mode"]): r["ms"] for r in rows}
    lines = [
        f"CPU kind: **{cpu_kind()}** ({torch.get_num_threads()} threads; torch "
        f"{torch.__version__}). tiny_gpt training step (B={BATCH}, L={BLOCK}, 4 layers, "
        "GQA 4:2, RoPE, float32): median ms; ratio = SDPA's time / attnkit's (1.0 = as fast).",
        "",
        "| mode | attnkit ms | SDPA ms | ratio |",
        "|---|---|---|---|",
    ]
    for mode in ("eager", "compiled"):
        a, s = ms[("attnkit", mode)], ms[("sdpa", mode)]
        lines.append(f"| {mode} | {a:.1f} | {s:.1f} | {s / a:.2f}× |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = compiled_markdown(training_steps(7))
    (Path(__file__).parent / "results" / f"tiny_gpt_{cpu_kind()}.md").write_text(text)
    print(text)
