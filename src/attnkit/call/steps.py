"""Decoding steps: one plan for a cache that grows.

A decoding step asks few queries (at most `DECODE_ROWS`) of many keys, once per token,
with one more key each time. Two kinds are recognised by the mask's structure alone:

- a *dense* step, where every query sees every key (no mask, or bottom-right causal at
  L = 1): the same unmasked kernel serves it;
- a *padded* step, one query a row under an `&` of masks that see every key and key
  paddings (`key_padding`, `from_hf_attention_mask`): a row sees the real tokens of
  its batch row, whatever the query (transformers' left-padded `generate`).

`auto` runs a step on a backend chosen by a rule (`Backend.takes_step`), not priced
per call: the rule reads the sizes, dtypes and device and the key length S only by its
`bucket`, the power of two at or above it. So the choice is the same for every step
of a bucket (one plan serves a cache growing from 513 keys to 1,024) and for the same
call in every process (a step planned afresh chooses as the plan that served it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from attnkit.masks import Mask, and_masks
from attnkit.masks.structure import key_paddings

if TYPE_CHECKING:
    from attnkit.contracts import AttentionCall

__all__ = ["DECODE_ROWS", "StepKind", "bucket", "step_kind", "step_of", "step_padding"]

DECODE_ROWS = 16  # a call of at most this many queries is a decoding step's size

StepKind = Literal["dense", "padded"]


def bucket(S: int) -> int:
    """The power of two at or above S (S >= 1): what a step's rule reads of S."""
    return 1 << max(S - 1, 0).bit_length()


def step_kind(mask: Mask | None, L: int, S: int) -> StepKind | None:
    """ "dense" or "padded" where a call of L queries and S keys under `mask` (a bias
    none: the caller checks) is a decoding step, else None. O(number of parts): the
    masks' tensors are not read."""
    if L > DECODE_ROWS or S < 1:
        return None
    if mask is None or mask.sees_all(L, S):
        return "dense"
    if L != 1 or mask.has_bias:
        return None
    return "padded" if step_padding(mask, L, S) is not None else None


def step_padding(mask: Mask, L: int, S: int) -> Mask | None:
    """The key paddings of a padded step's mask, which alone decide what it sees (every
    other part of its `&` sees every key), or None where the mask is not one."""
    paddings, others = key_paddings(mask)
    if not paddings or not all(p.sees_all(L, S) for p in others):
        return None
    return paddings[0] if len(paddings) == 1 else and_masks(*paddings)


def step_of(call: AttentionCall) -> StepKind | None:
    """`step_kind` of a validated call (None with a bias of any kind)."""
    if call.has_bias:
        return None
    return step_kind(call.mask, call.dims.L, call.dims.S)
