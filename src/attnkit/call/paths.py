"""The path of every eager call: packed documents one call each, a call inside
`torch.compile` one custom op, any other the one cache of prepared calls (`dispatch`).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from attnkit.call.dispatch import attention_call
from attnkit.call.documents import attend_documents, documents
from attnkit.contracts import normalize_call
from attnkit.masks import Mask
from attnkit.masks.convert import from_torch_mask

__all__ = ["length", "run_attention"]

MaskLike = Mask | Tensor | None


def run_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: object,
    *,
    scale: float | None,
    softcap: float | None,
    dropout_p: float,
    backend: str,
    need_lse: bool,
    check_bias: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """`attention_with_lse` without sinks (lse None unless `need_lse`), eagerly or as one
    custom op under `torch.compile`; a `CausalBias` enters as its `causal` mask.
    `check_bias`: refuse float masks that look like mistakes (`sdpa` adds them)."""
    if not (mask is None or type(mask) is Tensor or isinstance(mask, Mask)):
        mask = from_torch_mask(mask, length(q), length(k))  # a CausalBias, or refused later
    given = cast("Mask | Tensor | None", mask)  # anything else: the contracts refuse it
    packed = None if torch.compiler.is_compiling() else documents(mask, q, k)
    if packed is not None and isinstance(mask, Mask):  # packed documents: a call each
        normalize_call(q, k, v, mask, scale=scale, softcap=softcap, dropout_p=dropout_p)

        def one(
            q: Tensor, k: Tensor, v: Tensor, inner: Mask | None
        ) -> tuple[Tensor, Tensor | None]:
            return run_attention(
                q,
                k,
                v,
                inner,
                scale=scale,
                softcap=softcap,
                dropout_p=dropout_p,
                backend=backend,
                need_lse=need_lse,
            )

        return attend_documents(q, k, v, packed, one)
    if torch.compiler.is_compiling():  # one custom op in the graph (attnkit.call.compiled)
        from attnkit.call.compiled import traced_attention  # loaded under torch.compile only

        return traced_attention(
            q,
            k,
            v,
            given,
            scale=scale,
            softcap=softcap,
            dropout_p=dropout_p,
            backend=backend,
            need_lse=need_lse,
        )
    return attention_call(
        q,
        k,
        v,
        given,
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        backend=backend,
        need_lse=need_lse,
        check_bias=check_bias,
    )


def length(t: object) -> int | None:
    """L or S of a (..., L|S, D) tensor, None for anything else (the contracts say why)."""
    return t.shape[-2] if isinstance(t, Tensor) and t.dim() >= 2 else None
