"""The transformers surface of the differential harness: the mask bridge against
transformers' own dense mask, on every (b, i, j) pair.

A case is one mask creation as a model's forward asks for it: a kind of layer (causal,
sliding window, chunked, bidirectional, bidirectional window, packed documents), a
batch with left or right padding, and a cache (none; dynamic: S = past + L; static:
S = the cache's size, past its end are padding). `check(draw)` compares the `Mask`
that `attnkit.integrations.transformers.mask_function` returns with
`transformers.masking_utils.sdpa_mask` (no skip: always a tensor) and raises
AssertionError where they differ.
"""

from __future__ import annotations

import torch

from fuzz_cases import Draw

KINDS = ("causal", "sliding", "chunked", "bidirectional", "sliding_bidirectional", "packed")


def check(draw: Draw) -> str:
    """One random mask creation; returns its description (AssertionError if wrong)."""
    from transformers import masking_utils as mu

    from attnkit.integrations import transformers as akt

    kind = draw.choice(KINDS)
    B, L = draw.int(1, 3), draw.int(1, 24)
    cache = "none" if kind == "packed" else draw.choice(("none", "dynamic", "static"))
    past = 0 if cache == "none" else draw.int(0, 20)
    S = L + past + (draw.int(1, 8) if cache == "static" else 0)
    real = past + L  # tokens written so far, padding included
    size = draw.int(1, 6)
    side = draw.choice(("none", "left", "right"))
    pads = torch.tensor([draw.int(0, real - 1 if side != "none" else 0) for _ in range(B)])
    position = torch.arange(S)[None]  # (1, S)
    if side == "left":
        valid = position >= pads[:, None]
    elif side == "right":
        valid = position < (real - pads)[:, None]
    else:
        valid = position < real
    valid = (valid & (position < real)).expand(B, S).contiguous()  # (B, S); a static
    # cache's slots past the tokens written are padding
    local_size = None
    if kind == "causal":
        fn = mu.causal_mask_function
    elif kind == "sliding":
        fn, local_size = mu.sliding_window_causal_mask_function(size), size
    elif kind == "chunked":
        fn, local_size = (
            mu.chunked_causal_mask_function(
                size, pads if side == "left" else torch.zeros(B, dtype=torch.long)
            ),
            size,
        )
    elif kind == "bidirectional":
        fn = mu.bidirectional_mask_function
    elif kind == "sliding_bidirectional":
        fn, local_size = mu.sliding_window_bidirectional_mask_function(size), size
    else:
        cuts = sorted({draw.int(1, L) for _ in range(draw.int(0, 3))})
        ids = (torch.arange(L)[:, None] >= torch.tensor([0, *cuts])[None]).sum(-1) - 1
        fn = mu.packed_sequence_mask_function(ids.expand(B, L))
    text = (
        f"{kind}({size}) B={B} L={L} S={S} cache={cache} past={past} padding={side}{pads.tolist()}"
    )
    mask = akt.mask_function(
        B,
        L,
        S,
        q_offset=past,
        kv_offset=0,
        mask_function=fn,
        attention_mask=valid,
        local_size=local_size,
    )
    want = mu.sdpa_mask(
        B,
        L,
        S,
        past,
        0,
        fn,
        valid,
        local_size=local_size,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
    )  # (B, 1, L, S) bool
    want = torch.ones(B, 1, L, S, dtype=torch.bool) if want is None else want.expand(B, 1, L, S)
    got = torch.ones_like(want) if mask is None else mask.materialize(B, 1, L, S)
    wrong = (got != want).nonzero()
    assert not len(wrong), (
        f"{text}: {len(wrong)} pairs differ, first (b, h, i, j) {wrong[0].tolist()} (mask {mask})"
    )
    return text
