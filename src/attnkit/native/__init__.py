"""attnkit's own CPU kernels: C++ built for the CPU they run on (`build`), as
`torch.library` ops checked in Python before they reach C++ (`ops`).

The composed backends stay the fallback and the readable account of what the kernels
compute: `attnkit.reference` is their specification, and the `native` backend serves
`auto` only where the kernels are built and loaded (`unavailable()` says why not).
`python -m attnkit.native build` builds them ahead; a process that finds them unbuilt
builds them in the background while the composed backends serve (`loader`).
"""

from __future__ import annotations

from pathlib import Path

from attnkit import runtime

__all__ = ["library", "unavailable"]


def library() -> tuple[Path | None, str | None]:
    """The kernels loaded into this process, or None and the reason they are unavailable
    (being built in the background: for now)."""
    return runtime.current().kernels.get()


def unavailable() -> str | None:
    """Why the native kernels cannot run in this process now, or None where they can."""
    return runtime.current().kernels.unavailable()
