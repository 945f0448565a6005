"""Build attnkit's C++ kernels for the CPU they run on, once, and load them.

The sources in this folder are compiled by PyTorch's own extension builder
(`torch.utils.cpp_extension`, with ninja) with the host's flags (`-O3 -march=native
-fopenmp`, PyTorch's vector code for the CPU's widest unit) into one shared library of
`torch.library` ops. It is kept in `$ATTNKIT_NATIVE_DIR`, else
`$XDG_CACHE_HOME/attnkit/native` (else `~/.cache/attnkit/native`), under a key of the
sources, torch's version, the compiler, the CPU's features and the flags, so a process
that finds it built only loads it (no `cpp_extension` import). A build runs in a child
process, with a line on stderr while it runs (about half a minute on 2 cores); a failed
one is remembered under its key (until `python -m attnkit.native build` retries) with
the compiler's first error line, which `explain` gives as the reason `native` is
unavailable, and the composed backends serve instead.
`ATTNKIT_NATIVE=off` disables the kernels (`=sanitize` builds them with AddressSanitizer
and UndefinedBehaviorSanitizer, for `make sanitize`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

__all__ = [
    "SANITIZE",
    "SOURCES",
    "build",
    "cache_dir",
    "flags",
    "library",
    "setting",
    "unavailable",
]

SOURCES = ("csrc/span_attention.cpp", "csrc/span_backward.cpp", "csrc/paged_decode.cpp")
HEADERS = ("csrc/common.h", "csrc/micro.h")  # every header: a test checks the list
NAME = "attnkit_native"
MODES = ("on", "off", "sanitize")
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]


def setting() -> str:
    """`ATTNKIT_NATIVE`: on (the default), off, or sanitize; anything else raises."""
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
    return flags + (SANITIZE if mode == "sanitize" else [])


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
    printed = [subprocess.run([cxx, f"-print-file-name={n}"], capture_output=True, text=True)
               for n in names]  # fmt: skip
    return [p.stdout.strip() for p in printed]


def _first_error(log: str) -> str:
    """The compiler's first error line (else the first line that says error)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    compiler = [ln for ln in lines if ": error:" in ln or ": fatal error:" in ln]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (compiler or errors or lines or ["no output"])[0][:300]


def build(*, quiet: bool = False, retry: bool = False) -> tuple[Path | None, str | None]:
    """The built library's path (building it where it is not: in a child process, once
    per key), or None and the reason it cannot be had. A failed build is remembered
    under its key; `retry` (`python -m attnkit.native build`) forgets it first."""
    mode = setting()
    if mode == "off":
        return None, "disabled by ATTNKIT_NATIVE=off"
    compiler = _compiler()
    if compiler is None:
        return None, "no C++ compiler (c++ or $CXX) on PATH: install g++ or clang++"
    home = cache_dir() / _key(mode, compiler)
    lib, failed = home / f"{NAME}.so", home / "failed.txt"
    if retry:
        failed.unlink(missing_ok=True)
    if lib.exists():
        return lib, None
    if failed.exists():
        return None, f"the build failed: {failed.read_text().strip()}"
    home.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(
            "attnkit: building its native kernels for this CPU (once; about half a minute)...",
            file=sys.stderr,
            flush=True,
        )
    start, name = time.monotonic(), f"{NAME}_{home.name}"
    env = dict(os.environ)
    if (ninja := _ninja_dir()) is not None:
        env["PATH"] = ninja + os.pathsep + env.get("PATH", "")
    if mode == "sanitize":  # the child loads what it built: their runtimes must come first
        env["LD_PRELOAD"] = " ".join(_sanitizer_runtimes(compiler[0]))
        env.setdefault("ASAN_OPTIONS", "detect_leaks=0")  # the interpreter's own, not ours
    child = [sys.executable, "-m", "attnkit.native.compile", str(home / "build"), name, mode]
    (home / "build").mkdir(exist_ok=True)
    done = subprocess.run(child, capture_output=True, text=True, env=env)
    built = home / "build" / f"{name}.so"
    if done.returncode != 0 or not built.exists():
        reason = _first_error(done.stderr + done.stdout)
        (home / "build.log").write_text(done.stdout + done.stderr)
        failed.write_text(f"{reason} (log: {home / 'build.log'})")
        return None, f"the build failed: {failed.read_text().strip()}"
    partial = home / f"{NAME}.so.partial"
    shutil.copyfile(built, partial)
    partial.replace(lib)  # whole or absent for a process that looks at the same time
    if not quiet:
        took = time.monotonic() - start
        print(f"attnkit: native kernels built in {took:.0f} s: {lib}", file=sys.stderr)
    return lib, None


@functools.cache
def library() -> tuple[Path | None, str | None]:
    """The kernels loaded into this process (built first where they are not), or None and
    the reason they are unavailable: once per process."""
    path, reason = build()
    if path is None:
        return None, reason
    try:
        torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError) as error:
        return None, f"the built library does not load: {str(error).splitlines()[0][:300]}"
    from attnkit.native import backward, ops

    ops.register_fakes()
    backward.register_autograd()
    return path, None


def unavailable() -> str | None:
    """Why the native kernels cannot run in this process, or None where they can."""
    return library()[1]
