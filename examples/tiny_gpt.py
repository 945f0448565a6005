"""A tiny character-level GPT built from attnkit modules, trained on CPU in a few minutes.

The text is the documentation that ships inside Python itself (the docstrings of
standard-library modules), so nothing is downloaded. The script prints the loss
falling against the unigram baseline, generates text with and without the KV cache
(the same text, faster with it), and saves a picture of the attention weights.

    python examples/tiny_gpt.py                  # about three minutes on 2 cores
    python examples/tiny_gpt.py --steps 20       # a quick look
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnkit as ak

MODULES = """
argparse collections json pathlib re string textwrap unittest logging datetime decimal
fractions functools itertools heapq random statistics difflib csv shutil subprocess
threading inspect dataclasses enum contextlib pickle zipfile tarfile email.message
email.utils http.client http.server urllib.parse urllib.request asyncio.events
asyncio.tasks asyncio.streams xml.etree.ElementTree sqlite3 multiprocessing.pool
concurrent.futures configparser optparse pydoc calendar locale gettext socket selectors
tokenize ast dis pdb doctest trace timeit profile pstats tempfile glob fnmatch codecs io
sched queue weakref copy pprint reprlib numbers operator hashlib hmac secrets base64
struct bisect types abc
""".split()  # noqa: SIM905 (a paragraph of names reads better than a list literal)


def _docs_of(module: object) -> list[str]:
    """Docstrings of a module, its functions and classes, and their methods."""
    objects = [module]
    for obj in vars(module).values():
        if inspect.getmodule(obj) is module:
            objects.append(obj)
            if inspect.isclass(obj):
                objects.extend(vars(obj).values())
    docs = []
    for obj in objects:
        doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
        if doc and len(doc) > 80:
            docs.append(inspect.cleandoc(doc))
    return docs


def python_docs() -> str:
    """The docstrings of standard-library modules and their members: English prose."""
    parts: list[str] = []
    for name in MODULES:
        try:
            parts.extend(_docs_of(importlib.import_module(name)))
        except ImportError:  # a Python built without a module (sqlite3, say)
            continue
    return "\n\n".join(dict.fromkeys(parts))  # unique, in order


def encode(text: str) -> tuple[Tensor, list[str]]:
    """The text as a tensor of character ids, and the characters (sorted)."""
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    return torch.tensor([stoi[c] for c in text]), chars


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = ak.MultiHeadAttention(dim, heads, num_kv_heads=kv_heads, rope=True)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(0.1)
        )

    def forward(self, x: Tensor, mask: ak.Mask, cache: ak.KVCache | None = None) -> Tensor:
        x = x + self.attn(self.norm1(x), mask=mask, cache=cache)
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(
        self, vocab: int, dim: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: Tensor, caches: list[ak.KVCache] | None = None) -> Tensor:
        """tokens (B, L) -> logits (B, L, vocab); with caches, L new tokens after them."""
        x = self.embed(tokens)  # (B, L, E)
        decoding = caches is not None and caches[0].length > 0
        mask = ak.causal(align="bottom_right") if decoding else ak.causal()
        for i, block in enumerate(self.blocks):
            x = block(x, mask, None if caches is None else caches[i])
        logits: Tensor = self.head(self.norm(x))
        return logits


def generate(model: TinyGPT, prompt: Tensor, new: int, use_cache: bool, seed: int = 0) -> Tensor:
    """Sample `new` tokens after `prompt` (1, P); with the cache each step feeds one token."""
    g = torch.Generator().manual_seed(seed)
    tokens = prompt
    caches = [ak.KVCache() for _ in model.blocks] if use_cache else None
    step_input = prompt
    with torch.no_grad():
        for _ in range(new):
            logits = model(step_input if use_cache else tokens, caches)[:, -1]
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)  # (1, 1)
            tokens = torch.cat([tokens, nxt], dim=1)
            step_input = nxt
    return tokens


def unigram_entropy(data: Tensor, vocab: int) -> float:
    p = torch.bincount(data, minlength=vocab).double() / len(data)
    return float(-(p[p > 0] * p[p > 0].log()).sum())


def plot_attention(model: TinyGPT, tokens: Tensor, text: str, path: Path) -> None:
    """Weights of the first layer's heads for one sentence, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no picture (pip install '/path/to/attnkit[plot]')")
        return
    block = model.blocks[0]
    with torch.no_grad():
        x = block.norm1(model.embed(tokens))
        q, k, _ = block.attn.project(x, x, x)
        weights = ak.attention_probs(q, k, ak.causal())[0]  # (H, L, L)
    heads = weights.shape[0]
    fig, axes = plt.subplots(1, heads, figsize=(4 * heads, 4.2))
    for h, ax in enumerate(axes):
        ax.imshow(weights[h].numpy(), cmap="viridis")
        ax.set_title(f"layer 0, head {h}")
        ax.set_xticks(range(len(text)), list(text), fontsize=6)
        ax.set_yticks(range(len(text)), list(text), fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"attention weights of layer 0 saved to {path}")


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--minutes", type=float, default=3.0, help="stop training after this")
    parser.add_argument("--block", type=int, default=128, help="context length")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--generate", type=int, default=100, help="characters to generate")
    parser.add_argument("--plot", type=Path, default=Path("tiny_gpt_attention.png"))
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    text = python_docs()
    data, chars = encode(text)
    stoi = {c: i for i, c in enumerate(chars)}
    chunks = data[: len(data) // 1000 * 1000].view(-1, 1000)  # every 10th chunk validates
    held_out = torch.arange(len(chunks)) % 10 == 0
    train, val = chunks[~held_out].flatten(), chunks[held_out].flatten()
    baseline = unigram_entropy(train, len(chars))
    print(
        f"text: {len(text):,} characters of Python's own docs, {len(chars)} distinct; "
        f"unigram baseline {baseline:.3f} nats/char"
    )

    model = TinyGPT(len(chars))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    print(
        f"model: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{len(model.blocks)} layers of attnkit MultiHeadAttention (GQA 4:2, RoPE)"
    )

    def batch(source: Tensor) -> tuple[Tensor, Tensor]:
        starts = torch.randint(0, len(source) - args.block - 1, (args.batch,))
        window = torch.stack([source[s : s + args.block + 1] for s in starts])
        return window[:, :-1], window[:, 1:]

    def loss_on(source: Tensor, batches: int = 8) -> float:
        model.eval()
        with torch.no_grad():
            losses = [
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                for x, y in (batch(source) for _ in range(batches))
            ]
        model.train()
        return sum(losses) / len(losses)

    start = time.perf_counter()
    step = 0
    for step in range(1, args.steps + 1):
        done = max(step / args.steps, (time.perf_counter() - start) / (60 * args.minutes))
        lr = 3e-3 * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))  # cosine, by steps or time
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batch(train)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        elapsed = time.perf_counter() - start
        if step == 1 or step % 100 == 0 or step == args.steps:
            print(f"step {step:5d}  train loss {loss.item():.3f}  ({elapsed:5.0f} s)", flush=True)
        if elapsed > 60 * args.minutes:
            print(f"stopping after {args.minutes} minutes")
            break
    val_loss = loss_on(val)
    print(
        f"validation loss {val_loss:.3f} nats/char vs unigram baseline {baseline:.3f} "
        f"({val_loss / baseline:.0%} of it)"
    )

    model.eval()
    prompt_text = "Return the "
    prompt = torch.tensor([[stoi[c] for c in prompt_text]])
    new = min(args.generate, args.block - prompt.shape[1])
    timings = {}
    for use_cache in (False, True):
        t0 = time.perf_counter()
        out = generate(model, prompt, new, use_cache)
        timings[use_cache] = time.perf_counter() - t0
        label = "with KV cache" if use_cache else "without cache"
        print(f"{label}: {new / timings[use_cache]:.0f} chars/s")
    sample = "".join(chars[i] for i in out[0].tolist())
    same = torch.equal(generate(model, prompt, new, False), out)
    print(
        f"generated ({'identical' if same else 'DIFFERENT'} with and without cache, "
        f"{timings[False] / timings[True]:.1f}× faster with it):\n{sample}"
    )

    if not args.no_plot:
        sentence = "The value is returned."
        plot_attention(
            model, torch.tensor([[stoi.get(c, 0) for c in sentence]]), sentence, args.plot
        )
    return {
        "val_loss": val_loss,
        "baseline": baseline,
        "steps": step,
        "cache_speedup": timings[False] / timings[True],
        "same": float(same),
    }


if __name__ == "__main__":
    main()
