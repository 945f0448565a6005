"""The pool of a paged KV cache: blocks, block tables, reference counts, steps.

`PagePool` (the storage of `paged.PagedKVCache`) owns the pool and hands out blocks
(copy on write for forks, a typed error that changes nothing when they run out); a
`Step` is the room made for one forward pass's new tokens; `history` gathers one
sequence's keys and values for attention (`paged.attention`).

The pool is one tensor (layers, num_blocks·block_size, Hkv, D + Dv), a slot's key and
value side by side (`keys` and `values` are views of it), slot = block·block_size +
offset. Block tables are `array('q')` (a step's flat block list is one copy per table);
each block has a reference count, and free blocks a stack (block 0 first).

`step` computes every sequence's need first (growth, plus one block for a shared, partly
filled last block it will write: copy on write, counted as the copies happen, so
siblings writing in the same step need one copy fewer), raises `OutOfBlocksError` before
any change, then copies and grows. It computes once, for every layer, the flat block
list of its tables, where each table begins, and each new token's write slot and
position. A `Step` holds the ids, counts, starts, tables and the cache's version: a step
made stale by a later add, fork, remove or step is refused.

`release` frees a sequence's leading full blocks: their table entries become -1 and a
count of released blocks is kept per sequence; `fork` shares only the kept blocks,
`remove` frees only those, and each step carries the first kept position of its
sequences.
"""

from __future__ import annotations

import array
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from attnkit.call.dispatch import StepCalls
from attnkit.errors import OutOfBlocksError

__all__ = ["PagePool", "Step"]


class Decoding(NamedTuple):
    """A step's sequences that decode one token (the paged kernel's inputs): their places
    in the step, their rows of the packed tokens, each history's end (its length after
    the step) and where each one's block table begins, (N,) int64 each."""

    places: tuple[int, ...]
    rows: Tensor
    hi: Tensor
    table_at: Tensor


