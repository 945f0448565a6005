"""The backends: one name each, one interface (`protocol.Backend`), and a reason to
refuse. `auto` runs the cheapest backend that can serve; the registry's order
(`registry`) breaks ties. A backend is one file and one line in `registry.built_in` (or
`register` for one of a user's own): the planner, `explain`, the gradients, the compiled
op and the tests' fuzz harness find it in the runtime's registry (`attnkit.runtime`), and
nothing outside this package names one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from attnkit import runtime
from attnkit.backends.protocol import Backend, Block, Inputs, Kernel, Probe, Work

__all__ = [
    "BACKENDS",
    "Backend",
    "Block",
    "Inputs",
    "Kernel",
    "Probe",
    "Work",
    "backend_names",
    "get_backend",
    "register",
    "unregister",
]


class _Registered(Mapping[str, Backend]):
    """The current runtime's backends by name, in order (read only)."""

    def __getitem__(self, name: str) -> Backend:
        if name not in runtime.current().backends:
            raise KeyError(name)
        return runtime.current().backends.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(runtime.current().backends.names()[1:])

    def __len__(self) -> int:
        return len(runtime.current().backends.names()) - 1


BACKENDS: Mapping[str, Backend] = _Registered()  # a view: the registry is the runtime's


def backend_names() -> tuple[str, ...]:
    """ "auto" and every registered backend's name, in the registry's order."""
    return runtime.current().backends.names()


def get_backend(name: str) -> Backend:
    """The backend called `name`; an unknown name raises `ValueError` listing the valid ones."""
    return runtime.current().backends.get(name)


def register(backend: Backend) -> None:
    """Add `backend` under its `name` (last in the order); a taken name raises."""
    runtime.current().backends.register(backend)


def unregister(name: str) -> None:
    """Remove the backend called `name` (one `register` added)."""
    runtime.current().backends.unregister(name)
