"""No call waits on a compiler (`attnkit.native.loader`): a process that finds the
kernels unbuilt builds them in the background while the composed backends serve, and
two processes starting at once build once. A stand-in compiler that fails after two
seconds keeps these tests off the real build."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

FIRST_CALLS = """
import time, torch, attnkit as ak
q = torch.randn(1, 2, 128, 32)
mask = ak.causal() & ak.sliding_window(8)
times = []
for _ in range(2):
    start = time.perf_counter()
    ak.attention(q, q, q, mask)
    times.append(time.perf_counter() - start)
print(times[0], times[1])
print(ak.explain(q, q, q, mask).reasons["native"])
deadline = time.monotonic() + 90
while "being built" in str(ak.explain(q, q, q, mask).reasons["native"]):
    assert time.monotonic() < deadline, "the background build never ended"
    time.sleep(0.5)
print(ak.explain(q, q, q, mask).reasons["native"])
"""


def _stand_in_compiler(folder: Path) -> Path:
    cxx = folder / "c++"
    cxx.write_text(
        '#!/bin/sh\ncase "$1" in --version) echo "stand-in c++ 1.0";;\n'
        '*) sleep 2; echo "stand-in: error: compiles nothing" >&2; exit 1;; esac\n'
    )
    cxx.chmod(0o755)
    return cxx


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "ATTNKIT_NATIVE": "on",
        "ATTNKIT_NATIVE_DIR": str(tmp_path / "kernels"),
        "CXX": str(_stand_in_compiler(tmp_path)),
    }


def test_a_first_call_in_a_fresh_cache_does_not_wait_for_the_build(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", FIRST_CALLS], capture_output=True, text=True, env=_env(tmp_path)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = map(float, done.stdout.splitlines()[0].split())
    assert first - second < 1.0, (first, second)  # the build is not the call's
    building, after = done.stdout.splitlines()[1:3]
    assert "being built in the background" in building and "ATTNKIT_NATIVE=wait" in building
    assert "the build failed" in after and "stand-in: error" in after
    assert "in the background" in done.stderr  # the process says what it started


def test_two_processes_starting_at_once_build_once(tmp_path):
    env = _env(tmp_path)
    code = "import attnkit.native as n, time; n.unavailable(); time.sleep(0.5)"
    first = subprocess.Popen([sys.executable, "-c", code], env=env)
    second = subprocess.Popen([sys.executable, "-c", code], env=env)
    assert first.wait(60) == 0 and second.wait(60) == 0
    logs = list((tmp_path / "kernels").glob("*/background-*.log"))
    deadline = time.monotonic() + 90
    while not list((tmp_path / "kernels").glob("*/failed.txt")):  # the one build ends
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1.0)  # the second child: the lock freed, it finds the failure and stops
    started = sum(log.read_text().count("building its native kernels") for log in logs)
    assert len(logs) == 2 and started == 1


def test_wait_builds_in_the_foreground(tmp_path):
    env = {**_env(tmp_path), "ATTNKIT_NATIVE": "wait"}
    code = "import attnkit.native as n; print(n.unavailable())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "the build failed" in done.stdout and "stand-in: error" in done.stdout
    assert not list((tmp_path / "kernels").glob("*/background-*.log"))
