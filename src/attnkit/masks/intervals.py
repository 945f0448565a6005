"""A bool tensor mask read as one interval of keys per row, where it is one.

Frameworks pass visibility as a dense bool tensor even when it has structure: the
(B, 1, L, S) padded causal mask of transformers, a band, a padding row per batch. Where
each row's True entries form one run `[lo, hi)`, the two (B|1, L) tensors `lo`, `hi`
describe it completely, and the backends that read spans (`tiled`, the planner's pair
count, the rows and keys anybody sees, `to_block_mask`) take their fast path instead of
evaluating the tensor block by block. Finding them is a pass over the tensor, cheaper
than the attention over it; a row of two or more runs (a random mask) leaves it a plain
tensor mask.

Runs are counted per row in one pass (`lo` = the first True, `hi = lo + count`), found
once per tensor object and version and weakly held; the hull over a tile's rows comes
from a sparse table of minima. A tensor whose heads differ stays a plain tensor mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["row_intervals"]


def row_intervals(tensor: Tensor, S: int) -> tuple[Tensor, Tensor] | None:
    """(lo, hi), each (B|1, L|1) long: the keys `[lo, hi)` each row of a (B|1, 1, L|1,
    S|1) bool tensor may see (0, 0 for a row that sees none), for S keys; None where a
    row holds two runs or more."""
    t = tensor[:, 0]  # (B|1, L|1, S|1)
    if t.shape[-1] == 1:  # one value for every key: all of them or none
        hi = torch.where(t[..., 0], S, 0)
        return torch.zeros_like(hi), hi
    starts = (t[..., 1:] & ~t[..., :-1]).sum(-1) + t[..., 0]  # (B|1, L|1): runs per row
    if bool((starts > 1).any()):
        return None
    count = t.sum(-1)  # (B|1, L|1)
    lo = torch.where(count > 0, t.to(torch.uint8).argmax(-1), 0)  # the first True
    return lo, lo + count
