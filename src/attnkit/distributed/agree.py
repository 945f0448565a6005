"""Ranks agree before any traffic: one small collective, then the same answer everywhere.

A context-parallel call is one computation spread over P processes: if one rank's
inputs are invalid, or two ranks pass different masks, shapes or options, the others
would wait in a collective until the process group times out, or (worse) return
inconsistent results. So before any data moves, every rank validates its own call and
fingerprints what must match (the mask's structure and tensor contents, each of q, k, v's
shape, dtype and device, layout, strategy, scale, softcap, whether gradients are
wanted), and one `all_gather` of those few integers tells every rank whether all agree.
If not, a second exchange (on that path alone) carries each rank's error and
descriptions, and every rank raises the same typed error naming the ranks that differ
and what differs.

The vector each rank gathers is int64: a failure flag and a 56-bit blake2b digest of
each field's description (q, k, v by shape, dtype, device and grad; the mask by its
`masks.spec` encoding plus a content fingerprint of each tensor it holds, two weighted
sums of its bytes; layout, strategy, scale and softcap by value). The second exchange is
an `all_gather_object`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit.distributed.comm import Group
from attnkit.errors import (
    BlockTableError,
    DtypeMismatchError,
    MaskError,
    RanksDisagreeError,
    ShapeContractError,
)
from attnkit.masks import Mask
from attnkit.masks.spec import encodable, encode

__all__ = ["agree"]

T = TypeVar("T")
_ERRORS: dict[str, type[Exception]] = {
    e.__name__: e
    for e in (
        ShapeContractError,
        MaskError,
        BlockTableError,
        DtypeMismatchError,
        TypeError,
        ValueError,
        RuntimeError,
    )
}


def agree(
    group: Group, validate: Callable[[], T], shards: dict[str, Any], shared: dict[str, Any]
) -> T:
    """`validate()`'s result once every rank of `group` validated its call and all
    fields match: `shards` by shape, dtype, device and grad (q, k, v: each rank's own
    rows), `shared` by value (the mask's structure and tensors, the options). Otherwise
    the same error on every rank: `RanksDisagreeError` for a mismatch, the failing
    rank's own error type for invalid inputs."""
    error: Exception | None = None
    result: T | None = None
    try:
        result = validate()
    except Exception as err:  # reported to every rank, then raised on every rank
        error = err
    described = {name: describe(value) for name, value in shards.items()}
    described |= {name: describe(value, contents=True) for name, value in shared.items()}
    codes = [int(error is not None), *(_digest(text) for text in described.values())]
    mine = torch.tensor(codes, dtype=torch.int64, device=_device(group))
    parts = [torch.empty_like(mine) for _ in range(group.size)]
    dist.all_gather(parts, mine, group=group.group)
    everyone = torch.stack(parts)  # (P, 1 + fields)
    if not bool(everyone[:, 0].any()) and bool((everyone == everyone[0]).all()):
        assert result is not None
        return result
    report: list[Any] = [None] * group.size  # the failure path alone pays for this
    mine_report = (None if error is None else (type(error).__name__, str(error)), described)
    dist.all_gather_object(report, mine_report, group=group.group)
    raise _disagreement(report)


def _disagreement(report: list[tuple[tuple[str, str] | None, dict[str, str]]]) -> Exception:
    P = len(report)
    failed = [(r, e) for r, (e, _) in enumerate(report) if e is not None]
    if failed:
        r, (kind, message) = failed[0]
        others = f" (ranks {[x for x, _ in failed]} refused)" if len(failed) > 1 else ""
        cls = _ERRORS.get(kind, RuntimeError)
        return cls(f"rank {r} of {P} refused its context-parallel call{others}: {message}")
    lines = []
    for name in report[0][1]:
        values: dict[str, list[int]] = {}
        for r, (_, described) in enumerate(report):
            values.setdefault(described[name], []).append(r)
        if len(values) > 1:
            parts = "; ".join(f"ranks {ranks}: {text}" for text, ranks in values.items())
            lines.append(f"{name} differs ({parts})")
    return RanksDisagreeError(
        f"the {P} ranks of a context-parallel call must pass the same global global_call, but "
        + "; and ".join(lines)
        + ". Pass every rank the same mask (over global positions), options and equally "
        "sized shards (akd.shard of the same full tensors)."
    )


def describe(value: object, *, contents: bool = False) -> str:
    """A text that differs between ranks where `value` does: a tensor's shape, dtype,
    device and grad, and with `contents` a fingerprint of its values; never raises."""
    if isinstance(value, Tensor):
        grad = ", requires grad" if value.requires_grad and torch.is_grad_enabled() else ""
        values = f" #{_content(value):x}" if contents else ""
        return f"{tuple(value.shape)} {value.dtype} on {value.device.type}{grad}{values}"
    if isinstance(value, Mask):
        tensors: list[Tensor] = []
        structure = encode(value, tensors) if encodable(value) else repr(value)
        shapes = ", ".join(f"{tuple(t.shape)} #{_content(t):x}" for t in tensors)
        return f"{value} [{_digest(structure):x}]" + (f" with tensors {shapes}" if shapes else "")
    return repr(value)


_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _content(t: Tensor) -> int:
    """A fingerprint of a tensor's values: two weighted sums of its elements, read as
    integers (a float's bits), so that any change of one value changes them."""
    data = t.detach().contiguous().reshape(-1)  # (n,)
    if data.is_floating_point() or data.is_complex():
        data = data.view(_SAME_WIDTH_INT.get(data.element_size(), torch.uint8))
    data = data.to(torch.int64)
    index = torch.arange(1, data.numel() + 1, dtype=torch.int64, device=data.device)
    first = int((data * (index * 1_000_003 % 2_147_483_647)).sum())
    second = int((data * (index * index % 998_244_353 + 7)).sum())
    return _digest(f"{data.numel()}:{first}:{second}")


def _digest(text: str) -> int:
    """A hash of `text` that is the same in every process (`hash` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _device(group: Group) -> torch.device:
    """Where the group's collectives run: the current GPU under nccl, else the CPU."""
    if dist.get_backend(group.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
