"""What the process remembers, in one object: the `Runtime`.

What one call derives belongs to its plan (`attnkit.call.prepared`); what outlives calls
lives here and nowhere else (a test finds any other module-level state):

- `backends`: the registry (`attnkit.backends.registry`), in one order for ties in
  `auto` and for which backward is asked first;
- `costs`: the cost table the planner prices with, chosen at its first use
  (`attnkit.call.cost.Costs`);
- `kernels`: attnkit's native kernels, loaded once or being built in the background
  (`attnkit.native.loader`), and `facts`: what torch's CPU kernels do, probed once
  (`attnkit._compat.TorchFacts`);
- `half`: what the fused kernels compute half inputs in (`attnkit.call.precision.
  HalfKernels`: the hardware probe, or `ATTNKIT_HALF_KERNELS` read once);
- `calls`: the prepared calls, one holder per mask (`attnkit.call.dispatch` keeps them),
  and `forwards`: a model's forward, by the mask object its layers share (the transformers
  integration's: the calls its first layer prepared, None where each layer runs a call).

`current()` is the runtime calls use: the process's, which `attnkit` makes when it is
imported (handing it the calibration that chooses its cost table), or the one a test
entered with `fresh()`.

Examples:
    >>> from attnkit import runtime
    >>> with runtime.fresh() as mine:  # new backends, costs and calls, for a while
    ...     runtime.current() is mine
    True
    >>> "sdpa" in runtime.current().backends
    True
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor

from attnkit._compat import TorchFacts
from attnkit.backends.registry import Registry, built_in
from attnkit.call.by_mask import ByMask, MaskTensors
from attnkit.call.cost import Costs, CostTable
from attnkit.call.precision import HalfKernels
from attnkit.call.recent import Recent
from attnkit.masks import Mask
from attnkit.native.loader import Kernels

__all__ = ["PREPARED_PER_MASK", "Runtime", "current", "fresh", "start"]

PREPARED_PER_MASK = 16  # sizes remembered per mask object (a decoding loop needs one)


class MaskCalls(MaskTensors):
    """The prepared calls of one mask (or of calls without a mask), by key
    (`call.key.CallKey`), and the tensors whose identity and version every key holds
    (they die with the mask). A plan is the dispatcher's `call.prepared.Prepared`, which
    the runtime, below it, holds without reading (`Any`)."""

    def __init__(self, mask: Mask | Tensor | None) -> None:
        super().__init__(mask, weak=True)
        limit = 4 * PREPARED_PER_MASK if mask is None else PREPARED_PER_MASK
        self.plans: Recent[tuple[object, ...], Any] = Recent(limit)


class Runtime:
    """The backends, the cost table, the native kernels, torch's facts and the prepared
    calls of a process (or of a test: `fresh`).

    Args:
        choose: makes the cost table at its first use (`attnkit.call.calibrate.
            active_table` for the process's: a kept table, or the one built in for the
            CPU's kind).
        kernels: the native kernels to share (None: new ones; a library loads into a
            process once, so `fresh` shares the process's).
        facts: what torch's CPU kernels do, probed once (None: probed anew).
        half: what half inputs compute in (None: as `ATTNKIT_HALF_KERNELS` says, else
            the hardware probe).

    Examples:
        >>> from attnkit import runtime
        >>> mine = runtime.Runtime(ak.cost.built_in, runtime.current().kernels)
        >>> mine.backends.names()  # one order: ties in `auto`, backward precedence
        ('auto', 'sdpa', 'native', 'tiled', 'flex', 'blockwise', 'reference')
        >>> mine.costs.table().kind == ak.cost.built_in().kind
        True
    """

    def __init__(
        self,
        choose: Callable[[], CostTable],
        kernels: Kernels | None = None,
        facts: TorchFacts | None = None,
        half: HalfKernels | None = None,
    ) -> None:
        self.kernels = Kernels() if kernels is None else kernels
        self.facts = TorchFacts() if facts is None else facts
        self.half = HalfKernels.from_environment() if half is None else half
        self.costs = Costs(choose)
        self.backends = Registry(built_in(self.kernels, self.facts, self.half))
        self.calls: ByMask[MaskCalls] = ByMask(MaskCalls)
        # a forward's `call.dispatch.StepCalls` (or None), held without reading (`Any`)
        self.forwards: weakref.WeakKeyDictionary[Mask, Any] = weakref.WeakKeyDictionary()

    def state(self) -> tuple[int, int, int]:
        """What every prepared call keys on besides its inputs: changes when a backend is
        registered or removed, one's own state changes what it costs, or another cost
        table is given."""
        return (*self.backends.state(), self.costs.changes)

    def clear(self) -> None:
        """Forget every prepared call (tests; after changing a backend by hand)."""
        self.calls.clear()
        self.forwards.clear()


_RUNTIMES: list[Runtime] = []  # the process's, then any a test entered (`fresh`)


def start(runtime: Runtime) -> None:
    """Make `runtime` the process's (`attnkit` does, once, when it is imported).

    Args:
        runtime: the process's runtime.

    Examples:
        >>> from attnkit import runtime
        >>> runtime.start(runtime.current())  # attnkit made it already
        Traceback (most recent call last):
        ...
        RuntimeError: the process's runtime is made once, when attnkit is imported.
    """
    if _RUNTIMES:
        raise RuntimeError("the process's runtime is made once, when attnkit is imported.")
    _RUNTIMES.append(runtime)


def current() -> Runtime:
    """The runtime calls use now: the process's, or the one a `fresh` block entered.

    Returns:
        The `Runtime` whose backends, cost table, kernels and prepared calls a call
        reads.

    Examples:
        >>> from attnkit import runtime
        >>> runtime.current().costs.table().source.startswith("built in for")
        True
    """
    return _RUNTIMES[-1]


@contextlib.contextmanager
def fresh() -> Iterator[Runtime]:
    """A new runtime for the calls inside the block (its own backends, cost table and
    prepared calls; the process's kernels, facts and calibration, and a copy of its half
    kernels' mode), the previous one after.

    Returns:
        A context manager giving the new `Runtime`.

    Examples:
        >>> from attnkit import runtime
        >>> before = runtime.current()
        >>> with runtime.fresh() as mine:
        ...     mine is runtime.current() and mine is not before
        True
        >>> runtime.current() is before
        True
    """
    before = current()
    half = HalfKernels(before.half.mode)
    runtime = Runtime(before.costs.choose, before.kernels, before.facts, half)
    _RUNTIMES.append(runtime)
    try:
        yield runtime
    finally:
        _RUNTIMES.remove(runtime)
