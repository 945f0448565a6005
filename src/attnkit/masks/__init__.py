"""Masks as composable predicates: `True` = query `i` may attend to key `j`, everywhere.

A `Mask` is a rule over index tensors `(b, h, i, j)`, not a stored L×S matrix. It is
evaluated by broadcasting `arange`s, so a causal mask over L=S=4 costs a (1, 1, 4, 4)
tensor and a key-padding mask a (B, 1, 1, S) one, and nothing needs to build the full
(B, H, L, S) tensor unless asked to (`materialize`).

Conventions ([Design §2][2-semantics-that-never-change]):
- causal alignment `top_left`: `j <= i`; `bottom_right`: `j <= i + (S - L)`. They agree
  when L == S; when L != S you must choose one, attnkit never guesses.
- `sliding_window(left, right)` is inclusive: a query sees `left + 1 + right` keys.
- other conventions enter only through the converters `from_key_padding_mask`,
  `from_hf_attention_mask` and `from_additive_mask`.
"""

from attnkit.masks.base import Align, Mask, Predicate, and_masks, as_mask, or_masks
from attnkit.masks.biases import alibi, alibi_bias, alibi_slopes
from attnkit.masks.checks import (
    causal_offset,
    check_broadcastable,
    integer_mask_error,
)
from attnkit.masks.convert import (
    from_additive_mask,
    from_hf_attention_mask,
    from_key_padding_mask,
)
from attnkit.masks.positions import causal, chunked, prefix_lm, sliding_window
from attnkit.masks.tokens import document, key_padding, row_spans

__all__ = [
    "Align",
    "Mask",
    "Predicate",
    "alibi",
    "alibi_bias",
    "alibi_slopes",
    "and_masks",
    "as_mask",
    "causal",
    "causal_offset",
    "check_broadcastable",
    "chunked",
    "document",
    "from_additive_mask",
    "from_hf_attention_mask",
    "from_key_padding_mask",
    "integer_mask_error",
    "key_padding",
    "or_masks",
    "prefix_lm",
    "row_spans",
    "sliding_window",
]
