"""Paged KV cache: many sequences of different lengths in fixed-size blocks of one pool.

vLLM's PagedAttention layout: the pool holds `num_blocks` blocks of `block_size` token
slots, and one block id holds those tokens' keys and values for every layer. Each
sequence has a block table (its blocks in order) and a length; blocks are reference
counted, so `fork` shares a sequence's blocks without copying and the first write into
a shared, partly filled block copies it (copy on write). `step` makes room for the next
tokens of several sequences at once (continuous batching: sequences join and leave
between steps) and `paged_attention` writes a layer's new keys and values and attends
each new token to its own sequence's history.

    pages = PagedKVCache(num_layers, num_kv_heads, head_dim, num_blocks=1024)
    s = pages.add()
    step = pages.step([s], [len(prompt)])
    for layer in range(num_layers):
        out = paged_attention(q, k, v, pages, step, layer)     # (T, H, Dv)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.errors import MaskError, OutOfBlocksError, ShapeContractError
from attnkit.functional import attention
from attnkit.masks import Mask, causal, sliding_window
from attnkit.masks.kinds import _SlidingWindow
from attnkit.precision import compute_dtype

__all__ = ["PagedKVCache", "PagedLayer", "Step", "paged_attention"]


@dataclass(frozen=True)
class Step:
    """Room made by `PagedKVCache.step`: the sequences, their new token counts, and where
    each sequence's history starts and its tokens lie (slots: block · block_size + offset)."""

    ids: tuple[int, ...]
    counts: tuple[int, ...]
    starts: tuple[int, ...]  # tokens each sequence held before the step
    tables: tuple[tuple[int, ...], ...]  # each sequence's blocks after the step
    version: int  # the cache's version when made: a later change makes it stale

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)

    def positions(self) -> Tensor:
        """Each new token's position in its sequence, in step order: (T,) (for RoPE)."""
        parts = [torch.arange(s, s + n) for s, n in zip(self.starts, self.counts, strict=True)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class PagedLayer:
    """One layer's view of a step, for a module: `cache=pages.layer(step, i)`."""

    pages: PagedKVCache
    step: Step
    layer: int

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask | None) -> Tensor:
        """`paged_attention` of (T, H, D), (T, Hkv, D), (T, Hkv, Dv): (T, H, Dv)."""
        return paged_attention(q, k, v, self.pages, self.step, self.layer, mask)


