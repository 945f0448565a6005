"""The checks a mask's arguments pass: alignments, offsets, counts, batch rows, shapes.

Each raises the error the conventions name (DESIGN.md §2): `ShapeContractError` for a
size that does not fit the call, `MaskError` for a mask argument that has no meaning,
`TypeError` for a wrong type; each message says what was given and the fix.

`check_additive` reads a float mask as an additive bias: one min/max pass, a second only
for a 0..1 range, at the first call of a mask tensor (the prepared call is kept per
tensor and version); a call traced by `torch.compile` does not read the mask's values.
"""

from __future__ import annotations

import torch

from attnkit.errors import MaskError, ShapeContractError

__all__ = [
    "ALIGNS",
    "batch_of",
    "causal_offset",
    "check_additive",
    "check_align",
    "check_batch",
    "check_broadcastable",
    "check_count",
    "check_offset",
    "integer_mask_error",
]

ALIGNS = ("top_left", "bottom_right")


def check_align(align: str | None) -> None:
    if align is not None and align not in ALIGNS:
        raise MaskError(f"align={align!r} is not a causal alignment; use one of {ALIGNS}.")


def check_offset(align: str | None, offset: object) -> int | None:
    """An explicit diagonal offset (any int), exclusive with `align`."""
    if offset is None:
        return None
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(
            f"offset must be an int (key j visible iff j <= i + offset), got "
            f"{type(offset).__name__}."
        )
    if align is not None:
        raise MaskError(
            f"give align={align!r} or offset={offset}, not both: an offset fixes the "
            "alignment itself (top_left is offset=0, bottom_right is offset=S-L)."
        )
    return offset


def causal_offset(
    align: str | None, L: int, S: int, constructor: str = "causal", offset: int | None = None
) -> int:
    """How far the diagonal of query `i` shifts right: key `i + offset` is the last visible.

    An explicit `offset` wins (the mask was built with one); else the alignment decides.
    """
    if offset is not None:
        return offset
    if align is None and L != S:
        fn = constructor
        raise ShapeContractError(
            f"{fn} mask with L={L} queries and S={S} keys: the alignment is ambiguous. "
            f"Choose {fn}(align='top_left') (key j visible to query i iff j <= i, as SDPA's "
            f"is_causal), {fn}(align='bottom_right') (iff j <= i + S - L, as flash-attention "
            f"and KV-cache decoding) or {fn}(offset=n) (iff j <= i + n, for a cache whose "
            "offset is neither)."
        )
    return S - L if align == "bottom_right" else 0


def check_count(name: str, value: object, minimum: int = 0) -> int:
    """An int count of keys (a window side, a chunk size), at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
    if value < minimum:
        raise MaskError(f"{name}={value} is negative; it counts keys, so use {name} >= 0.")
    return value


def check_batch(name: str, got: int, B: int) -> None:
    if got not in (1, B):
        raise ShapeContractError(
            f"{name} holds {got} batch rows but q has B={B}; give one row per batch element "
            "(or a single row to share)."
        )


def check_broadcastable(name: str, shape: tuple[int, ...], target: tuple[int, ...]) -> None:
    """Raise unless a tensor of `shape` broadcasts to `target` = (B, H, L, S)."""
    if len(shape) > 4:
        raise ShapeContractError(
            f"{name} has {len(shape)} dims, shape {shape}; it must broadcast to (B, H, L, S), "
            "so it has at most 4 dims."
        )
    padded = (1,) * (4 - len(shape)) + shape
    for got, want, letter in zip(padded, target, "BHLS", strict=True):
        if got not in (1, want):
            raise ShapeContractError(
                f"{name} of shape {shape} does not broadcast to (B, H, L, S) = {target}: its "
                f"{letter} dim is {got}, expected 1 or {want}. Reshape it (a (B, S) padding "
                "mask becomes (B, 1, 1, S)), or use key_padding(valid) for padding."
            )


def batch_of(*sizes: int | None) -> int | None:
    """The batch size of parts with these sizes (None: any batch)."""
    known = [s for s in sizes if s is not None and s != 1]
    return max(known) if known else (1 if any(s == 1 for s in sizes) else None)


def integer_mask_error(name: str, dtype: torch.dtype) -> MaskError:
    return MaskError(
        f"{name} has dtype {dtype}: integer masks are ambiguous (1 means 'real token' in "
        "Hugging Face but 'ignore' in other code), so attnkit refuses them. Convert "
        "explicitly: from_hf_attention_mask(m) if 1 = real token, "
        "from_key_padding_mask(m.bool()) if 1 = padding, or m.bool() if 1 = may attend."
    )


def check_additive(name: str, bias: torch.Tensor) -> None:
    """A float mask is an additive bias (0 keeps, -inf hides): refuse the values that
    show it was meant otherwise (one min/max pass; a second only for 0..1 ranges).

    +inf or NaN would make every score of their rows NaN; only 0s and 1s, both present,
    is a keep-mask (1 = may attend) cast to float, which as a bias hides nothing and adds
    1 to the kept scores.
    """
    if bias.numel() == 0:
        return
    lo, hi = (float(x) for x in torch.aminmax(bias.detach()))
    fix = (
        " If 1 means 'may attend', pass m.bool(); an additive mask keeps with 0 and hides "
        "with -inf (from_additive_mask(m) turns one into a visibility mask)."
    )
    if hi != hi or hi == float("inf"):  # NaN, or +inf
        raise MaskError(
            f"{name} is a float mask, which attnkit adds to the scores (0 keeps, -inf "
            f"hides), but it holds {'NaN' if hi != hi else '+inf'}: every score it touches "
            "would become NaN or +inf." + fix
        )
    if lo == 0 and hi == 1 and bool(((bias == 0) | (bias == 1)).all()):
        raise MaskError(
            f"{name} is a float mask of only 0s and 1s: a keep-mask cast to float? attnkit "
            "adds a float mask to the scores (0 keeps, -inf hides), so it would hide "
            "nothing and add 1 to some scores." + fix
        )
