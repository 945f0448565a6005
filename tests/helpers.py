"""Shared test helpers: the float64 reference rule of flash-attention's tests."""

from __future__ import annotations

import torch

# Absolute error floors, about 100 ulps at 1 for each dtype: where the reference happens to
# be exact (one visible key makes dq exactly 0), a fused kernel's rounding of the O(1)
# intermediates still shows; real bugs give errors of O(0.1) and above.
FLOOR = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_rule(name: str, got: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor) -> None:
    """`got`'s error against the float64 `truth` is at most 2x `ref`'s (same dtype) + floor."""
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err, ref_err = max_err(got, truth), max_err(ref, truth)
    bound = 2 * ref_err + FLOOR[got.dtype]
    assert err <= bound, f"{name}: error {err:.3g} > 2 x reference error {ref_err:.3g} + floor"
