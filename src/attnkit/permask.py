"""Caches per mask: where the dispatcher and the backends keep what they prepared for a
mask (prepared calls, tile plans, block masks), so that a mask is a value and holds none.

A mask of numbers alone (`causal()`, `sliding_window(128)`, their `&`) is found by its
structure (`masks.structure.value_key`): a mask built anew each step finds what an equal
one left. Any other mask (one holding tensors or a function) is found by its object,
held weakly; a tensor given as the mask by that tensor object (`as_mask` wraps it anew at
every call, so the wrapper would be new each time). An entry goes with its object. What
a holder keeps inside is keyed by the caller with the mask's state (the identity and
version of its tensors), and bounded (`Bounded`); masks kept by structure are bounded too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from torch import Tensor

from attnkit.bounded import Bounded
from attnkit.masks import Mask
from attnkit.masks.structure import value_key
from attnkit.masks.tensor import given_tensor

__all__ = ["STRUCTURES_KEPT", "PerMask"]

STRUCTURES_KEPT = 64  # masks of numbers alone remembered by structure, per cache

H = TypeVar("H")  # what a cache holds for one mask


class PerMask(Generic[H]):
    """One holder per mask (`make(mask)` builds it on first sight), and one for None."""

    def __init__(self, make: Callable[[Mask | Tensor | None], H]) -> None:
        self._make = make
        self._unmasked: H | None = None
        # id(object) -> (a weak reference to it, its holder); the entry goes when it dies
        self._by_object: dict[int, tuple[weakref.ref[object], H]] = {}
        self._by_structure: Bounded[tuple[object, ...], H] = Bounded(STRUCTURES_KEPT)

    def of(self, mask: Mask | Tensor | None) -> H:
        """The holder of `mask`: the one of its structure, its tensor or itself."""
        if mask is None:
            if self._unmasked is None:
                self._unmasked = self._make(None)
            return self._unmasked
        entry = self._by_object.get(id(mask))
        if entry is not None and entry[0]() is mask:
            return entry[1]
        given = given_tensor(mask) if isinstance(mask, Mask) else None
        if given is not None:  # the caller's tensor outlives its wrapper
            return self.of(given)
        structure = value_key(mask) if isinstance(mask, Mask) else None
        if structure is None:
            held = self._make(mask)
        else:
            found = self._by_structure.get(structure)
            if found is None:
                found = self._by_structure.put(structure, self._make(mask))
            held = found
        self._by_object[id(mask)] = (weakref.ref(mask, self._forget(id(mask))), held)
        return held

    def __contains__(self, mask: object) -> bool:
        entry = self._by_object.get(id(mask))
        return entry is not None and entry[0]() is mask

    def clear(self) -> None:
        self._unmasked = None
        self._by_object.clear()
        self._by_structure.clear()

    def _forget(self, ident: int) -> Callable[[weakref.ref[object]], None]:
        """The callback that drops a dead object's entry (unless a new one took its id)."""
        by_object = self._by_object  # held here: the cache may be gone at exit

        def forget(ref: weakref.ref[object]) -> None:
            entry = by_object.get(ident)
            if entry is not None and entry[0] is ref:
                del by_object[ident]

        return forget
