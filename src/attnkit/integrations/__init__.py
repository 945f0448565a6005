"""attnkit inside other libraries (optional dependencies, imported on demand).

`attnkit.integrations.transformers.register()` makes `attn_implementation="attnkit"` work
in Hugging Face transformers, keeping the mask's structure.

What an integration shares, here, without importing its host library: `structure`
finds the structured `Mask` equal to a host's mask function (FlexAttention's
`mask_mod(b, h, q_idx, kv_idx)` convention, as transformers' mask functions follow it)
on every pair, so a backend can skip what the mask hides (re-exported by
`attnkit.integrations.transformers`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnkit.masks import Mask, causal, chunked, document, sliding_window
from attnkit.masks.spans import exact_spans

__all__ = ["CHECK_ELEMENTS", "ModFn", "structure"]

CHECK_ELEMENTS = 1 << 22  # mask entries compared at once when checking a structure

ModFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def structure(
    fn: ModFn, B: int, L: int, S: int, *, shift: int = 0, local_size: int | None = None
) -> tuple[bool, Mask | None]:
    """The structured `Mask` equal to a mask function on every pair, if one is.

    Candidates, from the arguments and a probe of `fn` along the diagonal: causal with
    the cache's offset (`j <= i + shift`), with `local_size` a causal sliding window
    (`left = local_size - 1`), chunks & causal and a bidirectional window, no mask, and
    packed documents under each (a row that cannot see the key just before its own
    starts a document). All are compared with `fn` on all B·L·S pairs, in row chunks of
    4M entries (about 0.1 s at L = S = 4096 on 2 cores); the first that agrees
    everywhere wins.

    Args:
        fn: `fn(b, h, i, j) -> bool` over local indices, called with broadcast index
            tensors (transformers' mask_function convention); must not depend on h.
        B: batch size.
        L: query length.
        S: key length.
        shift: the queries' offset among the keys, q_offset - kv_offset (default 0).
        local_size: a window or chunk size to try (default None: none).

    Returns:
        `(True, mask)` with the `Mask` (or None: every query sees every key), or
        `(False, None)` where no structure fits.

    Examples:
        >>> import attnkit.integrations.transformers as akt
        >>> akt.structure(lambda b, h, i, j: j <= i, 1, 6, 6)
        (True, Mask[causal(offset=0)])
        >>> akt.structure(lambda b, h, i, j: (j <= i) & (j > i - 3), 1, 6, 6, local_size=3)
        (True, Mask[sliding_window(left=2, right=0, offset=0)])
        >>> akt.structure(lambda b, h, i, j: (i + j) % 2 == 0, 1, 6, 6)  # no structure
        (False, None)
    """
    if B * L * S == 0:
        return True, None
    base: list[Mask | None] = [causal(offset=shift)]
    if local_size is not None and local_size >= 1:
        base = [
            *base,
            sliding_window(local_size - 1, offset=shift),
            chunked(local_size, offset=shift) & causal(offset=shift),
            sliding_window(local_size, local_size, offset=shift),
        ]
    base.append(None)  # no mask at all
    ids = _documents(fn, B, L, S, shift)
    packed = [] if ids is None else [ids if m is None else m & ids for m in base]
    return _first_equal(fn, [*base, *packed], B, L, S)


def _documents(fn: ModFn, B: int, L: int, S: int, shift: int) -> Mask | None:
    """Packed documents when L == S and shift == 0: row i starts one where it cannot
    see key i - 1 (every pattern transformers builds lets it, within a document)."""
    if L != S or shift != 0 or L < 2:
        return None
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    i = torch.arange(1, L).view(1, 1, L - 1, 1)
    sees_previous = fn(b, h, i, i - 1).reshape(-1, L - 1).expand(B, L - 1)  # (B, L-1)
    if bool(sees_previous.all()):
        return None
    starts = torch.cat([torch.ones(B, 1, dtype=torch.bool), ~sees_previous], dim=1)
    return document(starts.long().cumsum(1))  # (B, L) ids


def _first_equal(
    fn: ModFn, candidates: list[Mask | None], B: int, L: int, S: int
) -> tuple[bool, Mask | None]:
    alive = list(range(len(candidates)))
    rows_at_once = max(1, CHECK_ELEMENTS // max(1, B * S))
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    j = torch.arange(S).view(1, 1, 1, S)
    # a first short chunk from the end (where windows, chunks and documents all show)
    # rules out most candidates cheaply; then the rest in chunks of bounded memory
    tail = max(0, L - 32)
    chunks = [(tail, L)] + [(a, min(tail, a + rows_at_once)) for a in range(0, tail, rows_at_once)]
    for start, end in chunks:
        rows = torch.arange(start, end)
        want = fn(b, h, rows.view(1, 1, -1, 1), j).expand(B, 1, len(rows), S)  # (B, 1, R, S)
        alive = [n for n in alive if _agrees(candidates[n], want, rows, L)]
        if not alive:
            return False, None
    return True, candidates[alive[0]]


def _agrees(mask: Mask | None, want: Tensor, rows: Tensor, L: int) -> bool:
    """`mask` on `rows` equals `want` (B, 1, R, S); None means every pair is visible.
    Exact key spans (one interval a row) compare against the spans directly."""
    if mask is None:
        return bool(want.all())
    B, _, _, S = want.shape
    spans = exact_spans(mask, B, L, S)
    if spans is not None:
        lo, hi = spans[0][:, rows], spans[1][:, rows]  # (B|1, R)
        j = torch.arange(S)
        inside = (j >= lo[..., None]) & (j < hi[..., None])  # (B|1, R, S)
        return torch.equal(inside[:, None].expand_as(want), want)
    return torch.equal(mask.dense(B, 1, L, S, rows=rows).expand_as(want), want)
