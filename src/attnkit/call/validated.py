"""A validated attention call: its sizes (`Dims`) and what every backend receives
(`AttentionCall`: q, k, v as the kernels take them, the mask, scale, softcap, dropout,
what its runs derive, and the cost table it is priced with). `attnkit.contracts` makes
one from a user's arguments (`normalize_call`), checking each once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from attnkit.call.cost import CostTable
from attnkit.call.plan_values import PlanValues
from attnkit.masks import Mask, structure

__all__ = ["AttentionCall", "Dims"]


@dataclass(frozen=True)
class Dims:
    """The letters of one call: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)."""

    B: int
    H: int
    Hkv: int
    L: int
    S: int
    D: int
    Dv: int

    @property
    def groups(self) -> int:
        """G = H // Hkv query heads share one K/V head (1 when there are no heads)."""
        return self.H // self.Hkv if self.Hkv else 1


@dataclass(frozen=True)
class AttentionCall:
    """A validated attention call: what every backend receives."""

    q: Tensor  # (B, H, L, D)
    k: Tensor  # (B, Hkv, S, D)
    v: Tensor  # (B, Hkv, S, Dv)
    mask: Mask | None  # True = may attend (and maybe a structured bias, `Mask.has_bias`)
    bias_tensor: Tensor | None  # a float mask: additive, broadcastable to (B, H, L, S)
    scale: float
    softcap: float | None
    dropout_p: float
    dims: Dims
    # what the call derives from its mask and sizes (seen rows, tile plan, ...): shared
    # by every run of one prepared call
    plan_values: PlanValues = field(default_factory=PlanValues, compare=False)
    grad: bool | None = None  # planned as if autograd records (None: as it does now)
    # the cost table it is priced with: the runtime's when it was planned (None: a call
    # that is never priced)
    table: CostTable | None = field(default=None, compare=False)

    @property
    def is_dense(self) -> bool:
        """Every query sees every key with no bias: no mask reaches a kernel."""
        d = self.dims
        return not self.has_bias and (self.mask is None or self.mask.sees_all(d.L, d.S))

    @property
    def has_bias(self) -> bool:
        """Something is added to the scores: a float tensor mask or a structured bias."""
        return self.bias_tensor is not None or (self.mask is not None and self.mask.has_bias)

    @cached_property
    def bias(self) -> Tensor | None:
        """Every additive bias as one tensor broadcastable to (B, H, L, S) (dense backends)."""
        return self.bias_rows(None)

    def bias_rows(self, rows: Tensor | None) -> Tensor | None:
        """The additive bias of query `rows` only: (B|1, H|1, R|1, S|1), or None."""
        bias = self.bias_tensor
        if bias is not None:
            bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
            bias = bias if rows is None or bias.shape[2] == 1 else bias[:, :, rows]
        if self.mask is not None and self.mask.has_bias:
            d = self.dims
            structured = structure.dense_bias(
                self.mask, d.B, d.H, d.L, d.S, self.q.device, rows=rows
            )
            assert structured is not None
            bias = structured if bias is None else bias + structured
        return bias

    @property
    def is_empty(self) -> bool:
        """Nothing to compute: no output element (B, H, L or Dv = 0) or no key (S = 0).

        Then the output is all zeros (with S = 0 every query sees nothing, as an empty
        row does) and the log-sum-exp all `-inf`.
        """
        d = self.dims
        return d.B * d.H * d.L * d.Dv == 0 or d.S == 0

    @property
    def requires_grad(self) -> bool:
        """Autograd will need a backward pass through this call (or `grad` says so)."""
        if self.grad is not None:
            return self.grad
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.q, self.k, self.v))
