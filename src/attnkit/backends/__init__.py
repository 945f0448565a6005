"""The registry of backends: one name each, one interface (`protocol.Backend`), and a
reason to refuse. `auto` runs the cheapest backend that can serve; `AUTO_ORDER` breaks
ties.
"""

from __future__ import annotations

from attnkit.backends.blockwise import BlockwiseBackend
from attnkit.backends.flex import FlexBackend
from attnkit.backends.protocol import Backend, Block, Kernel, Work
from attnkit.backends.reference import ReferenceBackend
from attnkit.backends.sdpa import SdpaBackend
from attnkit.backends.tiled import TiledBackend

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "Backend",
    "Block",
    "Kernel",
    "Work",
    "backend_names",
    "get_backend",
]

BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (ReferenceBackend(), SdpaBackend(), TiledBackend(), FlexBackend(), BlockwiseBackend())
}
AUTO_ORDER: tuple[str, ...] = (
    "sdpa",
    "tiled",
    "flex",
    "blockwise",
    "reference",
)  # ties: earlier wins


def backend_names() -> tuple[str, ...]:
    return ("auto", *BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend called `name`; an unknown name raises `ValueError` listing the valid ones."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {backend_names()}.")
    return BACKENDS[name]
