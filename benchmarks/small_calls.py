"""Small calls side by side, attnkit against the plain PyTorch call it replaces.

The decode grid: B in {1, 4, 8, 32}, S in {512, 2048, 8192}, H=8, Hkv=2, D=64, one
query per row, float32, without padding (`causal(align="bottom_right")` against SDPA
unmasked) and with padding (`& key_padding(lengths)`, lengths drawn in [S/2, S], against
SDPA with the same bool mask). Round-robin medians
(`attnkit.learn.benchmark.round_robin`) of `--runs` calls each, under `torch.no_grad()`
as generation runs; the ratio is SDPA's time over
attnkit's (>= 1: attnkit at least as fast); `overhead` is attnkit's time minus SDPA's, in
microseconds (the planning and checks a call pays beyond the kernel), for `attention` and
for a prepared call (`attnkit.prepare`: what a model's layers of one step share).

Then (`--parts`): a small training call (B=16, H=4, Hkv=2, L=128, D=32, causal, forward
and backward) against SDPA's `is_causal`; `MultiHeadAttention` + `KVCache` decoding
against the same module with SDPA; compiled training steps of `examples/tiny_gpt.py`'s
model against the same model with SDPA; transformers `generate` tokens/s of a tiny
Llama with `attn_implementation` attnkit, sdpa and eager (B=1, and B=4 left-padded).

    python benchmarks/small_calls.py     # everything, about 15 minutes: small_calls_<kind>.md
    python benchmarks/small_calls.py --parts decode --batches 1 --sizes 512 --runs 50
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

import attnkit as ak
from attnkit._compat import cpu_kind
from attnkit.learn.benchmark import round_robin

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
        step = ak.prepare(q, k, v, mask)  # what a model's layers of one step share
        times = round_robin(
            {
                "sdpa": lambda: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=bool_mask, enable_gqa=True
                ),
                "attnkit": lambda: ak.attention(q, k, v, mask),
                "prepared": lambda: step(q, k, v),
            },
            runs,
        )
    return {
        "B": B,
        "S": S,
        "padding": padded,
        "sdpa_us": times["sdpa"] * 1e6,
        "attnkit_us": times["attnkit"] * 1e6,
        "ratio": times["sdpa"] / times["attnkit"],
        "overhead_us": (times["attnkit"] - times["sdpa"]) * 1e6,
        "prepared_us": times["prepared"] * 1e6,
        "prepared_ratio": times["sdpa"] / times["prepared"],
        "prepared_overhead_us": (times["prepared"] - times["sdpa"]) * 1e6,
        "picks": ak.explain(q, k, v, mask).backend,
    }


# ----------------------------------------------------------------- transformers generate

GENERATE = {
    "B=1": {"B": 1, "prompt": 128, "left_pad": [0]},
    "B=4 padded": {"B": 4, "prompt": 512, "left_pad": [0, 256, 384, 384]},
}
IMPLEMENTATIONS = ("attnkit", "sdpa", "eager")


def tiny_llama() -> Any:
    """The tiny Llama of the table, random weights from a config (nothing downloaded)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    return transformers.LlamaForCausalLM(config).eval()


def generate_rows(runs: int, new_tokens: int = 48) -> list[dict[str, Any]]:
    """Greedy `generate` tokens/s of each attention implementation, round-robin, and
    whether every implementation's tokens equal `sdpa`'s."""
    import copy

    import attnkit.integrations.transformers as akt

    akt.register()
    base = tiny_llama()
    models = {}
    for impl in IMPLEMENTATIONS:
        models[impl] = copy.deepcopy(base)
        models[impl].set_attn_implementation(impl)
    rows = []
    for name, spec in GENERATE.items():
        g = torch.Generator().manual_seed(spec["prompt"])
        ids = torch.randint(1, 1000, (spec["B"], spec["prompt"]), generator=g)
        attention_mask = torch.ones_like(ids)
        for row, pad in enumerate(spec["left_pad"]):
            attention_mask[row, :pad] = 0
            ids[row, :pad] = 0
        times, tokens = time_generate(models, ids, attention_mask, new_tokens, runs)
        made = spec["B"] * new_tokens
        row_out: dict[str, Any] = {"case": name, "new_tokens": new_tokens}
        for impl in IMPLEMENTATIONS:
            row_out[f"{impl}_tokens_per_s"] = made / times[impl]
            row_out[f"{impl}_same_tokens"] = bool(torch.equal(tokens[impl], tokens["sdpa"]))
        row_out["ratio"] = times["sdpa"] / times["attnkit"]
        rows.append(row_out)
        print(
            f"generate {name}: "
            + ", ".join(f"{i} {row_out[f'{i}_tokens_per_s']:.0f} tok/s" for i in IMPLEMENTATIONS),
            flush=True,
        )
    return rows


