"""transformers' mask function for `attn_implementation="attnkit"`: the structured
`Mask` equal to the model's mask function on every pair (causal, windows, chunks,
documents, padding), or transformers' own dense mask where no structure fits: the mask
of one forward (`PreparedMask`), which the runtime keys the calls its layers share by.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit._compat import eager
from attnkit.integrations import ModFn, structure
from attnkit.masks import Mask, causal, from_hf_attention_mask
from attnkit.masks.base import Combined, as_mask

__all__ = ["PreparedMask", "mask_function"]


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int | Tensor = 0,
    mask_function: ModFn | None = None,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> Mask | Tensor | None:
    """transformers' mask interface: the `Mask` of one forward, its structure kept.

    Query `i` is at position `q_offset + i`, key `j` at `kv_offset + j`. transformers'
    own `causal_mask_function` (`kv_idx <= q_idx`: every step of a causal model) is
    `causal(offset=q_offset - kv_offset)` by its definition; any other function is
    matched by `structure`, checked on every pair once per forward, or else becomes
    `Mask.from_mod(mask_function)`. Padding is `key_padding` of the 2-D mask's slice for
    the keys (positions past its end are padding). Every layer shares the result.

    Two calls get transformers' own dense (B, 1, L, S) bool mask instead, built by
    traceable operators as `"sdpa"` has it: one `torch.compile` traces (finding the
    structure reads tensors as data), and a decoding step of a compileable (static)
    cache (`allow_is_causal_skip=False` at L = 1), which `generate` builds ahead of a
    step it may compile: a tensor of one shape every step, so the compiled step neither
    breaks its graph nor recompiles as the cache fills.

    Args:
        batch_size: B.
        q_length: L, the queries of this forward.
        kv_length: S, the keys (the cache's included).
        q_offset: position of query 0 (default 0).
        kv_offset: position of key 0 (default 0).
        mask_function: transformers' `fn(b, h, q_idx, kv_idx) -> bool` over positions
            (default None: its causal function).
        attention_mask: (B, ≥ kv_offset + S) 2-D padding mask, 1/True = real token, from
            position 0 (default None: no padding); or a `Mask` built ahead, returned
            as is.
        local_size: the window or chunk size transformers passes (default None).
        device: where transformers' dense mask would live (default "cpu").
        **kwargs: transformers' other keywords (`allow_is_causal_skip`, `use_vmap`, ...).

    Returns:
        A `Mask` of (B, H, L, S) (a `PreparedMask`: an `&` with the `.ndim` / `.shape`
        of a (B, 1, L, S) mask), None when every query sees every key, or the dense
        (B, 1, L, S) bool tensor in the two cases above.

    Examples:
        >>> import attnkit.integrations.transformers as akt
        >>> akt.mask_function(1, 4, 4)  # a causal model's prefill of 4 tokens
        Mask[causal(offset=0)]
        >>> akt.mask_function(1, 1, 5, q_offset=4)  # its decoding step: 1 query, 5 keys
        Mask[causal(offset=4)]
        >>> padded = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])  # row 1: left padding
        >>> print(akt.mask_function(2, 4, 4, attention_mask=padded))
        causal(offset=0) & key_padding(valid, B=2)
    """
    if isinstance(attention_mask, Mask):  # ours, built ahead by `generate`: use it as is
        return attention_mask
    static_step = q_length == 1 and not kwargs.get("allow_is_causal_skip", True)
    if torch.compiler.is_compiling() or static_step:
        from transformers.masking_utils import causal_mask_function, sdpa_mask

        dense: Tensor | None = sdpa_mask(
            batch_size,
            q_length,
            kv_length,
            q_offset,  # type: ignore[arg-type]
            kv_offset,  # type: ignore[arg-type]
            mask_function or causal_mask_function,
            attention_mask,
            local_size=local_size,
            allow_is_causal_skip=False,
            device=device,
        )  # (B, 1, L, S) bool
        return dense
    structured: Mask | None = _structured(
        batch_size,
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        mask_function,
        attention_mask,
        local_size,
        device,
        kwargs.get("use_vmap", False),
    )
    return structured


@eager  # reads masks as data
def _structured(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor,
    kv_offset: int | Tensor,
    mask_function: ModFn | None,
    attention_mask: Tensor | None,
    local_size: int | None,
    device: torch.device | str,
    use_vmap: bool,
) -> Mask | None:
    """The recognised structure and the padding (`mask_function` eagerly)."""
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    shape = (batch_size, q_length, kv_length)
    if use_vmap and mask_function is not None:
        return _dense(shape, q_offset, kv_offset, mask_function, attention_mask, device)
    visible = _visible(mask_function, shape, q_offset, kv_offset, local_size)
    padding = _padding(attention_mask, batch_size, kv_length, kv_offset)
    parts = [m for m in (visible, padding) if m is not None]
    return PreparedMask(parts, shape) if parts else None


def _visible(
    fn: ModFn | None,
    shape: tuple[int, int, int],
    q_offset: int,
    kv_offset: int,
    local_size: int | None,
) -> Mask | None:
    """The `Mask` of `fn` (None: transformers' causal default) at these offsets.

    transformers' own `causal_mask_function` is `causal` with the offset by its
    definition (`kv_idx <= q_idx`: what a decoding step passes); any other function is
    checked on every pair (`structure`), once per forward: every layer shares the mask
    (transformers builds its functions anew for each forward, and one may read data
    that changed since the last).
    """
    shift = q_offset - kv_offset
    if fn is None or fn is _causal_mask_function():
        return causal(offset=shift) if shape[0] * shape[1] * shape[2] else None

    def local(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return fn(b, h, i + q_offset, j + kv_offset)

    recognised, visible = structure(local, *shape, shift=shift, local_size=local_size)
    if not recognised:  # exact all the same: the function itself, evaluated by the backends
        visible = Mask.from_mod(local, name="transformers mask_function")
    return visible


def _causal_mask_function() -> ModFn | None:
    """transformers' `causal_mask_function` (None where this transformers has none)."""
    from transformers import masking_utils

    return getattr(masking_utils, "causal_mask_function", None)


class PreparedMask(Combined):
    """The `&` of a recognised structure and the padding, shaped for transformers: with a
    compileable (static) cache `generate` builds the masks ahead and passes them back
    through the model's mask creation, which reads `.ndim` and `.shape` (B, 1, L, S).
    Its layers' prepared calls are the runtime's (`Runtime.forwards`), by this object."""

    def __init__(self, parts: list[Mask], shape: tuple[int, int, int]) -> None:
        super().__init__("&", tuple(parts))
        B, L, S = shape
        self.shape = (B, 1, L, S)
        self.ndim = 4

    def describe(self) -> str:
        return " & ".join(part.describe() for part in self.parts)


def _dense(
    shape: tuple[int, int, int],
    q_offset: int,
    kv_offset: int,
    fn: ModFn,
    attention_mask: Tensor | None,
    device: torch.device | str,
) -> Mask | None:
    """transformers' own dense mask (vmap): for a user's mask function (an image-token
    overlay, say) that transformers itself does not trust to be index-based."""
    from transformers.masking_utils import sdpa_mask

    dense = sdpa_mask(
        *shape,
        q_offset,
        kv_offset,
        fn,
        attention_mask,
        allow_is_causal_skip=False,
        use_vmap=True,
        device=device,
    )  # (B, 1, L, S) bool or None
    return None if dense is None else PreparedMask([as_mask(dense)], shape)


def _padding(attention_mask: Tensor | None, B: int, S: int, kv_offset: int) -> Mask | None:
    """`key_padding` for keys kv_offset .. kv_offset + S - 1 (None when all are real):
    positions past the 2-D mask's end are padding, as transformers pads it."""
    if attention_mask is None:
        return None
    valid = attention_mask.bool()[:, kv_offset : kv_offset + S]  # (B, ≤S)
    if valid.shape[1] < S:
        valid = torch.nn.functional.pad(valid, (0, S - valid.shape[1]), value=False)
    if bool(valid.all()):
        return None
    return from_hf_attention_mask(valid.expand(B, S))  # 1 = real token: a row may be all pad
