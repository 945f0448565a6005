"""flash-attention's KV cache and `flash_attn_with_kvcache` (re-exported by
`attnkit.flash_attn`), which keeps it: each sequence's rows of (B_cache, S_cache, Hkv,
D), or its pages (pages, page_size, Hkv, D) through a `block_table`. Its lengths, the
new keys written in place, each sequence's history read (rows, or pages gathered in
table order), and a decoding step read in place by the registry's paged kernel
(`Backend.paged_decode`: `native`, where it is built). Every `block_table` and cache
length is checked before anything is read or written (`check_block_table`,
`check_cache_room`). Last, the packed forms' views (`unpacked`) and flash-attention's
rotary embedding (`rotate`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit import runtime
from attnkit.backends.protocol import PagedDecode
from attnkit.dropins.packed import Window, attend_spans, flash_window, spans_mask, window_spans
from attnkit.errors import BlockTableError, ShapeContractError

__all__ = [
    "cache_lengths",
    "check_block_table",
    "check_cache_room",
    "decode_pages",
    "flash_attn_with_kvcache",
    "pool_size",
    "read_cache",
    "rotate",
    "slots",
    "unpacked",
    "write_new",
]


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
    (B,) of its pages, by the registry's paged kernel (`Backend.paged_decode`), which
    reads them in place (no gather of the history; a sequence's result does not depend
    on the others): out (B, 1, H, Dv) and lse (B, H, 1); None where no backend has one
    for it (not built, another device or dtype) or the pages are no view of one slot
    axis."""
    pages, page_size = pool_size(k_cache)
    try:  # (pages, page_size, Hkv, D) -> (slots, Hkv, D), without a copy
        keys, values = (t.view(pages * page_size, *t.shape[2:]) for t in (k_cache, v_cache))
    except RuntimeError:
        return None
    B, width = block_table.shape
    D = q.shape[-1]
    problem = PagedDecode(
        q[:, 0],
        keys,
        values,
        block_table.reshape(-1),
        torch.arange(B, device=block_table.device) * width,
        lo,
        hi,
        page_size,
        D**-0.5 if scale is None else scale,
        softcap,
    )
    with torch.no_grad():
        result = runtime.current().backends.paged_decode(problem)  # (B, H, Dv), (B, H)
    if result is None:
        return None
    out, lse = result
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
    return k_cache[pages].flatten(1, 2), v_cache[pages].flatten(1, 2)


def check_block_table(
    call: str, block_table: Tensor, lengths: Tensor, pool: tuple[int, int], named: str
) -> None:
    """Refuse, before anything is read or written, a sequence longer than its row of
    `block_table` holds (max_pages · page_size), or a used entry (one of the first
    ceil(length / page_size) of its row) that is no page of the pool.

    Args:
        call: the public function, for the message.
        block_table: (N, max_pages) page ids.
        lengths: (N,) positions each sequence reads or writes, from position 0.
        pool: (pages, page_size) of the paged keys.
        named: where the lengths come from, `{n}` standing for the sequence and
            `{next}` for n + 1 ("seqused_k[{n}]").
    Raises:
        BlockTableError: naming `block_table`, the sequence, its length, the capacity
            and the fix.
    """
    if torch.compiler.is_compiling():  # data-dependent: eager calls only
        return
    N, (pages, page_size) = lengths.shape[0], pool
    if block_table.dim() != 2 or block_table.shape[0] < N:
        raise BlockTableError(
            f"{call}: block_table must be (N, max_pages) with a row per sequence ({N}), got "
            f"{tuple(block_table.shape)}; give one row of page ids per sequence"
        )
    lengths = lengths.long().cpu()  # (N,)
    _check_capacity(call, block_table.shape[1], page_size, lengths, named)
    count = (lengths + page_size - 1) // page_size  # (N,) entries in use
    ids = block_table[:N].long().cpu()  # (N, max_pages)
    used = torch.arange(ids.shape[1]) < count[:, None]  # (N, max_pages)
    bad = (used & ((ids < 0) | (ids >= pages))).nonzero()
    if bad.numel():
        n, p = int(bad[0, 0]), int(bad[0, 1])
        raise BlockTableError(
            f"{call}: block_table[{n}, {p}] = {int(ids[n, p])} is no page of the pool (ids 0 "
            f"to {pages - 1}: {_counted(pages, 'page')}), and sequence {n} uses the first "
            f"{_counted(int(count[n]), 'entry')} of its row for its {int(lengths[n])} positions "
            f"({named.format(n=n, next=n + 1)}); give ids of the pool's pages"
        )


