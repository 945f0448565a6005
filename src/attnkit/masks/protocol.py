"""What the helpers below the rule read of a mask (`ReadableMask`, a Protocol every
`MaskRule` satisfies), and the key spans a mask states (`Spans`).

The rule (`masks/rule.py`) hands a mask to the modules that draw it, turn it into a
block mask or read its spans; they take it as a `ReadableMask`, so they import nothing
of the rule, which imports them: the imports run one way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

__all__ = ["ReadableMask", "Spans"]


class Spans(NamedTuple):
    """Row i may see keys `lo[b, i] <= j < hi[b, i]` ((B|1, L|1) long; `hi <= lo`: none).

    `exact`: the row sees every key of its interval (one interval describes the mask);
    otherwise the interval is a superset (the keys outside it are hidden)."""

    lo: Tensor
    hi: Tensor
    exact: bool


class ReadableMask(Protocol):
    """A mask's methods the helpers read (`MaskRule` has them all; see it for each)."""

    @property
    def batch_size(self) -> int | None: ...

    @property
    def num_heads(self) -> int | None: ...

    @property
    def head_dependent(self) -> bool: ...

    def predicate(
        self, B: int, H: int, L: int, S: int, device: torch.device
    ) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]: ...

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None: ...

    def check(self, B: int, H: int, L: int, S: int) -> None: ...

    def tensors(self) -> tuple[Tensor, ...]: ...

    def dense(
        self,
        B: int,
        H: int,
        L: int,
        S: int,
        device: torch.device | str | None = None,
        rows: Tensor | None = None,
        cols: Tensor | None = None,
    ) -> Tensor: ...
