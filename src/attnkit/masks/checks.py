"""The checks a mask's arguments pass: alignments, offsets, counts, batch rows, shapes.

Each raises the error the conventions name (the Design page, §2): `ShapeContractError`
for a size that does not fit the call, `MaskError` for a mask argument that has no meaning,
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
    "not_a_mask_error",
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

    Args:
        align: `"top_left"` (offset 0), `"bottom_right"` (offset S - L) or None (0,
            allowed only when L == S).
        L: query length.
        S: key length.
        constructor: the mask's name, for the error message (default `"causal"`).
        offset: an explicit offset, returned as it is (default None).

    Returns:
        The int offset `n`: query `i` sees keys `j <= i + n`.

    Raises:
        ShapeContractError: L != S with neither `align` nor `offset`, naming both
            alignments and `offset=n`.

    Examples:
        >>> ak.masks.causal_offset("bottom_right", 2, 5)  # 2 new queries after 3 cached
        3
        >>> ak.masks.causal_offset(None, 2, 5)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        attnkit.errors.ShapeContractError: causal mask with L=2 queries and S=5 keys: ...
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
    """Raise unless a tensor of `shape` broadcasts to `target` = (B, H, L, S).

    Args:
        name: the argument's name, for the message (e.g. `"mask"`).
        shape: the tensor's shape, at most 4 dims.
        target: the call's (B, H, L, S).

    Raises:
        ShapeContractError: more than 4 dims, or a dim that is neither 1 nor the
            target's, naming the letter and the fix.

    Examples:
        >>> ak.masks.check_broadcastable("mask", (1, 1, 4, 4), (2, 8, 4, 4))  # fits
        >>> ak.masks.check_broadcastable("mask", (2, 4), (2, 8, 4, 4))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        attnkit.errors.ShapeContractError: mask of shape (2, 4) does not broadcast to ...
    """
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
    """The error for an integer mask: 1 means "real token" to some and "ignore" to others.

    Args:
        name: the argument's name (e.g. `"mask"`).
        dtype: the integer dtype given.

    Returns:
        A `MaskError` (to raise) naming the three explicit conversions.

    Examples:
        >>> err = ak.masks.integer_mask_error("mask", torch.int64)
        >>> isinstance(err, ak.MaskError), "from_hf_attention_mask(m)" in str(err)
        (True, True)
    """
    return MaskError(
        f"{name} has dtype {dtype}: integer masks are ambiguous (1 means 'real token' in "
        "Hugging Face but 'ignore' in other code), so attnkit refuses them. Convert "
        "explicitly: from_hf_attention_mask(m) if 1 = real token, "
        "from_key_padding_mask(m.bool()) if 1 = padding, or m.bool() if 1 = may attend."
    )


def not_a_mask_error(mask: object) -> TypeError:
    """The TypeError for what is no mask: FlexAttention's pieces (a function, a
    `BlockMask`) are pointed to `Mask.from_mod`."""
    kind = type(mask).__name__
    rule = "(fn(b, h, q_idx, kv_idx) -> bool, True = may attend)"
    if kind == "BlockMask":
        return TypeError(
            "mask is a BlockMask; attnkit takes its predicate and builds its own blocks: "
            f"mask=Mask.from_mod(block_mask.mask_mod) {rule}."
        )
    if callable(mask):
        return TypeError(f"mask is a function; wrap it as mask=Mask.from_mod(fn) {rule}.")
    return TypeError(
        f"mask must be a Mask, a bool tensor (True = may attend) or, alone, a float tensor "
        f"(added to the scores), got {kind}."
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
