"""Build attnkit's C++ kernels for the CPU they run on, once.

The sources in this folder are compiled by PyTorch's own extension builder
(`torch.utils.cpp_extension`, with ninja) with the host's flags (`-O3 -march=native
-fopenmp`, PyTorch's vector code for the CPU's widest unit) into one shared library of
`torch.library` ops. It is kept in `$ATTNKIT_NATIVE_DIR`, else
`$XDG_CACHE_HOME/attnkit/native` (else `~/.cache/attnkit/native`), under a key of the
sources, torch's version, the compiler, the CPU's features and the flags, so a process
that finds it built only loads it (no `cpp_extension` import). A build runs in a child
process that holds the key's lock (two processes never build the same key at once: the
second finds the library when the lock frees), saying how long it has run every ten
seconds (about half a minute on 2 cores); a failed one is remembered under its key
(until `python -m attnkit.native build` retries) with the compiler's first error line,
which `explain` gives as the reason `native` is unavailable, and the composed backends
serve instead. When a process loads the kernels, and whether a call waits for a build,
is `loader`'s.
`ATTNKIT_NATIVE`: `on` (the default: built ahead, else in the background while the
composed backends serve), `wait` (a first call waits for the build), `off` (no
kernels), `sanitize` (built with AddressSanitizer and UndefinedBehaviorSanitizer, for
`make sanitize`; waited for), `stages` (built with stage timers, for
`benchmarks/stages.py`; waited for).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

try:  # POSIX: the key's lock (elsewhere two processes may both build, harmlessly)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["SANITIZE", "SOURCES", "Home", "build", "cache_dir", "flags", "home", "setting"]

SOURCES = ("csrc/span_attention.cpp", "csrc/span_backward.cpp", "csrc/paged_decode.cpp")
# every header (a test checks the list)
HEADERS = (
    "csrc/backward.h",
    "csrc/backward_data.h",
    "csrc/blas.h",
    "csrc/common.h",
    "csrc/forward.h",
    "csrc/half.h",
    "csrc/micro.h",
    "csrc/queue.h",
    "csrc/stages.h",
)
NAME = "attnkit_native"
MODES = ("on", "wait", "off", "sanitize", "stages")
PROGRESS_EVERY = 10.0  # seconds between a blocking build's lines on stderr
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
STAGES = ["-DATTNKIT_STAGES"]  # the stage timers (csrc/stages.h)


def setting() -> str:
    """`ATTNKIT_NATIVE`: on (the default), wait, off, sanitize or stages; anything else raises."""
    mode = os.environ.get("ATTNKIT_NATIVE", "on").strip().lower() or "on"
    if mode not in MODES:
        raise ValueError(f"ATTNKIT_NATIVE={mode!r}: use one of {', '.join(MODES)}.")
    return mode


def cache_dir() -> Path:
    """Where built kernels are kept: `$ATTNKIT_NATIVE_DIR`, else
    `$XDG_CACHE_HOME/attnkit/native`."""
    if chosen := os.environ.get("ATTNKIT_NATIVE_DIR", "").strip():
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "attnkit" / "native"


def _capability() -> str:
    """PyTorch's vector code to compile in: the CPU's widest unit it has code for."""
    features = torch.backends.cpu.get_cpu_capability()  # DEFAULT, AVX2, AVX512, ...
    return {"AVX512": "AVX512", "AVX2": "AVX2"}.get(features, "DEFAULT")


def flags(mode: str) -> list[str]:
    cap = _capability()
    flags = [
        "-O3",
        "-march=native",
        "-fopenmp",
        f"-DCPU_CAPABILITY={cap}",
        f"-DCPU_CAPABILITY_{cap}",
    ]
    return flags + (SANITIZE if mode == "sanitize" else []) + (STAGES if mode == "stages" else [])


def _compiler() -> tuple[str, str] | None:
    """The C++ compiler `cpp_extension` runs (`$CXX`, else c++) and its version line."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return None
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return path, (version.stdout.splitlines() or [""])[0]


def _cpu() -> str:
    """The CPU's model and features as the kernel's flags see them."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    lines = [ln for ln in info.splitlines() if ln.split(":")[0].strip() in ("flags", "Features")]
    return platform.machine() + (lines[0] if lines else "")


def _key(mode: str, compiler: tuple[str, str]) -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update((here / source).read_bytes())
    for part in (torch.__version__, *compiler, _cpu(), *flags(mode), sys.version):
        digest.update(part.encode())
    return digest.hexdigest()[:20]


def _ninja_dir() -> str | None:
    """The folder of the `ninja` the builder runs: PATH's, else the PyPI package's."""
    if shutil.which("ninja"):
        return None
    try:
        import ninja  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    return str(ninja.BIN_DIR)


def _sanitizer_runtimes(cxx: str) -> list[str]:
    """The AddressSanitizer and UndefinedBehaviorSanitizer runtimes the compiler links."""
    names = ("libasan.so", "libubsan.so")
    printed = [
        subprocess.run([cxx, f"-print-file-name={n}"], capture_output=True, text=True)
        for n in names
    ]
    return [p.stdout.strip() for p in printed]


def _first_error(log: str) -> str:
    """The compiler's first error line (else the first line that says error)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    compiler = [ln for ln in lines if ": error:" in ln or ": fatal error:" in ln]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (compiler or errors or lines or ["no output"])[0][:300]


