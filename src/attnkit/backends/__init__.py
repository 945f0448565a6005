"""The registry of backends: one name each, one interface (`protocol.Backend`), and a
reason to refuse. `auto` runs the cheapest backend that can serve; `AUTO_ORDER` breaks
ties. A backend is one file and one line below (or `register` for one of a user's own):
the planner, `explain`, the gradients, the compiled op and the tests' fuzz harness find
it here, and nothing outside this package names one.
"""

from __future__ import annotations

from attnkit.backends.blockwise import BlockwiseBackend
from attnkit.backends.flex import FlexBackend
from attnkit.backends.native import NativeBackend
from attnkit.backends.protocol import Backend, Block, Inputs, Kernel, Probe, Work
from attnkit.backends.reference import ReferenceBackend
from attnkit.backends.sdpa import SdpaBackend
from attnkit.backends.tiled import TiledBackend

__all__ = [
    "AUTO_ORDER",
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
    "state",
    "unregister",
]

BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        ReferenceBackend(),
        SdpaBackend(),
        NativeBackend(),
        TiledBackend(),
        FlexBackend(),
        BlockwiseBackend(),
    )
}
AUTO_ORDER: list[str] = [
    "sdpa",
    "native",
    "tiled",
    "flex",
    "blockwise",
    "reference",
]  # ties: earlier wins


def backend_names() -> tuple[str, ...]:
    return ("auto", *BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend called `name`; an unknown name raises `ValueError` listing the valid ones."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {backend_names()}.")
    return BACKENDS[name]


_REGISTERED = [0]  # registrations and removals so far


def _stateful() -> list[Backend]:
    """The backends with a `version` of their own (the rest are always 0)."""
    return [b for b in BACKENDS.values() if type(b).version is not Backend.version]


_STATEFUL = _stateful()


def state() -> tuple[int, int]:
    """Changes when a backend is registered or removed, or one's own state changes what
    it costs (`Backend.version`: flex's kernels turning warm); prepared calls key on it."""
    return _REGISTERED[0], sum([b.version for b in _STATEFUL])


def register(backend: Backend) -> None:
    """Add `backend` under its `name` (last in `AUTO_ORDER`); a taken name raises."""
    if not isinstance(backend, Backend) or not isinstance(getattr(backend, "name", None), str):
        raise TypeError("register() takes a Backend (attnkit.backends.Backend) with a name.")
    if backend.name in BACKENDS or backend.name == "auto":
        raise ValueError(f"a backend called {backend.name!r} is registered already.")
    BACKENDS[backend.name] = backend
    AUTO_ORDER.append(backend.name)
    _REGISTERED[0] += 1
    _STATEFUL[:] = _stateful()


def unregister(name: str) -> None:
    """Remove the backend called `name` (one `register` added)."""
    get_backend(name)
    del BACKENDS[name]
    AUTO_ORDER.remove(name)
    _REGISTERED[0] += 1
    _STATEFUL[:] = _stateful()
