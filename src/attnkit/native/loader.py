"""Load the native kernels into this process, without a call ever waiting on a compiler.

A process that finds the kernels built for its key loads them at its first question
(`Kernels.get`, asked by the planner through `unavailable()`). Where they are not built
yet, `ATTNKIT_NATIVE=on` (the default) starts the build in the background (a child
process of its own session, `python -m attnkit.native background`, its log beside the
library) and answers "unavailable: being built": the composed backends serve, `explain`
says so, and the process looks for the library again at most once a second, loading it
when it appears (the backend's `version` changes, so calls planned meanwhile are planned
again). A line on stderr says when the build starts and when its kernels are loaded.
`ATTNKIT_NATIVE=wait` (and `sanitize`) build in the foreground instead, the first call
waiting; two processes starting at once still build once (the key's lock, `build`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from attnkit.native.build import Home, build, home, setting

__all__ = ["Kernels"]

LOOK_EVERY = 1.0  # seconds between looks for a library being built in the background


class _Background:
    """A build running in a child process: looked at once a second, never waited for."""

    def __init__(self, where: Home) -> None:
        where.folder.mkdir(parents=True, exist_ok=True)
        self.where, self.started = where, time.monotonic()
        self.log = where.folder / f"background-{os.getpid()}.log"
        with open(self.log, "w") as out:
            command = [sys.executable, "-m", "attnkit.native", "background"]
            self.child = subprocess.Popen(
                command, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.next_look = 0.0
        print(
            "attnkit: building its native kernels for this CPU in the background (about half a "
            f"minute; log: {self.log}); the composed backends serve meanwhile "
            "(ATTNKIT_NATIVE=wait waits for them instead).",
            file=sys.stderr,
            flush=True,
        )

    @property
    def reason(self) -> str:
        took = time.monotonic() - self.started
        return (
            f"being built in the background for this CPU ({took:.0f} s so far; log: "
            f"{self.log}); the composed backends serve until it is done (ATTNKIT_NATIVE=wait "
            "waits for it)"
        )

    def done(self) -> bool:
        """The library or a failure is there, or the child ended (looked at once a second)."""
        now = time.monotonic()
        if now < self.next_look:
            return False
        self.next_look = now + LOOK_EVERY
        lib, failed = self.where.state()
        return lib is not None or failed is not None or self.child.poll() is not None


class Kernels:
    """What this process knows of its kernels: loaded or unavailable for good (`result`),
    or being built in the background (`building`). The runtime holds one
    (`attnkit.runtime`: a library loads into a process once, so a fresh runtime shares
    its process's)."""

    def __init__(self) -> None:
        self.result: tuple[Path | None, str | None] | None = None
        self.building: _Background | None = None

    def get(self) -> tuple[Path | None, str | None]:
        if self.result is not None:
            return self.result
        if self.building is not None:
            if not self.building.done():
                return None, self.building.reason
            self.result = self._settled(*self.building.where.state())
            return self.result
        if setting() == "on":
            where = home()[0]
            if where is not None and where.state() == (None, None):
                self.building = _Background(where)
                return None, self.building.reason
        self.result = self._settled(*build())
        return self.result

    def _settled(self, path: Path | None, reason: str | None) -> tuple[Path | None, str | None]:
        if path is None and reason is None:  # the background child ended with neither
            assert self.building is not None
            reason = f"the background build stopped without a library (log: {self.building.log})"
        if path is None:
            return None, reason
        try:
            torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
        except (OSError, RuntimeError) as error:
            return None, f"the built library does not load: {str(error).splitlines()[0][:300]}"
        from attnkit.native import backward, ops

        ops.register_fakes()
        backward.register_autograd()
        if self.building is not None:
            took = time.monotonic() - self.building.started
            loaded = f"attnkit: native kernels loaded ({took:.0f} s after the build began)."
            print(loaded, file=sys.stderr, flush=True)
        return path, None

    def unavailable(self) -> str | None:
        """Why the kernels cannot run in this process now, or None where they can."""
        return self.get()[1]

    @property
    def version(self) -> int:
        """0 until the kernels are loaded, then 1 (plans made meanwhile are made again)."""
        return 1 if self.get()[0] is not None else 0
