"""A `Mask` as FlexAttention's `BlockMask`, built from its key spans in O(blocks).

FlexAttention skips the blocks of `block_size` queries × `block_size` keys that no pair
of the mask reaches, and runs the blocks every pair of which is visible ("full") without
evaluating the mask. `create_block_mask` finds both by evaluating the predicate on every
(b, h, i, j): L·S pairs per batch and head. A mask whose rows each see one interval of
keys (exact `Mask.key_spans`: causal, sliding windows, sorted documents, prefix-LM, length
padding and their `&`) gives the same answer from its spans: a row reaches the key
blocks its interval touches, and a block is full where every row of it sees the whole
block. Other masks are evaluated in row chunks of bounded memory, as `create_block_mask`
does, without holding the (B, H, L, S) tensor.

The result equals `create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=block_size)`:
blocks past L or S hold padding, never visible, so an edge block is never full.

From spans: the key blocks each row's `[lo, hi)` touches are counted per row block by a
difference array; a block is full where it lies inside L × S and its rows' largest `lo`
and smallest `hi` enclose it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnkit.masks.protocol import ReadableMask  # the mask's own methods only
from attnkit.masks.spans import CHUNK_ELEMENTS, exact_spans

__all__ = ["block_mask", "block_visibility", "mask_mod"]


def block_mask(
    mask: ReadableMask,
    B: int,
    H: int,
    L: int,
    S: int,
    *,
    block_size: int = 128,
    device: torch.device | str | None = None,
    broadcast: bool = False,
) -> Any:
    """FlexAttention's `BlockMask` of `mask` for (B, H, L, S): `Mask.to_block_mask`.
    `broadcast`: batch and head dims of 1 where the mask holds for any (flex broadcasts
    them; the flex backend's own block masks)."""
    from attnkit._compat import flex_attention_module

    flex = flex_attention_module()
    if flex is None:
        raise RuntimeError("Mask.to_block_mask needs FlexAttention (torch >= 2.5).")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}.")
    if min(B, H, L, S) < 1:
        raise ValueError(f"to_block_mask needs B, H, L, S >= 1, got {(B, H, L, S)}.")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    present, full = block_visibility(mask, B, H, L, S, block_size, dev)  # (B|1, H|1, nq, nkv)
    partial = present & ~full  # flex evaluates the mask there, and skips it on full ones
    shape = tuple(present.shape[:2]) if broadcast else (B, H)
    return flex.BlockMask.from_kv_blocks(
        *_ordered(partial, *shape),
        *_ordered(full, *shape),
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod(mask, B, H, L, S, dev),
        seq_lengths=(L, S),
    )


def _ordered(blocks: Tensor, B: int, H: int) -> tuple[Tensor, Tensor]:
    """Per row of blocks: how many are set, and their indices first (ascending, then the
    others): the kv_num_blocks and kv_indices of a `BlockMask`, as flex orders them."""
    dense = blocks.to(torch.int32)  # (B|1, H|1, nq, nkv)
    count = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    count = count.expand(B, H, -1).contiguous()  # (B, H, nq)
    return count, indices.expand(B, H, -1, -1).contiguous()  # (B, H, nq, nkv)


def block_visibility(
    mask: ReadableMask, B: int, H: int, L: int, S: int, block_size: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """(present, full), each (B|1, H|1, ⌈L/bs⌉, ⌈S/bs⌉) bool: some pair of the block
    is visible; every pair is (a block reaching past L or S never is: padding)."""
    mask.check(B, H, L, S)
    spans = exact_spans(mask, B, L, S, device)
    if spans is not None:
        present, full = _from_spans(*spans, L, S, block_size)  # (B|1, nq, nkv)
        return present[:, None], full[:, None]
    return _from_chunks(mask, B, H, L, S, block_size, device)


def _from_spans(lo: Tensor, hi: Tensor, L: int, S: int, bs: int) -> tuple[Tensor, Tensor]:
    """Blocks from each row's key interval [lo, hi) (B|1, L): O(B·L + blocks), no pair
    evaluated."""
    nq, nkv = math.ceil(L / bs), math.ceil(S / bs)
    device = lo.device
    index = torch.arange(L, device=device)
    batch = max(lo.shape[0], hi.shape[0])
    lo, hi = lo.expand(batch, L), hi.expand(batch, L)
    seen = lo < hi
    # the key blocks each row reaches, [first, stop), counted per row block by a
    # difference array over key blocks: +1 where a row's run starts, -1 past its end
    first = torch.where(seen, lo // bs, 0)
    stop = torch.where(seen, (hi - 1) // bs + 1, 0)
    row_block = (index // bs).expand_as(lo)  # (B|1, L)
    runs = torch.zeros(lo.shape[0], nq, nkv + 1, dtype=torch.int32, device=device)
    ones = seen.to(torch.int32)
    runs.view(lo.shape[0], -1).scatter_add_(1, row_block * (nkv + 1) + first, ones)
    runs.view(lo.shape[0], -1).scatter_add_(1, row_block * (nkv + 1) + stop, -ones)
    present = runs.cumsum(-1)[..., :nkv] > 0  # (B|1, nq, nkv)
    # full: every row of the block sees [c0, c0 + bs), and the block lies inside L × S
    pad = nq * bs - L
    lo_max = torch.nn.functional.pad(lo, (0, pad), value=S).view(-1, nq, bs).amax(-1)
    hi_min = torch.nn.functional.pad(hi, (0, pad), value=0).view(-1, nq, bs).amin(-1)
    starts = torch.arange(nkv, device=device) * bs  # (nkv,)
    inside = starts + bs <= S
    full = (lo_max[..., None] <= starts) & (hi_min[..., None] >= starts + bs) & inside
    return present, full


def _from_chunks(
    mask: ReadableMask, B: int, H: int, L: int, S: int, bs: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Blocks by evaluating the mask, a chunk of row blocks at a time (bounded memory)."""
    nq, nkv = math.ceil(L / bs), math.ceil(S / bs)
    step = max(1, CHUNK_ELEMENTS // (B * H * bs * nkv * bs))  # row blocks at once
    present: list[Tensor] = []
    full: list[Tensor] = []
    for start in range(0, nq, step):
        stop = min(nq, start + step)
        rows = torch.arange(start * bs, min(L, stop * bs), device=device)
        part = mask.dense(B, H, L, S, device, rows=rows)  # (B|1, H|1, R|1, S|1)
        part = part.expand(*part.shape[:2], len(rows), S)
        padding = (0, nkv * bs - S, 0, (stop - start) * bs - len(rows))  # never visible
        padded = torch.nn.functional.pad(part, padding)
        tiles = padded.view(*part.shape[:2], stop - start, bs, nkv, bs)  # (B|1, H|1, ...)
        present.append(tiles.any(-1).any(-2))
        full.append(tiles.all(-1).all(-2))
    return torch.cat(present, 2), torch.cat(full, 2)


def mask_mod(mask: ReadableMask, B: int, H: int, L: int, S: int, device: torch.device) -> Any:
    """The `Mask` as FlexAttention's mask_mod.

    Flex evaluates it on whole blocks, so with L or S not a multiple of the block size it
    asks about positions past the end: a predicate that indexes a tensor (document ids,
    per-row lengths, a tensor mask) would read out of bounds. Indices are clamped into
    range and those positions hidden.
    """
    predicate = mask.predicate(B, H, L, S, device)

    def mod(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        inside = (i < L) & (j < S)
        return inside & predicate(b, h, i.clamp(max=L - 1), j.clamp(max=S - 1))

    return mod
