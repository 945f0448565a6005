"""The one rule by which attnkit's caches forget: at most N entries, least recently used
first.

The one cache of prepared calls (`dispatch`) is keyed by everything that decides a
call, a mask by the identity and version of its tensors, and bounded by these.

That cache is the runtime's (`attnkit.runtime`: `Runtime.calls`), which holds all the
process remembers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Recent"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Recent(Generic[K, V]):
    """A mapping of at most `size` entries; `get` counts as a use."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a cache holds at least one entry, got size={size}.")
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> V:
        """Keep `value` under `key` (the least recently used entry goes past `size`)."""
        self._items[key] = value
        self._items.move_to_end(key)
        if len(self._items) > self.size:
            self._items.popitem(last=False)
        return value

    def peek(self, key: K) -> V | None:
        """The value under `key`, not counted as a use."""
        return self._items.get(key)

    def pop(self, key: K) -> None:
        self._items.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()
