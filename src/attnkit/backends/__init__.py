"""The registry of backends: one name each, identical signatures, and a reason to refuse.

Each backend has `name`, `can_use(call, need_lse=...) -> str | None` (None = can serve,
else why not), `cost(call, need_lse=...)` (estimated time, in units of one query-key pair
of one head in SDPA's dense kernel: see `attnkit.cost`), `peak_bytes(call, need_lse=...)`
(estimated extra memory) and `run(call, need_lse=...) -> (out, lse | None)`. `auto`
runs the cheapest backend that can serve; `AUTO_ORDER` breaks ties.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from attnkit.backends.blockwise import BlockwiseBackend
from attnkit.backends.flex import FlexBackend
from attnkit.backends.reference import ReferenceBackend
from attnkit.backends.sdpa import SdpaBackend
from attnkit.backends.tiled import TiledBackend
from attnkit.contracts import AttentionCall

__all__ = ["AUTO_ORDER", "BACKENDS", "Backend", "backend_names", "get_backend"]


class Backend(Protocol):
    name: str

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None: ...

    def cost(self, call: AttentionCall, *, need_lse: bool) -> float: ...

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int: ...

    def run(self, call: AttentionCall, *, need_lse: bool) -> tuple[Tensor, Tensor | None]: ...


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
