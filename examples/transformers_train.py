"""Training steps of a transformers model with `attn_implementation="attnkit"` against
transformers' own `sdpa`, on the batches where a mask's structure matters.

A small Llama-style model (random weights, built from a config: nothing is downloaded)
takes forward+backward steps on three batches of the same number of tokens:

- packed: one row of several documents (`position_ids` restart at each), as trainers
  pack; transformers' sdpa gets a dense (1, 1, T, T) mask, attnkit `document & causal`;
- padded: rows of uneven lengths, right-padded (the 2-D `attention_mask`);
- unpadded: full rows, plain causal (both run the dense causal kernel).

It checks that both implementations give the same loss, then prints tokens per second
(median of round-robin timed steps) and their ratio.

    python examples/transformers_train.py                         # 4096 tokens, float32
    python examples/transformers_train.py --dtype bfloat16 --tokens 2048 --steps 3
"""

from __future__ import annotations

import argparse

import torch

import attnkit.integrations.transformers as akt
from attnkit.learn.benchmark import round_robin

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
IMPLEMENTATIONS = ("sdpa", "attnkit")


def build_model(dtype: torch.dtype, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1 << 15,
    )
    return LlamaForCausalLM(config).to(dtype).train()


def batches(tokens: int, rows: int) -> dict[str, dict[str, torch.Tensor]]:
    """The same number of token slots in each layout; labels -100 where padded."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (rows, tokens // rows), generator=g)
    lengths = torch.tensor([tokens // rows * (rows - r) // rows for r in range(rows)])
    real = torch.arange(tokens // rows)[None] < lengths[:, None]  # (rows, T/rows)
    cuts = torch.sort(torch.randperm(tokens - 1, generator=g)[:7] + 1).values
    starts = torch.zeros(tokens, dtype=torch.long)
    starts[cuts] = 1
    doc = starts.cumsum(0)  # (T,): 8 documents of uneven lengths
    first = torch.searchsorted(doc, doc)  # each token's document start
    positions = (torch.arange(tokens) - first)[None]
    flat = ids.reshape(1, tokens)
    return {
        "packed": {"input_ids": flat, "position_ids": positions, "labels": flat},
        "padded": {
            "input_ids": ids,
            "attention_mask": real.long(),
            "labels": ids.masked_fill(~real, -100),
        },
        "unpadded": {"input_ids": ids, "labels": ids},
    }


def step(model: torch.nn.Module, impl: str, batch: dict[str, torch.Tensor]) -> float:
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return float(loss.detach())


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="token slots per step")
    parser.add_argument("--rows", type=int, default=4, help="rows of the padded batches")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per cell (median)")
    args = parser.parse_args(argv)
    akt.register()
    dtype = DTYPES[args.dtype]
    model = build_model(dtype, args.layers)
    results = []
    print(f"{args.tokens} tokens a step, {args.layers} layers, {args.dtype}, fwd+bwd")
    print("| batch | sdpa tokens/s | attnkit tokens/s | attnkit / sdpa | loss diff |")
    print("|---|---|---|---|---|")
    for name, batch in batches(args.tokens, args.rows).items():
        losses = {impl: step(model, impl, batch) for impl in IMPLEMENTATIONS}
        diff = abs(losses["attnkit"] - losses["sdpa"])
        times = round_robin(
            {impl: (lambda impl=impl, b=batch: step(model, impl, b)) for impl in IMPLEMENTATIONS},
            args.steps,
        )
        rate = {impl: args.tokens / seconds for impl, seconds in times.items()}
        row = {"batch": name, **{f"{k}_tokens_s": v for k, v in rate.items()}, "loss_diff": diff}
        row["ratio"] = rate["attnkit"] / rate["sdpa"]
        results.append(row)
        print(
            f"| {name} | {rate['sdpa']:.0f} | {rate['attnkit']:.0f} | {row['ratio']:.2f}× "
            f"| {diff:.1e} |",
            flush=True,
        )
    return results


if __name__ == "__main__":
    main()
