"""What a prepared call derives from its arguments, found once and kept for its runs.

A call's mask and sizes decide more than the backend: which rows and keys anybody sees,
a tile plan, a block mask, SDPA's mask tensor. `PlanValues` holds those for one prepared
call (`attnkit.call.prepared.Prepared`), so a backend finds them where it found them the
first time and keeps no cache of its own; a call that was not prepared gets a `PlanValues`
of its own, used once. Everything in it is for one device, one set of sizes and one
state of the mask's tensors: the prepared call that owns it is keyed by all three.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["PlanValues"]

T = TypeVar("T")


class PlanValues:
    """Values by name, each made by its first `get`."""

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}

    def get(self, name: str, make: Callable[[], T]) -> T:
        """The value called `name`, made by `make()` the first time it is asked for."""
        if name not in self._values:
            self._values[name] = make()
        value: T = self._values[name]
        return value
