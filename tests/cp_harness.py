"""Run a function in P gloo processes on 127.0.0.1, with a deadline so a hang fails fast.

`spawn(fn, P, *args)` starts P processes (one thread each), initialises a gloo group
of size P in each and calls `fn(rank, P, *args)`; an exception in any process fails
the caller with that process's traceback.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEADLINE_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(fn: Callable[..., None], P: int, *args: Any, timeout: float = DEADLINE_S) -> None:
    ctx = mp.start_processes(
        _entry, args=(fn, P, free_port(), args), nprocs=P, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in ctx.processes:
                process.kill()
            raise TimeoutError(f"{P} processes did not finish within {timeout:.0f} s: a hang")


def _entry(rank: int, fn: Callable[..., None], P: int, port: int, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=P,
        timeout=timedelta(seconds=DEADLINE_S / 2),
    )
    try:
        fn(rank, P, *args)
    finally:
        dist.destroy_process_group()
