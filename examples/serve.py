"""Serve a stream of prompts with tiny_gpt's model by continuous batching on a paged cache.

Requests wait in a queue; up to `--batch` sequences decode together, one
`PagedKVCache.step` and one packed forward pass per step for all of them (prompts
prefill in the same steps as others decode). A finished sequence leaves at once and
frees its blocks for the next request. A request for several samples prefills its
prompt once and `fork`s it: the samples share the prompt's blocks until they diverge.
At the end every output is checked against decoding its prompt alone with `KVCache`.

    python examples/serve.py                       # 24 requests, a short training first
    python examples/serve.py --requests 8 --train-steps 0
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_gpt import TinyGPT, encode, python_docs

import attnkit as ak


@dataclass
class Sample:
    """One sequence being decoded: its cache id, tokens so far and its own sampler."""

    request: int
    index: int
    seq: int
    prompt: list[int]
    new: int
    generator: torch.Generator
    samples: int = 1  # samples still to fork from this one after its prefill
    out: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # tokens to feed at the next step


def sample(logits: Tensor, g: torch.Generator, temperature: float) -> int:
    return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))


def generator(request: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * request + index)


def forward_step(
    model: TinyGPT, pages: ak.PagedKVCache, step: ak.Step, tokens: list[int]
) -> Tensor:
    """Logits (T, vocab) of a step's tokens packed in step order, every layer on pages."""
    x = model.embed(torch.tensor(tokens)[None])  # (1, T, E)
    for i, block in enumerate(model.blocks):
        x = block(x, None, pages.layer(step, i))
    logits: Tensor = model.head(model.norm(x))[0]
    return logits


def serve(model: TinyGPT, requests: list[tuple[list[int], int]], args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Continuous batching: returns the samples, tokens/s and the most blocks in use."""
    attn = model.blocks[0].attn
    pages = ak.PagedKVCache(
        len(model.blocks),
        attn.num_kv_heads,
        attn.head_dim,
        num_blocks=args.blocks,
        block_size=args.block_size,
        dtype=model.head.weight.dtype,
    )
    queue = deque(enumerate(requests))
    active: list[Sample] = []
    done: list[Sample] = []
    peak = steps = generated = 0
    start = time.perf_counter()
    while queue or active:
        while queue and len(active) < args.batch and _fits(pages, active, queue[0][1][1], args):
            r, (prompt, samples) = queue.popleft()
            seq = pages.add()
            active.append(
                Sample(r, 0, seq, prompt, args.new, generator(r, 0), samples, pending=list(prompt))
            )
        step = pages.step([s.seq for s in active], [len(s.pending) for s in active])
        logits = forward_step(model, pages, step, [t for s in active for t in s.pending])
        ends = torch.tensor([len(s.pending) for s in active]).cumsum(0) - 1
        forks = []
        for s, end in zip(active, ends.tolist(), strict=True):
            for index in range(1, s.samples):  # after the prompt's prefill
                child = Sample(
                    s.request,
                    index,
                    pages.fork(s.seq),
                    s.prompt,
                    s.new,
                    generator(s.request, index),
                )
                child.pending = [sample(logits[end], child.generator, args.temperature)]
                child.out.append(child.pending[0])
                forks.append(child)
            s.samples = 1
            s.pending = [sample(logits[end], s.generator, args.temperature)]
            s.out.append(s.pending[0])
        active += forks
        generated += len(active)
        peak = max(peak, pages.num_blocks - pages.free_blocks)
        steps += 1
        for s in [s for s in active if len(s.out) >= s.new]:
            active.remove(s)
            pages.remove(s.seq)  # its blocks serve the next request
            done.append(s)
    seconds = time.perf_counter() - start
    return done, generated / seconds, peak, steps


def _fits(
    pages: ak.PagedKVCache, active: list[Sample], samples: int, args: argparse.Namespace
) -> bool:
    """Admit a request only if every sequence could reach its full length (a reservation:
    no step then runs out of blocks)."""
    per = -(-(args.prompt_len + args.new) // args.block_size)  # blocks of a whole sequence
    coming = sum(s.samples for s in active) + samples
    return per * coming <= pages.num_blocks


def alone(model: TinyGPT, s: Sample, temperature: float) -> list[int]:
    """The same sample decoded by itself with one KVCache per layer."""
    caches = [ak.KVCache() for _ in model.blocks]
    g = generator(s.request, s.index)
    logits = model(torch.tensor(s.prompt)[None], caches)[0, -1]
    out = [sample(logits, g, temperature)]
    while len(out) < s.new:
        out.append(sample(model(torch.tensor([[out[-1]]]), caches)[0, -1], g, temperature))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--samples", type=int, default=3, help="samples of every 4th request")
    parser.add_argument("--new", type=int, default=40, help="tokens each sample generates")
    parser.add_argument("--prompt-len", type=int, default=48, help="longest prompt")
    parser.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--train-steps", type=int, default=150)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    data, chars = encode(python_docs())
    model = TinyGPT(len(chars), dim=64, layers=2).double()
    train(model, data, args.train_steps)
    model.eval()
    g = torch.Generator().manual_seed(1)
    requests = []
    for r in range(args.requests):
        n = int(torch.randint(4, args.prompt_len + 1, (1,), generator=g))
        at = int(torch.randint(0, len(data) - n, (1,), generator=g))
        requests.append((data[at : at + n].tolist(), args.samples if r % 4 == 0 else 1))
    with torch.no_grad():
        done, tokens_s, peak, steps = serve(model, requests, args)
        same = sum(s.out == alone(model, s, args.temperature) for s in done)
    print(
        f"served {args.requests} requests ({len(done)} samples, {sum(len(s.out) for s in done)} "
        f"tokens) in {steps} steps: {tokens_s:.0f} tokens/s; at most {peak} of {args.blocks} "
        f"blocks of {args.block_size} tokens in use"
    )
    for s in sorted(done, key=lambda s: (s.request, s.index))[:4]:
        prompt = "".join(chars[t] for t in s.prompt).replace("\n", " ")
        print(
            f"  request {s.request} sample {s.index}: {prompt!r} -> "
            f"{''.join(chars[t] for t in s.out)!r}"
        )
    ok = same == len(done)
    print(f"{same} of {len(done)} outputs equal decoding the prompt alone with KVCache")
    return 0 if ok else 1


def train(model: TinyGPT, data: Tensor, steps: int) -> None:
    """A short training so the samples read like text (not needed for the check)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 65, (16,), generator=g)
        window = torch.stack([data[s : s + 65] for s in starts])
        loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    raise SystemExit(main())
