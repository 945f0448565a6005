"""The paged-cache surface of the differential harness: random programs of adds, forks,
removes, releases and steps on a shuffled pool, every output against the float64 formula.

`program(draw)` runs one program drawn through a `fuzz_cases.Draw` (hypothesis in the
suite, a seeded `RandomDraw` in `make fuzz`) and raises AssertionError on a wrong
output or a step that ran out of blocks and changed something.
"""

from __future__ import annotations

import math
import random

import torch

import attnkit as ak
from fuzz_cases import Draw

D, DV, HKV = 8, 6, 2


def dense(q, keys, values, start, left=None, scale=None):
    """q (n, H, D) at positions start.. over keys (S, Hkv, D): the float64 formula."""
    n, H, _ = q.shape
    G = H // keys.shape[1]
    k = keys.double().repeat_interleave(G, 1).transpose(0, 1)  # (H, S, D)
    v = values.double().repeat_interleave(G, 1).transpose(0, 1)  # (H, S, Dv)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q.double().transpose(0, 1) @ k.mT * scale  # (H, n, S)
    i = torch.arange(n)[:, None] + start
    j = torch.arange(keys.shape[0])[None, :]
    visible = (j <= i) & (j >= i - left if left is not None else True)
    weights = torch.softmax(scores.masked_fill(~visible, -torch.inf), -1)
    return (weights @ v).transpose(0, 1)  # (n, H, Dv)


class World:
    """A PagedKVCache beside dense histories of every sequence; runs steps on both."""

    def __init__(self, H=4, layers=2, num_blocks=64, block_size=4, dtype=torch.float64, seed=0):
        self.pages = ak.PagedKVCache(
            layers, HKV, D, num_blocks=num_blocks, block_size=block_size, value_dim=DV, dtype=dtype
        )
        self.H, self.layers, self.dtype = H, layers, dtype
        self.history: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.g = torch.Generator().manual_seed(seed)

    def add(self):
        seq = self.pages.add()
        self.history[seq] = [(torch.zeros(0, HKV, D), torch.zeros(0, HKV, DV))] * self.layers
        return seq

    def fork(self, seq):
        child = self.pages.fork(seq)
        self.history[child] = list(self.history[seq])
        return child

    def run(self, ids, counts, left=None, tol=1e-12):
        """One step: random new tokens, paged_attention on every layer, compared."""
        step = self.pages.step(ids, counts)
        T = sum(counts)
        mask = None if left is None else ak.sliding_window(left)
        outs = []
        for layer in range(self.layers):
            q, k, v = (
                torch.randn(T, h, d, generator=self.g, dtype=torch.float64)
                for h, d in ((self.H, D), (HKV, D), (HKV, DV))
            )
            out = ak.paged_attention(
                *(t.to(self.dtype) for t in (q, k, v)), self.pages, step, layer, mask
            )
            assert out.shape == (T, self.H, DV) and out.dtype == self.dtype
            t = 0
            for seq, n in zip(ids, counts, strict=True):
                keys, values = self.history[seq][layer]
                keys, values = torch.cat([keys, k[t : t + n]]), torch.cat([values, v[t : t + n]])
                self.history[seq] = [
                    *self.history[seq][:layer],
                    (keys, values),
                    *self.history[seq][layer + 1 :],
                ]
                want = dense(q[t : t + n], keys, values, keys.shape[0] - n, left)
                torch.testing.assert_close(out[t : t + n].double(), want, atol=tol, rtol=tol)
                t += n
            outs.append(out)
        for seq in ids:
            assert self.pages.length(seq) == self.history[seq][0][0].shape[0]
        return outs


def program(draw: Draw) -> str:
    """One random program; returns its description (raises AssertionError if wrong)."""
    block_size = draw.choice((1, 3, 4, 16))
    G, left = draw.choice((1, 4)), draw.choice((None, 0, 2, 7))
    dtype = draw.choice((torch.float64, torch.float32))
    world = World(
        H=HKV * G,
        layers=draw.int(1, 2),
        num_blocks=24,
        block_size=block_size,
        dtype=dtype,
        seed=draw.int(0, 2**31 - 1),
    )
    pages, tol = world.pages, 1e-12 if dtype == torch.float64 else 2e-5
    random.Random(draw.int(0, 2**31 - 1)).shuffle(pages._free)
    ops = []
    for _ in range(draw.int(1, 24)):
        live = pages.sequences
        op = draw.choice("aasssfrd" if live else "a")  # steps most often
        pick = live[draw.int(0, max(len(live) - 1, 0))] if live else None
        ops.append(op)
        if op == "a":
            world.add()
        elif op == "f":
            world.fork(pick)
        elif op == "r":
            pages.remove(pick)
        elif op == "d" and left is not None:  # free what the window has left behind
            pages.release(pick, pages.length(pick) - left)
        elif op == "s":
            ids = sorted({draw.choice(live) for _ in range(draw.int(1, len(live)))})
            counts = [draw.int(0, 6) for _ in ids]
            before = [(pages.length(s), pages.block_table(s)) for s in live], pages.free_blocks
            try:
                world.run(ids, counts, left=left, tol=tol)
            except ak.OutOfBlocksError:
                after = [(pages.length(s), pages.block_table(s)) for s in live], pages.free_blocks
                assert after == before, "a step that ran out of blocks changed the cache"
    return (
        f"block_size={block_size} G={G} left={left} {str(dtype)[6:]} "
        f"layers={world.layers} ops={''.join(ops)}"
    )