class Home(NamedTuple):
    """The folder of this key: the library, the remembered failure, the lock."""

    folder: Path

    @property
    def lib(self) -> Path:
        return self.folder / f"{NAME}.so"

    @property
    def failed(self) -> Path:
        return self.folder / "failed.txt"

    def state(self) -> tuple[Path | None, str | None]:
        """(the library, None) where built, (None, why) where its build failed, else
        (None, None): not built yet."""
        if self.lib.exists():
            return self.lib, None
        if self.failed.exists():
            return None, f"the build failed: {self.failed.read_text().strip()}"
        return None, None


def home() -> tuple[Home | None, str | None]:
    """This key's folder (the setting's flags, the compiler, the CPU), or None and the
    reason no build can be had (disabled, no compiler)."""
    mode = setting()
    if mode == "off":
        return None, "disabled by ATTNKIT_NATIVE=off"
    compiler = _compiler()
    if compiler is None:
        return None, "no C++ compiler (c++ or $CXX) on PATH: install g++ or clang++"
    return Home(cache_dir() / _key(_flag_mode(mode), compiler)), None


def _flag_mode(mode: str) -> str:
    """The flags' mode of a setting (`on` and `wait` build the same library)."""
    return "on" if mode == "wait" else mode


def build(*, quiet: bool = False, retry: bool = False) -> tuple[Path | None, str | None]:
    """The built library's path (building it where it is not: in a child process, once
    per key, under the key's lock), or None and the reason it cannot be had. A failed
    build is remembered under its key; `retry` (`python -m attnkit.native build`)
    forgets it first."""
    where, reason = home()
    if where is None:
        return None, reason
    if retry:
        where.failed.unlink(missing_ok=True)
    lib, reason = where.state()
    if lib is not None or reason is not None:
        return lib, reason
    where.folder.mkdir(parents=True, exist_ok=True)
    with open(where.folder / "lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process's build: wait for it
        lib, reason = where.state()
        if lib is not None or reason is not None:
            return lib, reason
        return _compile(where, quiet)


def _compile(where: Home, quiet: bool) -> tuple[Path | None, str | None]:
    """Run the compiler's child process and keep what it built (or why it failed)."""
    mode = _flag_mode(setting())
    compiler = _compiler()
    assert compiler is not None  # `home` found it
    folder = where.folder

    def say(text: str) -> None:
        if not quiet:
            print(text, file=sys.stderr, flush=True)

    say("attnkit: building its native kernels for this CPU (once; about half a minute)...")
    start, name = time.monotonic(), f"{NAME}_{folder.name}"
    env = dict(os.environ)
    if (ninja := _ninja_dir()) is not None:
        env["PATH"] = ninja + os.pathsep + env.get("PATH", "")
    if mode == "sanitize":  # the child loads what it built: their runtimes must come first
        env["LD_PRELOAD"] = " ".join(_sanitizer_runtimes(compiler[0]))
        env.setdefault("ASAN_OPTIONS", "detect_leaks=0")  # the interpreter's own, not ours
    child = [sys.executable, "-m", "attnkit.native.compile", str(folder / "build"), name, mode]
    (folder / "build").mkdir(exist_ok=True)
    log = folder / "build.log"
    with open(log, "w") as out:
        running = subprocess.Popen(child, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
        while True:
            try:
                running.wait(timeout=PROGRESS_EVERY)
                break
            except subprocess.TimeoutExpired:
                say(f"attnkit: still building ({time.monotonic() - start:.0f} s)...")
    built = folder / "build" / f"{name}.so"
    if running.returncode != 0 or not built.exists():
        reason = _first_error(log.read_text())
        where.failed.write_text(f"{reason} (log: {log})")
        return None, f"the build failed: {where.failed.read_text().strip()}"
    partial = folder / f"{NAME}.so.partial"
    shutil.copyfile(built, partial)
    partial.replace(where.lib)  # whole or absent for a process that looks at the same time
    say(f"attnkit: native kernels built in {time.monotonic() - start:.0f} s: {where.lib}")
    return where.lib, None
