"""The error types of attnkit.

Those about arguments subclass `ValueError`, so code that already catches `ValueError`
keeps working; `DtypeMismatchError` is both a `TypeError` (attnkit's word for wrong
dtypes) and a `RuntimeError` (what torch's SDPA raises), so code written for either
catches it; `OutOfBlocksError` is a `RuntimeError` (the arguments are fine, the pool
is full). Every message names the argument, what was expected, what was given, and the
fix.
"""

from __future__ import annotations

__all__ = [
    "BlockTableError",
    "DtypeMismatchError",
    "MaskError",
    "OutOfBlocksError",
    "PreparedMismatchError",
    "RanksDisagreeError",
    "ShapeContractError",
]


class ShapeContractError(ValueError):
    """Shapes (or devices) of q, k, v or a mask break the attention contract."""


class MaskError(ValueError):
    """A mask is malformed: wrong dtype, ambiguous convention, bad lengths or windows."""


class DtypeMismatchError(TypeError, RuntimeError):
    """q, k and v (or a mask) have different dtypes."""


class BlockTableError(ValueError):
    """A `block_table` lists too few pages for a sequence's length, or a page id that is
    no page of the pool; checked before anything is read or written."""


class OutOfBlocksError(RuntimeError):
    """A `PagedKVCache` step needs more free blocks than the pool has; nothing changed."""


class PreparedMismatchError(ValueError):
    """A prepared call (`attnkit.prepare`) was given inputs of other sizes, dtypes,
    devices or grad mode than it was prepared for, or its mask changed in place."""


class RanksDisagreeError(ValueError):
    """The ranks of a context-parallel call passed different masks, shapes or options."""
