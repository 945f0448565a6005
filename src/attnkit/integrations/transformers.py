"""Hugging Face transformers: `attn_implementation="attnkit"`, with the mask's structure kept.

    import attnkit.integrations.transformers as akt
    akt.register()                        # once; then any of
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnkit")
    model = LlamaForCausalLM(LlamaConfig(..., attn_implementation="attnkit"))
    model.set_attn_implementation("attnkit")

Two functions are registered under the name. The *mask function* (transformers'
`AttentionMaskInterface`) receives what transformers would turn into a dense (B, 1, L, S)
mask: the sizes, the cache's query and key offsets, the 2-D padding mask and a
`mask_function(b, h, q_idx, kv_idx)`. It returns an attnkit `Mask` instead: the causal,
sliding-window, chunked, packed-document and padding structure it recognises, checked
against `mask_function` on every pair (so it is exact, whatever transformers composed),
or `Mask.from_mod(mask_function)` where no structure fits. The *attention function*
(`AttentionInterface`) runs `attnkit.attention` on that mask, with the module's scale,
dropout, `softcap` (Gemma 2) and `s_aux` sinks (GPT-OSS). Every layer of a forward
shares the mask object: its first layer prepares the call, the others run it
(`dispatch.StepCalls`, which the runtime keeps by the mask: `Runtime.forwards`).

One documented difference from `eager`: a query that may see no key (a padding row)
gets 0, where eager's finite "minus infinity" averages all values (DESIGN.md §2).
Tested with transformers 5.24 (`TESTED_VERSIONS`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit import runtime
from attnkit.call.dispatch import StepCalls
from attnkit.call.documents import documents
from attnkit.call.functional import attention
from attnkit.call.probs import attention_probs
from attnkit.errors import MaskError
from attnkit.integrations import structure
from attnkit.integrations.transformers_mask import PreparedMask, mask_function
from attnkit.masks import Mask, causal, document, from_hf_attention_mask
from attnkit.masks.base import as_mask

__all__ = ["TESTED_VERSIONS", "attention_forward", "mask_function", "register", "structure"]

TESTED_VERSIONS = ">=5.24,<6"  # the range the optional extra `attnkit[transformers]` pins
_SPECIAL = ("eager", "sdpa", "flex_attention")  # transformers' own names


def register(name: str = "attnkit") -> str:
    """Register attnkit's attention and mask functions with transformers under `name`,
    so that `attn_implementation=name` runs `attention_forward` on the masks of
    `mask_function`.

    Idempotent: call it once or at every import.

    Args:
        name: the implementation's name, a plain identifier (default "attnkit").

    Returns:
        `name`, as `attn_implementation` takes it.

    Raises:
        ImportError: transformers is not installed (the `attnkit[transformers]` extra).
        ValueError: a name transformers treats specially (its own implementations,
            `flash*`, `paged|…`, hub kernels `org/repo`), or one another function holds.

    Examples:
        >>> import attnkit.integrations.transformers as akt
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> akt.register()
        'attnkit'
        >>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        >>> model = LlamaForCausalLM(config).eval()  # tiny, random weights
        >>> ids = torch.tensor([[1, 2, 3, 4, 5]])
        >>> model.set_attn_implementation("attnkit")
        >>> logits = model(ids).logits  # (B, L, vocab)
        >>> model.set_attn_implementation("sdpa")
        >>> torch.allclose(logits, model(ids).logits, atol=1e-5)  # the same model
        True
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:  # the optional extra
        raise ImportError(
            "attnkit.integrations.transformers needs transformers: pip install "
            f"'/path/to/attnkit[transformers]' (a checkout; tested: transformers{TESTED_VERSIONS})."
        ) from err
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be a plain identifier such as 'attnkit', got {name!r}.")
    if name in _SPECIAL or "flash" in name or name.startswith("paged"):
        raise ValueError(
            f"{name!r} is a name transformers treats specially (its own implementations, "
            "flash*, paged|…); register attnkit under another, e.g. register('attnkit')."
        )
    for interface, fn in (
        (AttentionInterface, attention_forward),
        (AttentionMaskInterface, mask_function),
    ):
        taken = interface._global_mapping.get(name)
        if taken is not None and taken is not fn:
            raise ValueError(
                f"{name!r} is already registered with transformers by {taken!r}; pass another "
                "name to register()."
            )
        interface.register(name, fn)
    return name


