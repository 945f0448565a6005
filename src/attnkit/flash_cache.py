"""flash-attention's KV cache as `flash_attn_with_kvcache` keeps it: each sequence's rows
of (B_cache, S_cache, Hkv, D), or its pages (pages, page_size, Hkv, D) through a
`block_table`. Its lengths, the new keys written in place, each sequence's history read
(rows, or pages gathered in table order), and a decoding step read in place by
attnkit's paged kernel (`attnkit.native`) where it is built.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.native import ops as native_ops
from attnkit.native import unavailable as native_unavailable

__all__ = ["cache_lengths", "decode_pages", "pool_size", "read_cache", "slots", "write_new"]


def decode_pages(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    lo: Tensor,
    hi: Tensor,
    scale: float | None,
    softcap: float,
) -> tuple[Tensor, Tensor] | None:
    """One new query per sequence (B, 1, H, D) against the keys at positions [lo, hi)
    (B,) of its pages, on attnkit's paged kernel, which reads them in place (no gather of
    the history; a sequence's result does not depend on the others): out (B, 1, H, Dv)
    and lse (B, H, 1); None where the kernel cannot run (not built, another device or
    dtype, pages that are no view of one slot axis)."""
    if q.device.type != "cpu" or q.dtype not in native_ops.DTYPES:
        return None
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype or native_unavailable() is not None:
        return None
    pages, page_size = pool_size(k_cache)
    try:  # (pages, page_size, Hkv, D) -> (slots, Hkv, D), without a copy
        keys, values = (t.view(pages * page_size, *t.shape[2:]) for t in (k_cache, v_cache))
    except RuntimeError:
        return None
    B, width = block_table.shape
    D = q.shape[-1]
    with torch.no_grad():
        out, lse = native_ops.paged_decode(
            q[:, 0], keys, values, block_table.reshape(-1).cpu(),
            torch.arange(B) * width, lo.cpu(), hi.cpu(), page_size,
            D**-0.5 if scale is None else scale, softcap,
        )  # fmt: skip  # (B, H, Dv), (B, H)
    return out[:, None], lse[:, :, None]


def pool_size(paged: Tensor) -> tuple[int, int]:
    """(pages, page_size) of paged keys (pages, page_size, Hkv, D)."""
    return paged.shape[0], paged.shape[1]


def cache_lengths(
    cache_seqlens: int | Tensor | None, B: int, cache_len: int | None, device: torch.device
) -> Tensor:
    """(B,) cached positions per sequence (before the new keys)."""
    if cache_seqlens is None:
        if cache_len is None:
            raise ValueError("flash_attn_with_kvcache with block_table needs cache_seqlens")
        return torch.full((B,), cache_len, dtype=torch.long, device=device)
    if isinstance(cache_seqlens, int):
        return torch.full((B,), cache_seqlens, dtype=torch.long, device=device)
    return cache_seqlens.long().to(device).expand(B)


def slots(
    positions: Tensor, rows: Tensor, block_table: Tensor | None, page_size: int
) -> tuple[Tensor, Tensor]:
    """(B, n) cache positions of each sequence -> the (first, second) indices of the
    cache tensors: (batch row, position), or with pages (page, slot)."""
    if block_table is None:
        return rows[:, None].expand_as(positions), positions
    pages = block_table.long().gather(1, positions // page_size)
    return pages, positions % page_size


def write_new(
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor,
    v: Tensor,
    seqlens: Tensor,
    rows: Tensor,
    block_table: Tensor | None,
) -> None:
    """New keys and values (B, n, Hkv, D) into the cache at positions seqlens.., in place."""
    positions = seqlens[:, None] + torch.arange(k.shape[1], device=k.device)[None]  # (B, n)
    first, second = slots(positions, rows, block_table, k_cache.shape[1])
    k_cache[first, second] = k.to(k_cache.dtype)
    v_cache[first, second] = v.to(v_cache.dtype)


def read_cache(
    k_cache: Tensor, v_cache: Tensor, rows: Tensor, block_table: Tensor | None, end: Tensor
) -> tuple[Tensor, Tensor]:
    """Each sequence's cache (B, S, Hkv, D): its rows, or its pages in table order (the
    entries past a sequence's `end` (B, 1) positions, which nobody reads, as page 0: flash-
    attention does not read them either, so they may hold anything)."""
    if block_table is None:
        return k_cache[rows], v_cache[rows]
    page_size, width = k_cache.shape[1], block_table.shape[1]
    used = torch.arange(width, device=end.device) * page_size < end  # (B, max_pages)
    pages = torch.where(used.to(block_table.device), block_table.long(), 0)  # (B, max_pages)
    return tuple(t[pages].flatten(1, 2) for t in (k_cache, v_cache))  # type: ignore[return-value]
