"""Every torch-version and feature probe of attnkit, and nothing else.

Core code asks these names; it never inspects `torch.__version__` itself.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "SDPA_HAS_GQA",
    "TORCH_VERSION",
    "cpu_flash_attention",
    "cpu_flash_attention_backward",
    "dynamo_recompile_limit",
    "flex_attention_module",
]


def _version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION: tuple[int, int] = _version_tuple(torch.__version__)

# `enable_gqa=` of F.scaled_dot_product_attention arrived in torch 2.5 (a builtin: no signature
# to inspect); older versions need K/V heads repeated by hand.
SDPA_HAS_GQA: bool = TORCH_VERSION >= (2, 5)


def cpu_flash_attention() -> Any | None:
    """The CPU flash-attention op that also returns the log-sum-exp, or None.

    `aten::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
    *, attn_mask, scale) -> (out, logsumexp)` is what `F.scaled_dot_product_attention`
    dispatches to on CPU; it is private, so we probe for it rather than assume it.
    """
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def cpu_flash_attention_backward() -> Any | None:
    """The backward of `cpu_flash_attention`, taking the output and log-sum-exp, or None.

    `(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale)
    -> (grad_q, grad_k, grad_v)`: it recomputes the weights from the log-sum-exp given,
    which lets a blocked forward pass reuse it block by block.
    """
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def dynamo_recompile_limit(limit: int) -> Any:
    """A context raising torch.compile's per-function recompile limit (8 by default).

    FlexAttention compiles once per shape and mask; past the limit dynamo silently falls
    back to an unfused kernel that builds the full score matrix. The option is
    `recompile_limit` in recent torch and `cache_size_limit` before.
    """
    import contextlib

    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    if not hasattr(dynamo_config, name):
        return contextlib.nullcontext()
    return dynamo_config.patch(**{name: max(limit, getattr(dynamo_config, name))})


def flex_attention_module() -> Any | None:
    """`torch.nn.attention.flex_attention` where this torch has it, else None."""
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        return None
    return flex_attention