class PagedKVCache:
    """Keys and values of many sequences in a pool of blocks (see the module docstring)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_blocks: int,
        block_size: int = 16,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        sizes = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     num_blocks=num_blocks, block_size=block_size, value_dim=value_dim)  # fmt: skip
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PagedKVCache: {name} must be a positive int, got {value!r}.")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size, self.value_dim = num_blocks, block_size, value_dim
        slots = num_blocks * block_size
        self.keys = torch.zeros(
            num_layers, slots, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        self.values = torch.zeros(
            num_layers, slots, num_kv_heads, value_dim, dtype=dtype, device=device
        )
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is taken first
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._next_id = 0
        self.version = 0
        self._scratch: dict[tuple[str, torch.dtype], Tensor] = {}  # gather buffers, reused

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence holds."""
        return len(self._free)

    @property
    def sequences(self) -> list[int]:
        return list(self._tables)

    def add(self) -> int:
        """A new, empty sequence (it takes no block until a write needs one)."""
        seq = self._next_id
        self._next_id += 1
        self._tables[seq], self._lengths[seq] = [], 0
        self.version += 1
        return seq

    def fork(self, seq: int) -> int:
        """A sequence sharing all of `seq`'s tokens, without copying (copy on write)."""
        self._check_id(seq)
        child = self.add()
        self._tables[child] = list(self._tables[seq])
        self._lengths[child] = self._lengths[seq]
        for block in self._tables[child]:
            self._refs[block] += 1
        return child

    def remove(self, seq: int) -> None:
        """Forget `seq`; free the blocks no other sequence shares."""
        self._check_id(seq)
        for block in self._tables.pop(seq):
            self._release(block)
        del self._lengths[seq]
        self.version += 1

    def length(self, seq: int) -> int:
        """Tokens stored for `seq` (including the room of the latest step)."""
        self._check_id(seq)
        return self._lengths[seq]

    def block_table(self, seq: int) -> list[int]:
        """`seq`'s block ids, in token order."""
        self._check_id(seq)
        return list(self._tables[seq])

    def ref_count(self, block: int) -> int:
        """How many sequences hold `block`."""
        return self._refs[block]

    def step(self, ids: list[int], counts: list[int]) -> Step:
        """Room for `counts[i]` new tokens of sequence `ids[i]`, in every layer.

        Raises `OutOfBlocksError` and changes nothing when the free blocks do not suffice
        (a sequence whose last block is shared and partly filled needs one more: its copy).
        """
        ids, counts = list(ids), list(counts)
        self._check_step(ids, counts)
        refs = dict(enumerate(self._refs))  # as they will be when earlier ids have copied
        need = sum(self._blocks_needed(seq, n, refs) for seq, n in zip(ids, counts, strict=True))
        if need > len(self._free):
            raise OutOfBlocksError(
                f"this step needs {need} free blocks for {sum(counts)} tokens and "
                f"{len(self._free)} are free (of {self.num_blocks}); nothing was changed. "
                "Remove finished sequences, take fewer tokens this step, or make a larger cache."
            )
        starts = tuple(self._lengths[seq] for seq in ids)
        for seq, n in zip(ids, counts, strict=True):
            self._grow(seq, n)
        self.version += 1
        tables = tuple(tuple(self._tables[seq]) for seq in ids)
        return Step(tuple(ids), tuple(counts), starts, tables, self.version)

    def gather(
        self, layer: int, slots: Tensor, dtype: torch.dtype | None = None
    ) -> tuple[Tensor, Tensor]:
        """Keys (N, Hkv, D) and values (N, Hkv, Dv) of `slots` in `layer`, in `dtype`.

        They land in buffers the cache keeps (grown as needed), so a decode step does not
        allocate (and fault in) fresh memory for every gather; the result is valid until
        the next gather.
        """
        dtype = self.dtype if dtype is None else dtype
        out = []
        for name, store in (("k", self.keys), ("v", self.values)):
            if torch.is_grad_enabled() and store.requires_grad:  # out= has no autograd
                out.append(store[layer].index_select(0, slots).to(dtype))
                continue
            raw = self._buffer(name, store.dtype, slots.numel(), store.shape[2:])
            torch.index_select(store[layer], 0, slots, out=raw)
            if dtype != store.dtype:
                raw = self._buffer(name, dtype, slots.numel(), store.shape[2:]).copy_(raw)
            out.append(raw)
        return out[0], out[1]

    def _buffer(self, name: str, dtype: torch.dtype, n: int, tail: torch.Size) -> Tensor:
        found = self._scratch.get((name, dtype))
        if found is None or found.shape[0] < n:
            rows = max(n, 0 if found is None else 2 * found.shape[0])
            found = torch.empty(rows, *tail, dtype=dtype, device=self.device)
            self._scratch[(name, dtype)] = found
        return found[:n]

    def layer(self, step: Step, layer: int) -> PagedLayer:
        """What a `MultiHeadAttention` of `layer` takes as `cache=` to run this step."""
        return PagedLayer(self, step, layer)

    def slots(self, table: tuple[int, ...] | list[int], start: int, stop: int) -> Tensor:
        """Slot indices of token positions [start, stop) of a sequence with `table`."""
        positions = torch.arange(start, stop, device=self.device)
        blocks = torch.tensor(table, dtype=torch.long, device=self.device)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    # ------------------------------------------------------------------ internals

    def _check_id(self, seq: int) -> None:
        if seq not in self._tables:
            raise KeyError(f"no sequence {seq!r} in this cache (live: {sorted(self._tables)}).")

    def _check_step(self, ids: list[int], counts: list[int]) -> None:
        if len(ids) != len(counts):
            raise ValueError(f"step: {len(ids)} ids but {len(counts)} counts; give one count each.")
        if len(set(ids)) != len(ids):
            raise ValueError(f"step: ids {ids} repeat a sequence; give each sequence once.")
        for seq, n in zip(ids, counts, strict=True):
            self._check_id(seq)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"step: count for sequence {seq} must be an int >= 0, got {n!r}.")

    def _blocks_needed(self, seq: int, n: int, refs: dict[int, int]) -> int:
        """New blocks `seq` takes for n tokens: to grow, and to copy a shared partial last
        block (whose count drops then, so a sibling writing later needs no copy)."""
        length, table = self._lengths[seq], self._tables[seq]
        grow = math.ceil((length + n) / self.block_size) - len(table)
        copy = n > 0 and length % self.block_size != 0 and refs[table[-1]] > 1
        if copy:
            refs[table[-1]] -= 1
        return grow + int(copy)

    def _grow(self, seq: int, n: int) -> None:
        length, table = self._lengths[seq], self._tables[seq]
        if n > 0 and length % self.block_size != 0 and self._refs[table[-1]] > 1:
            table[-1] = self._copy(table[-1])  # the shared partial block: ours to write now
        while len(table) * self.block_size < length + n:
            table.append(self._take())
        self._lengths[seq] = length + n

    def _take(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def _copy(self, block: int) -> int:
        new = self._take()
        bs = self.block_size
        for store in (self.keys, self.values):  # every layer's slots of the block
            store[:, new * bs : (new + 1) * bs] = store[:, block * bs : (block + 1) * bs]
        self._release(block)
        return new

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache({len(self._tables)} sequences, "
            f"{self.num_blocks - self.free_blocks}/{self.num_blocks} blocks of "
            f"{self.block_size} in use, layers={self.num_layers}, Hkv={self.num_kv_heads}, "
            f"D={self.head_dim}, Dv={self.value_dim}, {self.dtype})"
        )


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pages: PagedKVCache,
    step: Step,
    layer: int,
    mask: Mask | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Write a step's new keys and values into `layer` and attend each new token to its
    own sequence's tokens up to itself (causal, bottom-right), never to another's.

    Args:
        q: (T, H, D), k: (T, Hkv, D), v: (T, Hkv, Dv): the step's new tokens packed in
            step order (T = sum of the step's counts).
        mask: None or `sliding_window(left)`: each token sees the `left` tokens of its
            sequence before it (and itself).
    Returns:
        (T, H, Dv) in q's dtype.
    """
    left = _window_of(mask)
    _check_paged(q, k, v, pages, step, layer)
    _write(pages, step, layer, k, v)
    firsts = [0, *torch.tensor(step.counts).cumsum(0).tolist()]  # each sequence's first row
    outs: dict[int, Tensor] = {}
    if softcap is None:  # decode tokens: one gather, one fused call each (no planning)
        rows = [i for i, n in enumerate(step.counts) if n == 1]
        outs.update(
            zip(rows, _decode(q, pages, step, layer, rows, firsts, left, scale), strict=True)
        )
    for i, (n, start, table) in enumerate(zip(step.counts, step.starts, step.tables, strict=True)):
        if n and i not in outs:
            t = firsts[i]
            outs[i] = _attend(q[t : t + n], pages, layer, table, start, n, left, scale, softcap)
    if not outs:
        return q.new_zeros(0, q.shape[1], pages.value_dim)
    return torch.cat([outs[i] for i in sorted(outs)])  # (T, H, Dv)


def _decode(
    q: Tensor,
    pages: PagedKVCache,
    step: Step,
    layer: int,
    rows: list[int],
    firsts: list[int],
    left: int | None,
    scale: float | None,
) -> list[Tensor]:
    """One new token of each sequence `rows`: (1, H, Dv) each. Their keys are gathered in
    one `index_select`; every token sees all of its gathered keys, so each is one SDPA
    call without a mask, its G query heads as G rows against their shared K/V head (GQA
    reads each K/V head once)."""
    if not rows:
        return []
    spans = []
    for i in rows:
        start = step.starts[i]
        spans.append((0 if left is None else max(0, start - left), start + 1))
    slots = torch.cat(
        [pages.slots(step.tables[i], lo, hi) for i, (lo, hi) in zip(rows, spans, strict=True)]
    )
    work = compute_dtype(q.dtype)
    keys, values = pages.gather(layer, slots, work)  # (N, Hkv, D), (N, Hkv, Dv)
    Hkv, G = pages.num_kv_heads, q.shape[1] // pages.num_kv_heads
    outs, at = [], 0
    for i, (lo, hi) in zip(rows, spans, strict=True):
        k_i = keys[at : at + hi - lo].permute(1, 0, 2)[None]  # (1, Hkv, S_i, D)
        v_i = values[at : at + hi - lo].permute(1, 0, 2)[None]  # (1, Hkv, S_i, Dv)
        q_i = q[firsts[i]].to(work).view(1, Hkv, G, -1)  # (1, Hkv, G, D): heads as rows
        out = F.scaled_dot_product_attention(q_i, k_i, v_i, scale=scale)  # (1, Hkv, G, Dv)
        outs.append(out.reshape(1, Hkv * G, -1).to(q.dtype))
        at += hi - lo
    return outs


def _attend(
    q: Tensor,
    pages: PagedKVCache,
    layer: int,
    table: tuple[int, ...],
    start: int,
    n: int,
    left: int | None,
    scale: float | None,
    softcap: float | None,
) -> Tensor:
    """One sequence's n new queries (n, H, D) over its keys [lo, start + n): (n, H, Dv)."""
    lo = 0 if left is None else max(0, start - left)  # keys no new query's window reaches
    slots = pages.slots(table, lo, start + n)
    keys = pages.keys[layer].index_select(0, slots).transpose(0, 1)[None]  # (1, Hkv, S, D)
    values = pages.values[layer].index_select(0, slots).transpose(0, 1)[None]  # (1, Hkv, S, Dv)
    offset = start - lo  # query j sits at key position j + offset
    mask = causal(offset=offset) if left is None else sliding_window(left, offset=offset)
    out = attention(q.transpose(0, 1)[None], keys, values, mask, scale=scale, softcap=softcap)
    return out[0].transpose(0, 1)  # (n, H, Dv)


def _window_of(mask: Mask | None) -> int | None:
    if mask is None:
        return None
    if (
        isinstance(mask, _SlidingWindow)
        and mask.right == 0
        and mask.align in (None, "bottom_right")
        and mask.offset is None
    ):
        return mask.left
    raise MaskError(
        f"paged_attention takes mask=None (causal within each sequence) or "
        f"sliding_window(left) (a window over each sequence's positions); got {mask}."
    )


def _write(pages: PagedKVCache, step: Step, layer: int, k: Tensor, v: Tensor) -> None:
    slots = [
        pages.slots(table, start, start + n)
        for n, start, table in zip(step.counts, step.starts, step.tables, strict=True)
    ]
    index = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long, device=pages.device)
    pages.keys[layer].index_copy_(0, index, k)
    pages.values[layer].index_copy_(0, index, v)


def _check_paged(
    q: Tensor, k: Tensor, v: Tensor, pages: PagedKVCache, step: Step, layer: int
) -> None:
    if step.version != pages.version:
        raise ValueError(
            "paged_attention: this step is stale (the cache changed after it was made: add, "
            "fork, remove or another step); make the step right before its layers run."
        )
    if not 0 <= layer < pages.num_layers:
        raise IndexError(f"layer {layer} is outside 0..{pages.num_layers - 1}.")
    T, Hkv, D, Dv = step.num_tokens, pages.num_kv_heads, pages.head_dim, pages.value_dim
    want = {"q": (T, None, D), "k": (T, Hkv, D), "v": (T, Hkv, Dv)}
    for name, t in (("q", q), ("k", k), ("v", v)):
        shape = want[name]
        if t.dim() != 3 or any(
            w is not None and w != g for w, g in zip(shape, t.shape, strict=True)
        ):
            expected = ", ".join("H" if w is None else str(w) for w in shape)
            raise ShapeContractError(
                f"paged_attention: {name} must be ({expected}) = (tokens of the step, heads, "
                f"dim), got {tuple(t.shape)}."
            )
        if t.dtype != pages.dtype:
            raise TypeError(
                f"paged_attention: {name} is {t.dtype} but the cache holds {pages.dtype}."
            )
    if q.shape[1] % Hkv:
        raise ShapeContractError(
            f"paged_attention: H={q.shape[1]} query heads do not share Hkv={Hkv} K/V heads evenly."
        )