@dataclass(frozen=True)
class Step:
    """Room made by `PagedKVCache.step` for one forward pass: the sequences, their new
    token counts, where each sequence's history starts, and its blocks (a slot is
    block · block_size + offset). Made by the cache, never by hand; every layer of the
    pass uses it (`paged_attention`, `PagedKVCache.layer`), and a later change of the
    cache (add, fork, remove, step) makes it stale.

    Args:
        ids: the sequences, in step order.
        counts: new tokens of each sequence.
        starts: tokens each sequence held before the step.
        version: the cache's version when made.
        released: each sequence's first position whose keys are kept (`release`).
        blocks: every sequence's block table, concatenated (int64, on the cache's device).
        table_at: where each table begins in `blocks`, and where the last one ends.
        slots: (T,) int64 slot each new token is written to.
        token_positions: (T,) int64 position of each new token in its sequence (CPU).
        calls: each sequence's prefill call, prepared by the first layer for the others.

    Examples:
        >>> pages = ak.PagedKVCache(1, 1, 4, num_blocks=4, block_size=2)
        >>> a, b = pages.add(), pages.add()
        >>> step = pages.step([a, b], [3, 1])  # a: 3 prompt tokens, b: 1
        >>> step
        Step(ids=(0, 1), counts=(3, 1), starts=(0, 0), version=3, released=(0, 0))
        >>> step.num_tokens, step.positions(), step.tables  # tables: block ids in order
        (4, tensor([0, 1, 2, 0]), ((0, 1), (2,)))
        >>> pages.step([a, b], [1, 1]).positions()  # the next step: one token each
        tensor([3, 1])
    """

    ids: tuple[int, ...]
    counts: tuple[int, ...]
    starts: tuple[int, ...]  # tokens each sequence held before the step
    version: int  # the cache's version when made: a later change makes it stale
    released: tuple[int, ...]  # each sequence's first position whose keys are kept
    # Computed once for every layer of the step, on the cache's device:
    blocks: Tensor = field(compare=False, repr=False)  # every table, concatenated
    table_at: tuple[int, ...] = field(compare=False, repr=False)  # where each table begins,
    # and where the last one ends
    slots: Tensor = field(compare=False, repr=False)  # (T,): where each new token is written
    token_positions: Tensor = field(compare=False, repr=False)  # (T,) on the CPU
    # each sequence's prefill call, prepared by the first layer and run by the others
    calls: StepCalls = field(default_factory=StepCalls, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        """T, the step's new tokens."""
        return sum(self.counts)

    @property
    def tables(self) -> tuple[tuple[int, ...], ...]:
        """Each sequence's blocks after the step (-1 for blocks `release` freed)."""
        flat = self.blocks.tolist()
        return tuple(tuple(flat[a:b]) for a, b in itertools.pairwise(self.table_at))

    def positions(self) -> Tensor:
        """Each new token's position in its sequence, in step order: (T,) (for RoPE)."""
        return self.token_positions

    def firsts(self) -> list[int]:
        """Each sequence's first row in the step's packed tokens."""
        return [0, *itertools.accumulate(self.counts)][:-1]

    @functools.cached_property
    def decoding(self) -> Decoding:
        """The sequences that decode one token, made once for every layer of the step."""
        places = tuple(i for i, n in enumerate(self.counts) if n == 1)
        firsts = self.firsts()
        return Decoding(
            places,
            torch.tensor([firsts[i] for i in places], dtype=torch.long),
            torch.tensor([self.starts[i] + 1 for i in places], dtype=torch.long),
            torch.tensor([self.table_at[i] for i in places], dtype=torch.long),
        )


class PagePool:
    """The storage of a `PagedKVCache` (`attnkit.kv.paged`, which documents it): the pool
    of blocks, the block tables, their reference counts and the steps; the cache adds
    its layers' views (`layer`)."""

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
        sizes = dict(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            value_dim=value_dim,
        )
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PagedKVCache: {name} must be a positive int, got {value!r}.")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size, self.value_dim = num_blocks, block_size, value_dim
        slots = num_blocks * block_size
        # A slot's key and value side by side: one gather reads a block's keys and values.
        self.pool = torch.zeros(
            num_layers, slots, num_kv_heads, head_dim + value_dim, dtype=dtype, device=device
        )
        self.keys = self.pool[..., :head_dim]  # (layers, slots, Hkv, D): views of the pool
        self.values = self.pool[..., head_dim:]  # (layers, slots, Hkv, Dv)
        # each layer's pool as rows of blocks: (blocks, bs · Hkv · (D + Dv))
        self._rows = [self.pool[i].view(num_blocks, -1) for i in range(num_layers)]
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is taken first
        self._tables: dict[int, array.array[int]] = {}  # block ids ("q": int64) in order
        self._lengths: dict[int, int] = {}
        self._released: dict[int, int] = {}  # leading blocks freed (their table entries: -1)
        self._next_id = 0
        self.version = 0
        self._scratch: dict[torch.dtype, Tensor] = {}  # gather buffers, reused

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def device(self) -> torch.device:
        return self.pool.device

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
        self._tables[seq], self._lengths[seq], self._released[seq] = array.array("q"), 0, 0
        self.version += 1
        return seq

    def fork(self, seq: int) -> int:
        """A sequence sharing all of `seq`'s tokens, without copying (copy on write)."""
        self._check_id(seq)
        child = self.add()
        self._tables[child] = array.array("q", self._tables[seq])
        self._lengths[child] = self._lengths[seq]
        self._released[child] = self._released[seq]
        for block in self._tables[child][self._released[seq] :]:
            self._refs[block] += 1
        return child

    def remove(self, seq: int) -> None:
        """Forget `seq`; free the blocks no other sequence shares."""
        self._check_id(seq)
        for block in self._tables.pop(seq)[self._released.pop(seq) :]:
            self._release(block)
        del self._lengths[seq]
        self.version += 1

    def length(self, seq: int) -> int:
        """Tokens stored for `seq` (including the room of the latest step)."""
        self._check_id(seq)
        return self._lengths[seq]

    def release(self, seq: int, before: int) -> int:
        """Free `seq`'s blocks that hold only positions before `before` (keys no later
        query sees: `before = length - left` under `sliding_window(left)`); returns how
        many blocks this freed (none while before <= 0: a sequence shorter than its
        window). The block still being written is kept. Attention that reaches a released
        position is refused afterwards."""
        self._check_id(seq)
        if not isinstance(before, int) or isinstance(before, bool):
            raise ValueError(f"release: before must be an int position, got {before!r}.")
        table, first = self._tables[seq], self._released[seq]
        last = max(0, min(before, self._lengths[seq])) // self.block_size  # full, below before
        for i in range(first, last):
            self._release(table[i])
            table[i] = -1
        self._released[seq] = max(first, last)
        self.version += 1
        return max(0, last - first)

    def block_table(self, seq: int) -> list[int]:
        """`seq`'s block ids, in token order (-1 for blocks `release` freed)."""
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
        drops: dict[int, int] = {}  # references earlier ids' copies will have dropped
        need = sum(self._blocks_needed(seq, n, drops) for seq, n in zip(ids, counts, strict=True))
        if need > len(self._free):
            raise OutOfBlocksError(
                f"this step needs {need} free blocks for {sum(counts)} tokens and "
                f"{len(self._free)} are free (of {self.num_blocks}); nothing was changed. "
                "Remove finished sequences, take fewer tokens this step, or make a larger cache."
            )
        starts = tuple(self._lengths[seq] for seq in ids)
        released = tuple(self._released[seq] * self.block_size for seq in ids)
        for seq, n in zip(ids, counts, strict=True):
            self._grow(seq, n)
        self.version += 1
        tables = [self._tables[seq] for seq in ids]
        return Step(
            tuple(ids),
            tuple(counts),
            starts,
            self.version,
            released,
            *self._layout(starts, counts, tables),
        )

    def _layout(
        self, starts: tuple[int, ...], counts: list[int], tables: list[array.array[int]]
    ) -> tuple[Tensor, tuple[int, ...], Tensor, Tensor]:
        """A step's flat block list, where each table begins in it, the slots of its new
        tokens and their positions: vectorized, once for all the layers."""
        table_at = [0, *itertools.accumulate(len(t) for t in tables)]
        flat = array.array("q")
        for table in tables:
            flat += table  # a copy of machine ints: no Python int per block
        blocks = (
            torch.frombuffer(flat, dtype=torch.long) if flat else torch.zeros(0, dtype=torch.long)
        )
        counted = torch.tensor(counts, dtype=torch.long)
        seq = torch.repeat_interleave(torch.arange(len(counts)), counted)  # (T,) owner
        first = counted.cumsum(0) - counted  # each sequence's first row
        positions = (
            torch.arange(seq.numel()) - first[seq] + torch.tensor(starts, dtype=torch.long)[seq]
        )
        at = torch.tensor(table_at[:-1], dtype=torch.long)[seq] + positions // self.block_size
        slots = blocks[at] * self.block_size + positions % self.block_size  # (T,)
        return blocks.to(self.device), tuple(table_at), slots.to(self.device), positions

    def _buffer(self, dtype: torch.dtype, n: int, width: int) -> Tensor:
        """n rows of `width` in `dtype`, from a buffer kept and grown (doubling) as needed."""
        buffer = self._scratch.get(dtype)
        if buffer is None or buffer.shape[0] < n:
            rows = max(n, 0 if buffer is None else 2 * buffer.shape[0])
            buffer = torch.empty(rows, width, dtype=dtype, device=self.device)
            self._scratch[dtype] = buffer
        return buffer[:n]

    def history(
        self, step: Step, i: int, layer: int, lo: int, hi: int, dtype: torch.dtype, scratch: bool
    ) -> tuple[Tensor, Tensor]:
        """Keys (1, Hkv, hi - lo, D) and values (1, Hkv, hi - lo, Dv) of positions [lo, hi)
        of the step's sequence i in `layer`, in `dtype`.

        Whole blocks are gathered, keys and values at once (a block's slots lie side by
        side in the pool: one row of block_size · Hkv · (D + Dv) numbers); with `scratch`
        they land in a buffer the cache keeps and reuses (valid until the next call: no
        fresh memory faulted in for every sequence, and a sequence's keys stay in cache
        for the attention that reads them).
        """
        bs = self.block_size
        first = step.table_at[i] + lo // bs
        blocks = step.blocks[first : step.table_at[i] + -(-hi // bs)]
        rows = self._rows[layer]  # (blocks, bs · Hkv · (D + Dv))
        if scratch:
            got = self._buffer(self.dtype, blocks.numel(), rows.shape[1])
            torch.index_select(rows, 0, blocks, out=got)
            if dtype != self.dtype:
                got = self._buffer(dtype, blocks.numel(), rows.shape[1]).copy_(got)
        else:  # autograd records the gather (out= has no autograd)
            got = rows.index_select(0, blocks).to(dtype)
        tokens = got.view(1, -1, *self.pool.shape[2:])[:, lo % bs : lo % bs + hi - lo]
        tokens = tokens.transpose(1, 2)  # (1, Hkv, S, D + Dv)
        return tokens[..., : self.head_dim], tokens[..., self.head_dim :]

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

    def _blocks_needed(self, seq: int, n: int, drops: dict[int, int]) -> int:
        """New blocks `seq` takes for n tokens: to grow, and to copy a shared partial last
        block (whose count drops then, so a sibling writing later needs no copy)."""
        length, table = self._lengths[seq], self._tables[seq]
        grow = math.ceil((length + n) / self.block_size) - len(table)
        last = table[-1] if table else -1
        copy = n > 0 and length % self.block_size != 0 and self._refs[last] - drops.get(last, 0) > 1
        if copy:
            drops[last] = drops.get(last, 0) + 1
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
        self.pool[:, new * bs : (new + 1) * bs] = self.pool[:, block * bs : (block + 1) * bs]
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
