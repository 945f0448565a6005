"""What backends read from a mask, derived in one place from its primitives.

A kind states its predicate, its key spans and its bias (`base.Mask`); from those come
the pairs it lets attend (`count_allowed_pairs`), the keys a tile of
query rows may see (`key_bounds`), the rows and keys anybody sees (`seen`), whether
the mask is SDPA's own `is_causal` (`is_sdpa_causal`), whether some part is an L×S
tensor (`has_dense_tensor`), the bias as a tensor (`dense_bias`), what caches key
on: its value (`value_key`), and the make-up a call is cut or routed by: packed
documents (`packed_documents`), a decoding step's key padding (`key_paddings`), a window
over a cache (`trailing_window`). Nothing outside `masks` reads a kind's class.

Costs: `key_bounds` is a sparse table of minima over the rows' spans; `seen` is O(B·(L +
S)) from exact spans, else row chunks; `is_sdpa_causal` is O(1) where a kind knows, else
compared row by row through the spans of a mask holding no tensors.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit.masks.base import Combined, Mask, _TensorMask, conjuncts, given_tensor, indices
from attnkit.masks.positions import _Causal, _SlidingWindow
from attnkit.masks.spans import CHUNK_ELEMENTS, exact_spans, seen_from_spans, tile_bounds
from attnkit.masks.tokens import _Document, _KeyPadding

__all__ = [
    "count_allowed_pairs",
    "dense_bias",
    "has_dense_tensor",
    "is_sdpa_causal",
    "key_bounds",
    "key_paddings",
    "packed_documents",
    "parts",
    "seen_rows_keys",
    "trailing_window",
    "value_key",
]


def count_allowed_pairs(
    mask: Mask | None, B: int, H: int, L: int, S: int, device: torch.device | None = None
) -> int:
    """Query-key pairs (over B and H) the mask lets attend, counted in row chunks."""
    if mask is None:
        return B * H * L * S
    spans = exact_spans(mask, B, L, S, device)
    if spans is not None:  # one key interval per row
        lo, hi = spans  # (B|1, L)
        return int((hi - lo).clamp(min=0).sum()) * (B // lo.shape[0]) * H
    chunk = max(1, CHUNK_ELEMENTS // max(1, B * H * S))
    total = 0
    for start in range(0, L, chunk):
        rows = torch.arange(start, min(L, start + chunk), device=device)
        part = mask.dense(B, H, L, S, device, rows=rows)  # (B|1, H|1, rows|1, S|1)
        full = (B, H, rows.numel(), S)  # a broadcast dim counts once per position it covers
        total += int(part.sum()) * math.prod(n // m for n, m in zip(full, part.shape, strict=True))
    return total


def key_bounds(
    mask: Mask, B: int, L: int, S: int, first: Tensor, last: Tensor
) -> tuple[Tensor, Tensor]:
    """Key span `[lo, hi)` holding every key visible to query rows `first..last`.

    `first`, `last`: (T,) row ranges (of query tiles). Returns `lo`, `hi` of shape
    (B|1, T), the hull of the rows' spans (all S keys where the mask has none): it may
    be loose (a superset); the tiled backend masks inside it exactly.
    """
    return tile_bounds(mask.key_spans(B, L, S, first.device), L, S, first, last)


def seen_rows_keys(
    mask: Mask, B: int, H: int, L: int, S: int, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """Which query rows see some key, (B, H|1, L), and which keys some query row of
    their head sees, (B, H|1, S) (H only for a `head_dependent` mask).

    Backends zero the rest (they may hold NaN or Inf). Exact spans take O(B·L);
    otherwise the mask is evaluated in row chunks.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    spans = exact_spans(mask, B, L, S, dev)
    if spans is not None:
        lo, hi = (t.expand(B, L) for t in spans)
        rows, keys = seen_from_spans(lo, hi, S)
        return rows[:, None], keys[:, None]
    heads = H if mask.head_dependent else 1
    rows = torch.zeros(B, heads, L, dtype=torch.bool, device=dev)
    keys = torch.zeros(B, heads, S, dtype=torch.bool, device=dev)
    chunk = max(1, CHUNK_ELEMENTS // max(1, B * heads * S))
    for start in range(0, L, chunk):
        index = torch.arange(start, min(L, start + chunk), device=dev)
        part = mask.dense(B, H, L, S, dev, rows=index)[:, :heads]  # (B|1, H|1, R|1, S|1)
        rows[:, :, index] = part.any(-1)
        keys |= part.any(-2)
    return rows, keys


def is_sdpa_causal(mask: Mask, L: int, S: int) -> bool:
    """True if `mask` is exactly SDPA's `is_causal=True` with every key seen: top-left
    causal with L >= S (no empty row, no key hidden from all queries) and no bias.

    The kinds that know answer in O(1); a mask holding no tensors (a window of one)
    is compared row by row through its spans; one holding tensors is not."""
    answer = mask._sdpa_causal(L, S)
    if answer is not None:
        return answer
    if L < S or mask.has_bias or mask.tensors():
        return False
    spans = exact_spans(mask, 1, L, S)
    if spans is None:
        return False
    lo, hi = spans
    return bool((lo == 0).all() and (hi == (torch.arange(L) + 1).clamp(max=S)).all())


def parts(mask: Mask) -> list[Mask]:
    """`mask` and every mask inside it (the parts of `&`, `|`, `~` and windows)."""
    every = [mask]
    for value in mask._fields().values():
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, Mask):
                every.extend(parts(item))
    return every


