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
(`dispatch.StepCalls`).

One documented difference from `eager`: a query that may see no key (a padding row)
gets 0, where eager's finite "minus infinity" averages all values (DESIGN.md §2).

Tested with transformers 5.24. `register` is idempotent and refuses names transformers
treats specially and names another function holds. `structure()` builds candidates
(causal with offset `q_offset - kv_offset`; with `local_size`: a causal sliding window
`left = local_size - 1`, chunked & causal, a bidirectional window; no mask; each `&`
packed documents, found by probing which rows cannot see the key before their own) and
keeps the first that equals `mask_function` on all B·L·S pairs (row chunks of 4M
entries). transformers' own `causal_mask_function` (`kv_idx <= q_idx`, what every
decoding step of a causal model passes) is `causal(offset=q_offset - kv_offset)` by its
definition, with no check (a test holds the installed version to it pair by pair); any
other function is checked once per forward (transformers builds its functions anew each
forward; at S = L = 4096 the check takes about 0.1 s on 2 cores, once for all layers).
Padding is `key_padding` of the 2-D mask's slice for the keys (positions past its end
are padding). The result is a `PreparedMask` (an `&` with the `.ndim`/`.shape` of a (B,
1, L, S) mask): `generate` with a static cache builds masks ahead and passes them back
through the model's mask creation, and the mask function returns it as is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnkit.dispatch import StepCalls
from attnkit.documents import documents
from attnkit.errors import MaskError
from attnkit.functional import attention, attention_probs
from attnkit.masks import (
    Mask,
    causal,
    chunked,
    document,
    from_hf_attention_mask,
    key_padding,
    sliding_window,
)
from attnkit.masks.base import _Combine, as_mask
from attnkit.masks.spans import exact_spans

__all__ = ["TESTED_VERSIONS", "attention_forward", "mask_function", "register", "structure"]

TESTED_VERSIONS = ">=5.24,<6"  # the range the optional extra `attnkit[transformers]` pins
_SPECIAL = ("eager", "sdpa", "flex_attention")  # transformers' own names
CHECK_ELEMENTS = 1 << 22  # mask entries compared at once when checking a structure

ModFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def register(name: str = "attnkit") -> str:
    """Register attnkit's attention and mask functions with transformers under `name`.

    Idempotent. Refuses the names transformers treats specially (its own
    implementations, `flash*`, `paged|…` and hub kernels `org/repo`) and a name another
    function already holds. Returns `name`.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:  # the optional extra
        raise ImportError(
            "attnkit.integrations.transformers needs transformers: pip install "
            f"'attnkit[transformers]' (tested: transformers{TESTED_VERSIONS})."
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


# ----------------------------------------------------------------------- the mask function


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
    """transformers' mask interface: the `Mask` for one forward (see the module doc).

    Query `i` is at position `q_offset + i`, key `j` at `kv_offset + j`; `mask_function`
    takes those positions, and the 2-D `attention_mask` (True = real token) covers the
    keys from position 0. Returns None when every query sees every key.

    Two calls get transformers' own dense (B, 1, L, S) bool mask instead, built by
    traceable operators as `"sdpa"` has it: one `torch.compile` traces (finding the
    structure reads tensors as data), and a decoding step of a compileable (static)
    cache (`allow_is_causal_skip=False` at L = 1), which `generate` builds ahead of a
    step it may compile: a tensor of one shape every step, so the compiled step neither
    breaks its graph nor recompiles as the cache fills.
    """
    if isinstance(attention_mask, Mask):  # ours, built ahead by `generate`: use it as is
        return attention_mask
    static_step = q_length == 1 and not kwargs.get("allow_is_causal_skip", True)
    if torch.compiler.is_compiling() or static_step:
        from transformers.masking_utils import causal_mask_function, sdpa_mask

        dense: Tensor | None = sdpa_mask(
            batch_size, q_length, kv_length, q_offset, kv_offset,  # type: ignore[arg-type]
            mask_function or causal_mask_function, attention_mask, local_size=local_size,
            allow_is_causal_skip=False, device=device,
        )  # fmt: skip  # (B, 1, L, S) bool
        return dense
    structured: Mask | None = _structured(
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
        local_size, device, kwargs.get("use_vmap", False),
    )  # fmt: skip
    return structured


@torch.compiler.disable  # type: ignore[untyped-decorator]  # reads masks as data: eager
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


class PreparedMask(_Combine):
    """The `&` of a recognised structure and the padding, shaped for transformers: with a
    compileable (static) cache `generate` builds the masks ahead and passes them back
    through the model's mask creation, which reads `.ndim` and `.shape` (B, 1, L, S)."""

    def __init__(self, parts: list[Mask], shape: tuple[int, int, int]) -> None:
        super().__init__("&", tuple(parts))
        B, L, S = shape
        self.shape = (B, 1, L, S)
        self.ndim = 4
        # the forward's prepared calls, made by its first layer (not the mask's value)
        self._calls = StepCalls()
        self._packed: bool | None = None  # packed documents: each layer runs a call each

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
        *shape, q_offset, kv_offset, fn, attention_mask, allow_is_causal_skip=False,
        use_vmap=True, device=device,
    )  # fmt: skip  # (B, 1, L, S) bool or None
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
    return key_padding(valid.expand(B, S))


def structure(
    fn: ModFn, B: int, L: int, S: int, *, shift: int = 0, local_size: int | None = None
) -> tuple[bool, Mask | None]:
    """`(True, mask)` for the structured `Mask` equal to `fn` on every (b, i, j) (None:
    every query sees every key), or `(False, None)` where none is.

    Candidates, from the arguments and a probe of `fn` along the diagonal: causal with
    the cache's offset (`j <= i + shift`), a causal sliding window or chunks of
    `local_size`, a bidirectional window, no mask, and packed documents under each (a row
    that cannot see the key just before its own starts a document). All are compared
    with `fn` on all B·L·S pairs at once, in row chunks; the first that agrees
    everywhere wins. `fn` must not depend on the head (transformers' never do).
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
    """transformers' attention interface: q (B, H, L, D), k/v (B, Hkv, S, D) unrepeated;
    returns (B, L, H, Dv) and the weights when `output_attentions` asks for them."""
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
            query, key, value, mask, scale=scaling, softcap=softcap, sinks=s_aux,
            dropout_p=dropout_p,
        )  # fmt: skip
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
    if mask._packed is None:  # asked once per forward
        mask._packed = documents(mask, query, key) is not None
    return None if mask._packed else mask._calls


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