def _check_capacity(call: str, width: int, page_size: int, lengths: Tensor, named: str) -> None:
    """Each length (N,) within the width · page_size positions a row of the table holds."""
    too_long = (lengths > width * page_size).nonzero()
    if too_long.numel():
        n = int(too_long[0, 0])
        length, name = int(lengths[n]), named.format(n=n, next=n + 1)
        raise BlockTableError(
            f"{call}: sequence {n} has {length} positions ({name}), but block_table lists "
            f"{_counted(width, 'page')} of {page_size} slots per row ({width * page_size} "
            f"positions); give block_table at least {-(-length // page_size)} pages per row "
            f"(more pages for sequence {n})"
        )


def check_cache_room(ends: Tensor, S_cache: int, new: int) -> None:
    """`flash_attn_with_kvcache` without `block_table`: each sequence's keys must fit the
    cache's S_cache positions (checked before any write; eager calls: lengths are data)."""
    if torch.compiler.is_compiling() or not bool((ends > S_cache).any()):
        return
    b = int((ends > S_cache).nonzero()[0, 0])
    raise ShapeContractError(
        f"flash_attn_with_kvcache: sequence {b} needs {int(ends[b])} cache positions "
        f"(cache_seqlens[{b}] = {int(ends[b]) - new} + {new} new keys) but k_cache holds "
        f"S_cache={S_cache}; give a longer cache, or fewer positions in cache_seqlens"
    )


def _counted(n: int, word: str) -> str:
    """'1 page', '2 pages', '1 entry', '3 entries'."""
    plural = word[:-1] + "ies" if word.endswith("y") else word + "s"
    return f"{n} {word if n == 1 else plural}"


