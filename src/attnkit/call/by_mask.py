"""Caches per mask: where the dispatcher keeps the prepared calls of a mask, so that a
mask is a value and holds none.

A mask is found by its object, held weakly (the entry goes with it), and else by its
value (`masks.structure.value_key`), so a mask built anew each call finds what an equal
one left: `causal()` built each step, the window of a context-parallel piece, a mask
the compiled op decoded. A value holding tensors holds their identity (their contents
are the fit's), and a part without a value of its own (a `from_mod` mask inside a
window) its own identity: the entry is trusted only while those objects live and are
the same (held weakly, it goes when one of them goes). A function is never a value: it
may read data changed in place, so a `from_mod` mask built anew is planned anew. A
tensor given as the mask, or wrapped by `as_mask` (anew at every call), is found by
that tensor object. What a holder keeps inside is keyed by
the caller with the mask's state (the identity and version of its tensors), and bounded
(`Recent`); masks found by value are bounded too.

A mask's value is its public attributes (`Mask._fields`); what a kind remembers about
itself (the caller's tensor, a tensor mask's row intervals per version) is private and
no part of it. The caller's tensor is kept by every wrapper `as_mask` makes of it
(`masks.base.given_tensor`).

`MaskTensors` finds the tensors a mask's state is made of once, and gives that state
(`mask_state`: their identity, version and size), which every key of a prepared call
holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from torch import Tensor

from attnkit.call.recent import Recent
from attnkit.masks import Mask
from attnkit.masks.base import given_tensor
from attnkit.masks.structure import value_key

__all__ = ["STRUCTURES_KEPT", "ByMask", "MaskTensors", "mask_state"]

MaskArg = Mask | Tensor | None

STRUCTURES_KEPT = 64  # masks remembered by value, per cache

H = TypeVar("H")  # what a cache holds for one mask
Refs = tuple[weakref.ref[object], ...]


class ByMask(Generic[H]):
    """One holder per mask (`make(mask)` builds it on first sight), and one for None."""

    def __init__(self, make: Callable[[Mask | Tensor | None], H]) -> None:
        self._make = make
        self._unmasked: H | None = None
        # id(object) -> (a weak reference to it, its holder); the entry goes when it dies
        self._by_object: dict[int, tuple[weakref.ref[object], H]] = {}
        # value key -> (weak references to the objects it names, the holder)
        self._by_value: Recent[tuple[object, ...], tuple[Refs, H]] = Recent(STRUCTURES_KEPT)

    def of(self, mask: Mask | Tensor | None) -> H:
        """The holder of `mask`: the one of its object, its tensor or its value."""
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
        holder = self._by_value_of(mask) if isinstance(mask, Mask) else self._make(mask)
        self._by_object[id(mask)] = (weakref.ref(mask, self._forget(id(mask))), holder)
        return holder

    def _by_value_of(self, mask: Mask) -> H:
        """The holder of an equal mask, or a new one kept under `mask`'s value."""
        objects: list[object] = []
        key = value_key(mask, objects)
        if key is None:
            return self._make(mask)
        entry = self._by_value.get(key)
        if entry is not None and all(r() is x for r, x in zip(entry[0], objects, strict=True)):
            return entry[1]
        try:
            refs = tuple(weakref.ref(x, self._drop(key)) for x in objects)
        except TypeError:  # an object without weak references (a builtin): itself only
            return self._make(mask)
        holder = self._make(mask)
        self._by_value.put(key, (refs, holder))
        return holder

    def __contains__(self, mask: object) -> bool:
        entry = self._by_object.get(id(mask))
        return entry is not None and entry[0]() is mask

    def clear(self) -> None:
        self._unmasked = None
        self._by_object.clear()
        self._by_value.clear()

    def _forget(self, ident: int) -> Callable[[weakref.ref[object]], None]:
        """The callback that drops a dead object's entry (unless a new one took its id)."""
        by_object = self._by_object  # held here: the cache may be gone at exit

        def forget(ref: weakref.ref[object]) -> None:
            entry = by_object.get(ident)
            if entry is not None and entry[0] is ref:
                del by_object[ident]

        return forget

    def _drop(self, key: tuple[object, ...]) -> Callable[[weakref.ref[object]], None]:
        """The callback that drops a value entry when an object it names dies (unless
        the entry under the key is another's by then)."""
        by_value = self._by_value

        def drop(ref: weakref.ref[object]) -> None:
            entry = by_value.peek(key)
            if entry is not None and any(r is ref for r in entry[0]):
                by_value.pop(key)

        return drop


# ------------------------------------------------------------------ a mask's state


class MaskTensors:
    """The tensors a mask's state is made of, found once: the caller's tensor given as
    the mask (or wrapped by `as_mask`), else every tensor the mask holds. `weak`: they
    are held weakly (a cache keyed by them must not keep them alive; it is asked while
    the mask lives)."""

    def __init__(self, mask: MaskArg, *, weak: bool = False) -> None:
        given = mask if isinstance(mask, Tensor) else None
        if isinstance(mask, Mask):
            given = given_tensor(mask)
        self._given = given is not None
        tensors: tuple[Tensor, ...] = (given,) if given is not None else ()
        if given is None and isinstance(mask, Mask):
            tensors = mask.tensors()
        self._tensors = tuple(map(weakref.ref, tensors)) if weak else tuple(map(_Strong, tensors))
        self.has_tensors = bool(tensors)  # a mask of numbers alone: its state is ()

    def state(self) -> tuple[object, ...]:
        """The identity, version and size of each: a tensor changed in place has a new
        version, so a key that holds it finds nothing."""
        tensors = [ref() for ref in self._tensors]
        if any(t is None for t in tensors):  # gone: a state no key holds
            return (object(),)
        if self._given:
            given = tensors[0]
            assert given is not None  # found by it: alive
            return (
                given.data_ptr(),
                given._version,
                given.shape,
                given.stride(),
                given.dtype,
                given.device,
            )
        return tuple((t.data_ptr(), t._version, t.shape) for t in tensors if t is not None)


class _Strong:
    """A tensor held strongly, read as a weak reference is (`kept()`)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def __call__(self) -> Tensor:
        return self.tensor


def mask_state(mask: MaskArg) -> tuple[object, ...]:
    """`MaskTensors(mask).state()`: what a fit holds of the mask."""
    return MaskTensors(mask).state()