def has_dense_tensor(mask: Mask) -> bool:
    """True if some part is an L×S tensor mask (its predicate gathers, block by block)."""
    return any(isinstance(p, _TensorMask) for p in parts(mask))


def dense_bias(
    mask: Mask,
    B: int,
    H: int,
    L: int,
    S: int,
    device: torch.device | str | None = None,
    rows: Tensor | None = None,
) -> Tensor | None:
    """The bias as the smallest float tensor broadcastable to (B, H, L|R, S), or None."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    fn = mask.bias(B, H, L, S, dev)
    if fn is None:
        return None
    b, h, i, j = indices(B, H, L, S, dev, rows, None)
    value = fn(b, h, i, j)
    return value.reshape((1,) * (4 - value.dim()) + tuple(value.shape))


def value_key(
    value: object, objects: list[object] | None = None, *, part: bool = False
) -> tuple[object, ...] | None:
    """A hashable value equal for masks that behave alike: each mask's class and fields,
    each number with its type (True is not 1). With `objects`, a tensor joins the key by
    its identity (its contents are the fit's: identity and version; a tensor mask's only
    where it holds the caller's tensor itself, not a copy) and is appended to `objects`,
    and so does a `part` (a mask inside a window, `&`, `|`, `~`) that has no value of its
    own, itself: the key is that mask's while those objects live (its keeper checks they
    are the same). A function is never a value (it may read data that changes in place), so a
    mask holding one at its top has no value key (None), nor one holding anything else.
    """
    if isinstance(value, Mask):
        given = given_tensor(value)
        fields = value._fields()
        if given is not None and given is getattr(value, "tensor", None):
            fields = {"tensor": given}  # the caller's own: found again by it
        keyed = []
        for name in sorted(fields):
            inner = value_key(fields[name], objects, part=True)
            if inner is None:
                if part and objects is not None:  # this part, by its identity
                    objects.append(value)
                    return (object, id(value))
                return None
            keyed.append((name, inner))
        return (type(value), *keyed)
    if isinstance(value, tuple):
        parts = [value_key(p, objects, part=part) for p in value]
        return None if any(p is None for p in parts) else (tuple, *parts)
    if value is None or type(value) in (bool, int, float, str):
        return (type(value), value)
    if objects is not None and isinstance(value, Tensor):
        objects.append(value)
        return (object, id(value))
    return None


def packed_documents(mask: object) -> tuple[Tensor, list[Mask]] | None:
    """Where `mask` is one self-attention `document(ids)` with sorted ids (each document
    one run of positions), alone or `&` masks that depend only on `j - i` (`causal`,
    `sliding_window`, any alignment or offset): the ids, (B|1, L), and those other
    parts; else None. O(1) for a mask of another kind (every call asks)."""
    if not isinstance(mask, (Combined, _Document)):
        return None  # (a document mask is one, or one part of an `&`)
    parts = conjuncts(mask)
    docs = [p for p in parts if isinstance(p, _Document)]
    inner = [p for p in parts if not isinstance(p, _Document)]
    if len(docs) != 1 or not all(isinstance(p, (_Causal, _SlidingWindow)) for p in inner):
        return None
    if docs[0].kv_ids is not None or not docs[0]._sorted():
        return None
    return docs[0].q_ids, inner


def key_paddings(mask: Mask) -> tuple[list[Mask], list[Mask]]:
    """The `key_padding` parts of `mask`'s `&` (or `mask` itself), and the other parts."""
    parts = conjuncts(mask)
    paddings: list[Mask] = [p for p in parts if isinstance(p, _KeyPadding)]
    return paddings, [p for p in parts if not isinstance(p, _KeyPadding)]


def trailing_window(mask: Mask) -> int | None:
    """`left` where `mask` is `sliding_window(left)` read from the end of the keys (no
    alignment or bottom-right, no right side, no offset): each query sees its own
    position and the `left` before it, as over a cache. None for any other mask."""
    if (
        isinstance(mask, _SlidingWindow)
        and mask.right == 0
        and mask.align in (None, "bottom_right")
        and mask.offset is None
    ):
        return mask.left
    return None
