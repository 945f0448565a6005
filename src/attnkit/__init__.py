"""attnkit: exact attention for PyTorch, every step first-class and hard to get wrong.

The loop: scores `QKᵀ·scale` -> visibility mask -> stable softmax -> weighted sum of V.
See DESIGN.md for the conventions: `True` = may attend, causal alignment never guessed,
empty rows give zeros.
"""

__version__ = "0.1.0"  # the one place it is written (the package metadata reads it here)

from attnkit import flash_attn, runtime
from attnkit.call import calibrate
from attnkit.call import cost as cost
from attnkit.call.functional import attention, attention_with_lse, explain
from attnkit.call.planner import Plan
from attnkit.call.prepare import prepare
from attnkit.call.prepared import Prepared
from attnkit.call.probs import attention_probs
from attnkit.contracts import (
    attention_contract_ok,
    attention_score_elements,
    check_attention_contract,
)
from attnkit.dropins.pytorch import sdpa, varlen_attn
from attnkit.errors import (
    BlockTableError,
    DtypeMismatchError,
    MaskConventionWarning,
    MaskError,
    OutOfBlocksError,
    PreparedMismatchError,
    RanksDisagreeError,
    ShapeContractError,
)
from attnkit.heads import merge_heads, split_heads
from attnkit.kv.cache import KVCache
from attnkit.kv.paged import PagedKVCache, PagedLayer, paged_attention
from attnkit.kv.pool import Step
from attnkit.kv.positional import RotaryEmbedding
from attnkit.masks import (
    Mask,
    alibi,
    alibi_bias,
    alibi_slopes,
    and_masks,
    causal,
    chunked,
    document,
    from_additive_mask,
    from_hf_attention_mask,
    from_key_padding_mask,
    key_padding,
    or_masks,
    prefix_lm,
    sliding_window,
)
from attnkit.modules import MultiHeadAttention, SingleHeadAttention
from attnkit.reference import (
    attention_weights,
    build_attention_mask,
    build_causal_mask,
    scaled_dot_product_attention,
)
from attnkit.softmax import masked_softmax

# the process's state, made once: its planner prices with the table `attnkit.call.calibrate`
# chooses (built in for the CPU's kind, or one `attnkit calibrate` kept) at its first use
runtime.start(runtime.Runtime(calibrate.active_table))

__all__ = [
    "BlockTableError",
    "DtypeMismatchError",
    "KVCache",
    "Mask",
    "MaskConventionWarning",
    "MaskError",
    "MultiHeadAttention",
    "OutOfBlocksError",
    "PagedKVCache",
    "PagedLayer",
    "Plan",
    "Prepared",
    "PreparedMismatchError",
    "RanksDisagreeError",
    "RotaryEmbedding",
    "ShapeContractError",
    "SingleHeadAttention",
    "Step",
    "alibi",
    "alibi_bias",
    "alibi_slopes",
    "and_masks",
    "attention",
    "attention_contract_ok",
    "attention_probs",
    "attention_score_elements",
    "attention_weights",
    "attention_with_lse",
    "build_attention_mask",
    "build_causal_mask",
    "causal",
    "check_attention_contract",
    "chunked",
    "document",
    "explain",
    "flash_attn",
    "from_additive_mask",
    "from_hf_attention_mask",
    "from_key_padding_mask",
    "key_padding",
    "masked_softmax",
    "merge_heads",
    "or_masks",
    "paged_attention",
    "prefix_lm",
    "prepare",
    "scaled_dot_product_attention",
    "sdpa",
    "sliding_window",
    "split_heads",
    "varlen_attn",
]