def time_generate(
    models: dict[str, Any], ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, runs: int
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Median seconds of each model's greedy `generate`, and the tokens each made."""
    tokens: dict[str, torch.Tensor] = {}

    def run(impl: str) -> None:
        with torch.no_grad():
            tokens[impl] = models[impl].generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    times = round_robin({impl: (lambda i=impl: run(i)) for impl in models}, runs)
    return times, tokens


# --------------------------------------------------------------------- training calls


def training_row(runs: int) -> dict[str, Any]:
    """One small causal GQA call, forward and backward, against SDPA (`is_causal`)."""
    B, Hq, Hk, L, Dh = 16, 4, 2, 128, 32
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, Hq, L, Dh, generator=g).requires_grad_()
    k = torch.randn(B, Hk, L, Dh, generator=g).requires_grad_()
    v = torch.randn(B, Hk, L, Dh, generator=g).requires_grad_()
    dout = torch.randn(B, Hq, L, Dh, generator=g)
    mask = ak.causal()

    def step(fn: Any) -> None:
        fn().backward(dout)

    times = round_robin(
        {
            "sdpa": lambda: step(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            ),
            "attnkit": lambda: step(lambda: ak.attention(q, k, v, mask)),
        },
        runs,
    )
    return {
        "case": f"B={B} H={Hq} Hkv={Hk} L={L} D={Dh} causal, forward+backward",
        "sdpa_us": times["sdpa"] * 1e6,
        "attnkit_us": times["attnkit"] * 1e6,
        "ratio": times["sdpa"] / times["attnkit"],
    }


class SdpaAttention(torch.nn.Module):
    """`ak.MultiHeadAttention`'s projections and cache with the attention by SDPA: the
    same module written with the plain call (`is_causal` or no mask, as the mask says)."""

    def __init__(self, inner: ak.MultiHeadAttention) -> None:
        super().__init__()
        self.inner = inner

    def forward(
        self, x: torch.Tensor, mask: Any = None, cache: ak.KVCache | None = None
    ) -> torch.Tensor:
        m = self.inner
        offset = 0 if cache is None else cache.length
        q, k, v = m.project(x, x, x, offset)
        if cache is not None:
            k, v = cache.append(k, v)
        causal = q.shape[2] > 1  # prefill (top-left causal); a decode step sees every key
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return m.out_proj(ak.merge_heads(out))


def module_decode_row(runs: int, prompt: int = 512, steps: int = 32) -> dict[str, Any]:
    """`MultiHeadAttention` + `KVCache`: a prefill of `prompt` tokens then `steps` decode
    steps (L=1, `causal(align="bottom_right")`), against the same module with SDPA."""
    torch.manual_seed(0)
    E = H * D
    mha = ak.MultiHeadAttention(E, H, num_kv_heads=HKV, rope=True).eval()
    peer = SdpaAttention(mha)
    x = torch.randn(1, prompt + steps, E)

    def decode(module: Any, attnkit_mask: bool) -> None:
        cache = ak.KVCache()
        with torch.no_grad():
            module(x[:, :prompt], mask=ak.causal() if attnkit_mask else None, cache=cache)
            for t in range(prompt, prompt + steps):
                mask = ak.causal(align="bottom_right") if attnkit_mask else None
                module(x[:, t : t + 1], mask=mask, cache=cache)

    times = round_robin(
        {"sdpa": lambda: decode(peer, False), "attnkit": lambda: decode(mha, True)}, runs
    )
    return {
        "case": f"prefill {prompt} + {steps} decode steps, E={E}, H={H}, Hkv={HKV}",
        "sdpa_ms": times["sdpa"] * 1e3,
        "attnkit_ms": times["attnkit"] * 1e3,
        "ratio": times["sdpa"] / times["attnkit"],
    }