# ------------------------------------------------------------------ the attention function


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Mask | Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention interface: `attnkit.attention` with a module's options.

    Args:
        module: the calling attention module (its `training` turns dropout on; its
            `is_causal` is read when there is no mask).
        query: (B, H, L, D).
        key: (B, Hkv, S, D), not repeated for GQA.
        value: (B, Hkv, S, Dv).
        attention_mask: the `Mask` of `mask_function`, a user's 4-D mask (bool, 0/1 or
            additive, through `from_hf_attention_mask`), or None: top-left causal when
            the module is causal and L > 1, as transformers' sdpa.
        dropout: dropout on the weights, in training only (default 0.0).
        scaling: multiplies q·kᵀ (default None: 1/√D).
        softcap: if set, scores become `c·tanh(s/c)` (Gemma 2) (default None).
        s_aux: (H,) attention sinks, a logit per head (GPT-OSS) (default None).
        is_causal: overrides the module's `is_causal` (default None).
        **kwargs: `cu_seq_lens_q` / `cu_seq_lens_k` (flash-style packing, read as
            `document` ids: no attention across documents), `output_attentions`.

    Returns:
        `(out, weights)`: out (B, L, H, Dv) contiguous in query's dtype; the weights
        (B, H, L, S) from `attention_probs` when `output_attentions=True`, else None.

    Raises:
        MaskError: a 4-D integer mask of other values than 0 and 1.

    Examples:
        >>> import attnkit.integrations.transformers as akt
        >>> q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)  # Hkv = 2
        >>> out, weights = akt.attention_forward(torch.nn.Module(), q, k, k, None,
        ...                                      output_attentions=True)  # causal
        >>> out.shape, weights.shape  # (B, L, H, Dv), (B, H, L, S)
        (torch.Size([1, 5, 4, 8]), torch.Size([1, 4, 5, 5]))
        >>> bool(weights[0, 0].triu(1).eq(0).all())  # no query sees a later key
        True
    """
    mask = _as_mask(attention_mask, module, is_causal, query.shape[2], key.shape[2])
    packed = _from_cu_seq_lens(kwargs, query.shape[2], key.shape[2])
    if packed is not None:  # flash-style packing: documents, never a cross-document leak
        mask = packed if mask is None else as_mask(mask) & packed
    dropout_p = dropout if module.training else 0.0
    calls = _step_calls(mask, query, key, s_aux)
    if calls is not None:  # the forward's mask: its first layer prepared the call
        out = calls.run(
            None, query, key, value, mask, scale=scaling, softcap=softcap, dropout_p=dropout_p
        )
    else:
        out = attention(
            query,
            key,
            value,
            mask,
            scale=scaling,
            softcap=softcap,
            sinks=s_aux,
            dropout_p=dropout_p,
        )
    weights = None
    if kwargs.get("output_attentions", False):  # exact weights, (B, H, L, S): asked for
        weights = attention_probs(query, key, mask, scale=scaling, softcap=softcap, sinks=s_aux)
    return out.transpose(1, 2).contiguous(), weights


def _step_calls(
    mask: Mask | Tensor | None, query: Tensor, key: Tensor, s_aux: Tensor | None
) -> StepCalls | None:
    """The prepared calls of the forward `mask` was built for (`PreparedMask`: every
    layer shares it), or None where a layer takes `attention`'s own path: under
    `torch.compile`, with sinks (each layer has its own), packed documents (a call each)."""
    if not isinstance(mask, PreparedMask) or s_aux is not None:
        return None
    if torch.compiler.is_compiling():
        return None
    forwards = runtime.current().forwards
    if mask not in forwards:  # asked once per forward: packed documents run a call each
        forwards[mask] = None if documents(mask, query, key) is not None else StepCalls()
    calls: StepCalls | None = forwards[mask]
    return calls


def _from_cu_seq_lens(kwargs: dict[str, Any], L: int, S: int) -> Mask | None:
    """`document` ids from `cu_seq_lens_q` / `cu_seq_lens_k` (cumulative sequence lengths of
    a packed row, as flash-attention kwargs carry them), or None when not given."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    cu_q = cu_q if isinstance(cu_q, Tensor) else cu_k
    cu_k = cu_k if isinstance(cu_k, Tensor) else cu_q
    if not isinstance(cu_q, Tensor) or not isinstance(cu_k, Tensor):
        return None

    def ids(cu: Tensor, n: int) -> Tensor:  # (n,): the sequence each position belongs to
        return torch.searchsorted(
            cu[1:].to(torch.long), torch.arange(n, device=cu.device), right=True
        )

    return document(ids(cu_q, L), ids(cu_k, S))


def _as_mask(
    attention_mask: Mask | Tensor | None,
    module: torch.nn.Module,
    is_causal: bool | None,
    L: int,
    S: int,
) -> Mask | Tensor | None:
    """The mask transformers handed over: ours, a user's 4-D tensor, or None (then SDPA's
    rule: top-left causal for a causal module with more than one query)."""
    if isinstance(attention_mask, Mask):
        return attention_mask
    if torch.compiler.is_compiling() and isinstance(attention_mask, Tensor):
        return attention_mask  # traced: transformers' bool mask (`mask_function`) as it is
    if isinstance(attention_mask, Tensor):  # a 4-D mask built by the user
        try:
            return from_hf_attention_mask(attention_mask)
        except MaskError:
            if attention_mask.is_floating_point():
                return attention_mask  # a float bias, not only 0 / -inf: added as it is
            raise
    causal_module = getattr(module, "is_causal", True) if is_causal is None else is_causal
    return causal(align="top_left") if causal_module and L > 1 else None
