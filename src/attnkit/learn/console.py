"""The `attnkit` command's console: drawings in ASCII where the encoding lacks them, a
quiet exit on a closed pipe, and a progress bar for long runs.

A console whose encoding cannot write `■` (cp1252 on many Windows consoles, `C`
locales) gets `#` instead: every character the command prints goes through one error
handler that writes the ASCII spelling of what the encoding lacks.
"""

from __future__ import annotations

import codecs
import os
import sys
import time
import unicodedata
from collections.abc import Callable
from typing import TextIO

__all__ = ["ASCII", "Progress", "prepare", "quiet_on_closed_pipe"]

# the ASCII spelling of each character the command draws or writes
ASCII = {
    "■": "#",
    "·": ".",
    "─": "-",
    "✓": "ok",
    "✗": "XX",
    "→": "->",
    "×": "x",
    "√": "sqrt",
    "ᵀ": "^T",
    "²": "^2",
    "≈": "~",
    "≤": "<=",
    "≥": ">=",
    "…": "...",
    "›": ">",
    "§": "S",
    "⌈": "ceil(",
    "⌉": ")",
    "∩": "&",
    "—": "-",
    "–": "-",
    "−": "-",
    "█": "#",
    "░": "-",
}
ERRORS = "attnkit-ascii"


def _spelling(char: str) -> str:
    if char in ASCII:
        return ASCII[char]
    plain = unicodedata.normalize("NFKD", char).encode("ascii", "ignore").decode()
    return plain or "?"


def _ascii_instead(err: UnicodeError) -> tuple[str, int]:
    if not isinstance(err, UnicodeEncodeError):
        raise err
    return "".join(map(_spelling, err.object[err.start : err.end])), err.end


codecs.register_error(ERRORS, _ascii_instead)


def prepare(stream: TextIO) -> None:
    """Let `stream` take any text: what its encoding lacks is written in ASCII."""
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors=ERRORS)


def quiet_on_closed_pipe(command: Callable[[], int]) -> int:
    """Run `command`; a reader that left early (`attnkit tour | head -1`) ends it quietly.

    The reader has what it asked for, so the exit status is 0. Python would report the
    pipe again when it flushes stdout at exit, so stdout is pointed at the null device.
    """
    try:
        status = command()
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


class Progress:
    """A one-line bar on a terminal's stream, drawn only once a run passes `after` seconds.

    Short runs print nothing; a stream that is not a terminal (a log, a pipe) gets no bar.
    """

    def __init__(self, total: int, stream: TextIO | None = None, after: float = 2.0) -> None:
        self.total, self.done = total, 0
        self.stream = sys.stderr if stream is None else stream
        self.after, self.start, self.drawn = after, time.perf_counter(), False

    def step(self, label: str) -> None:
        """One more unit of work done, `label` naming the next one."""
        self.done += 1
        if not self.stream.isatty() or time.perf_counter() - self.start < self.after:
            return
        filled = 24 * self.done // max(self.total, 1)
        bar = "█" * filled + "░" * (24 - filled)
        self.stream.write(f"\r{bar} {self.done}/{self.total} {label[:40]:<40}")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        """Clear the bar so the table that follows starts on a clean line."""
        if self.drawn:
            self.stream.write("\r" + " " * 72 + "\r")
            self.stream.flush()
