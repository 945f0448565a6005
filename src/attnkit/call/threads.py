"""Work run in a fresh thread: PyTorch's default dispatch state, the caller's grad mode."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["in_fresh_thread"]

R = TypeVar("R")


def in_fresh_thread(fn: Callable[[], R]) -> R:
    """`fn()` in a new thread, which starts with PyTorch's default dispatch state, under
    the caller's grad mode (`fn` may enable grad itself).

    An op's implementation runs below autograd (the backward op's recompute enables it
    in a fresh thread), and inside a compiled graph's run FlexAttention's `vmap` over a
    mask_mod fails ("NYI: querying is_contiguous inside of vmap"); a fresh thread has
    no such state.
    """
    grad = torch.is_grad_enabled()

    def run() -> R:
        with torch.set_grad_enabled(grad):
            return fn()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()