# ------------------------------------------------------ flash-attention's call on its cache


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Any:
    """flash-attention's `flash_attn_with_kvcache`: write the new keys into a cache in
    place and attend to it (decoding). No backward, as in flash-attention.

    The keys of sequence b are cache positions cache_leftpad[b] .. cache_seqlens[b] +
    L_new - 1; its queries sit at the last L of them (bottom-right).

    Args:
        q: (B, L, H, D) queries.
        k_cache: (B_cache, S_cache, Hkv, D) keys, or with `block_table` pages
            (pages, page_size, Hkv, D); written in place.
        v_cache: (B_cache, S_cache, Hkv, Dv), laid out as `k_cache`.
        k: (B, L_new, Hkv, D) new keys, written at positions cache_seqlens[b].. of each
            sequence, then attended with the rest (default None: none).
        v: (B, L_new, Hkv, Dv) new values, with `k` (default None).
        rotary_cos: (S_ro, rotary_dim / 2) rotary table: rotates the new keys at their
            positions, and q at cache_seqlens.. (causal or local) or all at
            cache_seqlens (default None: no rotation).
        rotary_sin: (S_ro, rotary_dim / 2), with `rotary_cos`.
        cache_seqlens: int or (B,) int32 tokens each sequence holds before the call
            (default None: 0).
        cache_batch_idx: (B,) int the cache row of each sequence (default None: b).
        cache_leftpad: (B,) int each sequence's first cache position (default None: 0).
        block_table: (B, max_pages) int32 page ids of each sequence (default None).
        softmax_scale: as in `flash_attn_func`.
        causal: as in `flash_attn_func`.
        window_size: as in `flash_attn_func`.
        softcap: as in `flash_attn_func`.
        rotary_interleaved: pair dims (0, 1), (2, 3), ... (default True), else (0,
            rotary_dim / 2), ... (GPT-NeoX).
        alibi_slopes: as in `flash_attn_func`.
        num_splits: accepted and not used (default 0).
        return_softmax_lse: also return the log-sum-exp (default False).

    Returns:
        out (B, L, H, Dv) in q's dtype; with `return_softmax_lse`, `(out, lse)`, lse
        (B, H, L) float32 (float64 for float64). Both contiguous.

    Raises:
        ShapeContractError: without `block_table`, a sequence whose keys pass S_cache.
        BlockTableError: with it, cache_seqlens[b] + L_new past max_pages · page_size,
            or a used page id outside the pool. Both before any write.

    Examples:
        >>> from attnkit.flash_attn import flash_attn_with_kvcache
        >>> k_cache, v_cache = torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8)
        >>> held = torch.tensor([3, 5], dtype=torch.int32)  # tokens already cached
        >>> q = torch.randn(2, 1, 4, 8)  # one new token a sequence: (B, L, H, D)
        >>> k, v = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
        >>> out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=held,
        ...                               causal=True)
        >>> out.shape  # (B, L, H, Dv)
        torch.Size([2, 1, 4, 8])
        >>> torch.equal(k_cache[1, 5], k[1, 0])  # written in place, after the 5 held
        True
    """
    B, L = q.shape[0], q.shape[1]
    dev = q.device
    rows_held = k_cache.shape[1] if block_table is None else None
    seqlens = cache_lengths(cache_seqlens, B, rows_held, dev)
    new = 0 if k is None else k.shape[1]
    if block_table is not None:  # before any write
        named = "cache_seqlens[{n}]" + (f" + {new} new keys" if new else "")
        check_block_table(
            "flash_attn_with_kvcache", block_table, seqlens + new, pool_size(k_cache), named
        )
    else:
        check_cache_room(seqlens + new, k_cache.shape[1], new)
    if rotary_cos is not None and rotary_sin is not None:
        local = causal or tuple(window_size) != (-1, -1)
        q_at = seqlens[:, None] + (torch.arange(L, device=dev)[None] if local else 0)
        q = rotate(q, rotary_cos, rotary_sin, q_at.expand(B, L), rotary_interleaved)
        if k is not None:
            k_at = seqlens[:, None] + torch.arange(new, device=dev)[None]
            k = rotate(k, rotary_cos, rotary_sin, k_at, rotary_interleaved)
    rows = torch.arange(B, device=dev) if cache_batch_idx is None else cache_batch_idx.long()
    if k is not None and v is not None:
        write_new(k_cache, v_cache, k, v, seqlens, rows, block_table)
    end = (seqlens + new)[:, None]  # (B, 1)
    first = (
        torch.zeros(B, dtype=torch.long, device=dev)
        if cache_leftpad is None
        else cache_leftpad.long().to(dev)
    )[:, None]
    index = torch.arange(L, device=dev)[None].expand(B, L)
    spans = window_spans(first, end - first, L, index, flash_window(causal, window_size))
    if block_table is not None and L == 1 and alibi_slopes is None:
        lo, hi = spans.lo[:, 0], spans.hi[:, 0]
        decoded = decode_pages(q, k_cache, v_cache, block_table, lo, hi, softmax_scale, softcap)
        if decoded is not None:
            return decoded if return_softmax_lse else decoded[0]
    keys, values = read_cache(k_cache, v_cache, rows, block_table, end)  # (B, S, Hkv, D)
    mask = spans_mask(spans, alibi_slopes, q.dtype)
    with torch.no_grad():
        out, lse = attend_spans(
            q.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            mask,
            softmax_scale,
            softcap,
            0.0,
        )
    out = out.transpose(1, 2).contiguous()  # (B, L, H, Dv)
    return (out, lse.contiguous()) if return_softmax_lse else out


# ------------------------------------------------------ flash-attention's packed forms and rotary


def unpacked(call: str, name: str, packed: Tensor, dim: int, layout: str) -> tuple[Tensor, ...]:
    """The views of `packed` along `dim` (3 for qkv, 2 for kv), after checking that the
    layout's packed dim has that size; autograd takes their gradients back into it."""
    count = len(name)  # qkv: 3, kv: 2
    if packed.dim() != dim + 3 or packed.shape[dim] != count:  # (..., count, H, D)
        raise ShapeContractError(
            f"{call}: {name} must be {layout} ({count} at dim {dim}), got "
            f"{tuple(packed.shape)}; stack the tensors with torch.stack(..., dim={dim})"
        )
    return packed.unbind(dim)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of the first rotary_dim = 2·cos.shape[1] dims of x (B, n, H, D) at
    `positions` (B, n), flash-attention's convention (interleaved: pairs (0, 1), (2, 3),
    ...; else (0, rotary_dim / 2), (1, rotary_dim / 2 + 1), ...)."""
    half = cos.shape[1]
    c, s = (t[positions][:, :, None].to(torch.float32) for t in (cos, sin))  # (B, n, 1, half)
    rot, rest = x[..., : 2 * half].float(), x[..., 2 * half :]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        turned = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    return torch.cat([turned.to(x.dtype), rest], dim=-1)