def compiled_step_row(runs: int) -> dict[str, Any]:
    """Compiled training steps (forward, loss, backward) of `examples/tiny_gpt.py`'s
    model, attention by attnkit against the same model with SDPA."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    import tiny_gpt

    torch.manual_seed(0)
    model = tiny_gpt.TinyGPT(96, dim=128, layers=2, heads=4, kv_heads=2)
    peer = tiny_gpt.TinyGPT(96, dim=128, layers=2, heads=4, kv_heads=2)
    peer.load_state_dict(model.state_dict())
    for block in peer.blocks:
        block.attn = SdpaAttention(block.attn)
    tokens = torch.randint(0, 96, (16, 129), generator=torch.Generator().manual_seed(1))

    def stepper(m: Any) -> Any:
        compiled = torch.compile(m)

        def step() -> None:
            logits = compiled(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()

        return step

    steps = {"sdpa": stepper(peer), "attnkit": stepper(model)}
    for step in steps.values():  # compile outside the timing
        step()
    times = round_robin(steps, runs)
    return {
        "case": "tiny_gpt (2 layers, E=128, H=4, Hkv=2), B=16, L=128, torch.compile",
        "sdpa_ms": times["sdpa"] * 1e3,
        "attnkit_ms": times["attnkit"] * 1e3,
        "ratio": times["sdpa"] / times["attnkit"],
    }


PARTS = ("decode", "training", "module", "compiled", "generate")


def markdown(meta: dict[str, Any], results: dict[str, Any]) -> str:
    cpu = meta["cpu"]
    features = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["features"].items())
    lines = [
        f"CPU kind: **{meta['kind']}** ({cpu['model']}: {features}); torch {meta['torch']}, "
        f"{meta['threads']} threads; "
        f"medians of round-robin runs (× SDPA: the plain call's time over attnkit's, >= 1 "
        "means attnkit is at least as fast).",
    ]
    if "decode" in results:
        lines += [
            "",
            f"Decode step, H={H}, Hkv={HKV}, D={D}, L=1, float32, {meta['runs']} calls; "
            "overhead: attnkit's time minus SDPA's, µs; prepared: the "
            "call of `attnkit.prepare(...)` a model's layers of one step share.",
            "",
            "| B | S | padding | SDPA (µs) | attnkit (µs) | picks | × SDPA | overhead (µs) "
            "| prepared (µs) | × SDPA | overhead (µs) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['B']} | {r['S']} | {'yes' if r['padding'] else 'no'} | {r['sdpa_us']:.0f} | "
            f"{r['attnkit_us']:.0f} | {r.get('picks', '')} | {r['ratio']:.2f} | "
            f"{r['overhead_us']:.0f} | "
            f"{r['prepared_us']:.0f} | {r['prepared_ratio']:.2f} | "
            f"{r['prepared_overhead_us']:.1f} |"
            for r in results["decode"]
        ]
    for part, unit, title in (
        ("training", "us", "Small training call"),
        ("module", "ms", "MultiHeadAttention + KVCache decoding"),
        ("compiled", "ms", "Compiled training step"),
    ):
        if part in results:
            r = results[part]
            shown = "µs" if unit == "us" else unit
            lines += [
                "",
                f"{title}: {r['case']}.",
                "",
                f"| SDPA ({shown}) | attnkit ({shown}) | × SDPA |",
                "|---|---|---|",
                f"| {r[f'sdpa_{unit}']:.1f} | {r[f'attnkit_{unit}']:.1f} | {r['ratio']:.2f} |",
            ]
    if "generate" in results:
        lines += [
            "",
            "transformers `generate`, tiny Llama from a config (hidden 256, 4 layers, 8 heads"
            " / 2 KV heads), greedy; tokens/s (same tokens as `sdpa`: yes/no).",
            "",
            "| case | attnkit | sdpa | eager | attnkit × sdpa |",
            "|---|---|---|---|---|",
        ]
        for r in results["generate"]:
            cells = [
                f"{r[f'{i}_tokens_per_s']:.0f} ({'yes' if r[f'{i}_same_tokens'] else 'NO'})"
                for i in IMPLEMENTATIONS
            ]
            lines.append(
                f"| {r['case']}, {r['new_tokens']} new | "
                + " | ".join(cells)
                + f" | {r['ratio']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--runs", type=int, default=200, help="calls per decode grid point")
    parser.add_argument("--model-runs", type=int, default=7, help="runs of the model rows")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    meta = {
        "cpu": cpu_description(),
        "kind": cpu_kind(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "runs": args.runs,
    }
    results: dict[str, Any] = {}
    if "decode" in args.parts:
        results["decode"] = []
        for B in args.batches:
            for S in args.sizes:
                for padded in (False, True):
                    r = decode_row(B, S, padded, args.runs)
                    results["decode"].append(r)
                    line = f"B={B:>2} S={S:>5} padding={padded!s:<5} SDPA {r['sdpa_us']:8.0f} µs"
                    print(
                        f"{line}  attnkit {r['attnkit_us']:8.0f} µs  {r['ratio']:.2f}×", flush=True
                    )
    if "training" in args.parts:
        results["training"] = training_row(args.runs)
    if "module" in args.parts:
        results["module"] = module_decode_row(args.model_runs)
    if "compiled" in args.parts:
        results["compiled"] = compiled_step_row(args.model_runs * 3)
    if "generate" in args.parts:
        results["generate"] = generate_rows(args.model_runs)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"small_calls_{cpu_kind()}"  # one table per kind of CPU
    (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, **results}, indent=1))
    table = markdown(meta, results)
    (args.out / f"{name}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
