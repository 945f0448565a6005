"""The two error types of attnkit.

Both subclass `ValueError`, so code that already catches `ValueError` keeps working.
Every message names the argument, what was expected, what was given, and the fix.
"""

from __future__ import annotations

__all__ = ["MaskError", "ShapeContractError"]


class ShapeContractError(ValueError):
    """Shapes (or devices) of q, k, v or a mask break the attention contract."""


class MaskError(ValueError):
    """A mask is malformed: wrong dtype, ambiguous convention, bad lengths or windows."""
