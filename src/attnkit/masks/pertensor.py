"""What was found about a tensor, kept per tensor object and held weakly.

A mask tensor passed again (every layer of every step) should not be read again: its
runs of keys (`intervals`), its `Mask` wrapper (on which the backends key their plans).
`PerTensor` keeps one value per tensor object under a key the caller chooses (its
version, sizes), and forgets it when the tensor goes; a tensor changed in place has a
new version, so a key that holds it finds nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Generic, TypeVar

from torch import Tensor

__all__ = ["PerTensor"]

V = TypeVar("V")


class PerTensor(Generic[V]):
    """Values by tensor object (weakly held) and key."""

    def __init__(self) -> None:
        # id(tensor) -> (a weak reference to it, the key, the value); the entry goes with
        # the tensor
        self._held: dict[int, tuple[weakref.ref[Tensor], Hashable, V]] = {}

    def get(self, tensor: Tensor, key: Hashable) -> V | None:
        entry = self._held.get(id(tensor))
        if entry is not None and entry[0]() is tensor and entry[1] == key:
            return entry[2]
        return None

    def put(self, tensor: Tensor, key: Hashable, value: V) -> V:
        ident, held = id(tensor), self._held

        def forget(ref: weakref.ref[Tensor]) -> None:
            entry = held.get(ident)
            if entry is not None and entry[0] is ref:
                del held[ident]

        held[ident] = (weakref.ref(tensor, forget), key, value)
        return value
