"""flash-attention 2's functions with their signatures, on attnkit (CPU included).

`flash_attn_func`, `flash_attn_varlen_func` and `flash_attn_with_kvcache` as the
`flash_attn` package defines them, and its packed forms `flash_attn_qkvpacked_func`
(qkv (B, L, 3, H, D)), `flash_attn_kvpacked_func` (kv (B, S, 2, Hkv, D)),
`flash_attn_varlen_qkvpacked_func` (qkv (T, 3, H, D)) and
`flash_attn_varlen_kvpacked_func` (kv (T_k, 2, Hkv, D)), whose gradients flow back into
the packed tensor: layout (B, L, H, D) (packed (T, H, D) for varlen),
`causal` aligned bottom-right (query i sees keys j <= i + S - L), `window_size=(left,
right)` around that aligned position (-1: unlimited), `softcap` (0: none) on the scaled
scores, `alibi_slopes` (H,) or (B, H) adding `-slope · |i + S - L - j|`, GQA/MQA by head
count. Code written for them runs unchanged, imported from `attnkit.flash_attn`. The packed
forms call the others on views of the packed dim; `flash_attn_varlen_func` runs each sequence
on its own (`packed.attend_packed`); `flash_attn_func` (and a varlen pack under `torch.compile`)
is one `attention_with_lse` over each query's window as `row_spans` (`packed.window_spans`).

What differs (each docstring says it again): any dtype and device attnkit serves, not
only half on CUDA; a query that sees no key gives 0 and log-sum-exp -inf;
`return_attn_probs=True` returns `(out, softmax_lse, None)` (the probabilities are
`attnkit.attention_probs`); `deterministic` is accepted (attnkit's backward always is);
`dropout_p` is applied as attnkit's dropout (the same distribution, other random draws).
Outputs and log-sum-exps are contiguous in their layout (`out.view(B, L, H * D)` works);
a `block_table` that lists too few pages for a sequence, or a used entry that is no page
of the pool, raises `attnkit.BlockTableError` before anything is read or written.
"""

from attnkit.dropins.flash import flash_attn_func, flash_attn_varlen_func
from attnkit.dropins.flash_cache import flash_attn_with_kvcache
from attnkit.dropins.flash_packed import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
