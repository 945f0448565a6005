"""The registry of backends: one name each, in one order.

The order breaks ties in `auto` (the earlier of two equal costs wins) and sets which
fused backward the gradients ask first (after the one that ran the forward); a backend a
user registers comes last. `changes` counts registrations and removals, and `state()`
adds the versions of the backends with state of their own (flex's kernels turning warm),
so prepared calls key on it and are made again when it moves.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from attnkit._compat import TorchFacts
from attnkit.backends.blockwise import BlockwiseBackend
from attnkit.backends.flex import FlexBackend
from attnkit.backends.native import NativeBackend
from attnkit.backends.protocol import Backend, PagedDecode
from attnkit.backends.reference import ReferenceBackend
from attnkit.backends.sdpa import SdpaBackend
from attnkit.backends.tiled import TiledBackend
from attnkit.call.precision import HalfKernels
from attnkit.native.loader import Kernels

__all__ = ["Registry", "built_in"]


def built_in(kernels: Kernels, facts: TorchFacts, half: HalfKernels) -> list[Backend]:
    """attnkit's backends, in their order (ties go to the earlier), sharing the runtime's
    native kernels, torch's facts and what half inputs compute in."""
    return [
        SdpaBackend(facts, half),
        NativeBackend(kernels, half),
        TiledBackend(half),
        FlexBackend(half),
        BlockwiseBackend(),
        ReferenceBackend(),
    ]


class Registry:
    """Backends by name, in one order; `register` adds one last, `unregister` removes it."""

    def __init__(self, backends: list[Backend]) -> None:
        self._by_name = {b.name: b for b in backends}
        self._stateful = self._with_state()
        self.changes = 0

    def __iter__(self) -> Iterator[Backend]:
        return iter(self._by_name.values())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def names(self) -> tuple[str, ...]:
        """ "auto" and every backend's name, in order."""
        return ("auto", *self._by_name)

    def get(self, name: str) -> Backend:
        """The backend called `name`; an unknown name raises `ValueError` listing them."""
        if name not in self._by_name:
            raise ValueError(f"unknown backend {name!r}; choose one of {self.names()}.")
        return self._by_name[name]

    def paged_decode(self, step: PagedDecode) -> tuple[Tensor, Tensor] | None:
        """The paged decoding step by the first backend, in order, with a kernel for it
        (`Backend.paged_decode`); None where none has (the caller gathers and attends)."""
        for backend in self._by_name.values():
            result = backend.paged_decode(step)
            if result is not None:
                return result
        return None

    def state(self) -> tuple[int, int]:
        """Changes when a backend is registered or removed, or one's own state changes
        what it costs (`Backend.version`)."""
        return self.changes, sum([b.version for b in self._stateful])

    def register(self, backend: Backend) -> None:
        """Add `backend` under its `name`, last in the order; a taken name raises."""
        if not isinstance(backend, Backend) or not isinstance(getattr(backend, "name", None), str):
            raise TypeError("register() takes a Backend (attnkit.backends.Backend) with a name.")
        if backend.name in self._by_name or backend.name == "auto":
            raise ValueError(f"a backend called {backend.name!r} is registered already.")
        self._by_name[backend.name] = backend
        self._changed()

    def unregister(self, name: str) -> None:
        """Remove the backend called `name` (one `register` added)."""
        self.get(name)
        del self._by_name[name]
        self._changed()

    def _changed(self) -> None:
        self.changes += 1
        self._stateful = self._with_state()

    def _with_state(self) -> list[Backend]:
        """The backends with a `version` of their own (the rest are always 0)."""
        return [b for b in self._by_name.values() if type(b).version is not Backend.version]
