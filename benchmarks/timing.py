"""Round-robin timing: the one way every table of the benchmarks times its peers."""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable


def round_robin(
    fns: dict[str, Callable[[], object]], runs: int, *, warmup: bool = True
) -> dict[str, float]:
    """Median seconds of each callable over `runs` rounds, each round in a shuffled order.

    Interleaving makes a slow spell of the machine (other load, frequency changes) fall
    on every peer alike instead of on whichever peer ran during it; each is called once
    first (thread pools, allocator, caches; `warmup=False` skips that for calls of many
    seconds, where it costs a round and changes nothing) and the garbage collector stays
    off while timing.
    """
    for fn in fns.values() if warmup else ():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    gc.collect()
    gc.disable()
    try:
        order = list(fns)
        for r in range(runs):
            random.Random(r).shuffle(order)  # no peer always runs after the same one
            for name in order:
                start = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return {name: statistics.median(t) for name, t in times.items()}
