"""A mask as a string and a list of tensors, and back: how masks cross `torch.compile`.

`torch.library` custom ops take tensors, numbers and strings, not Python objects. A
mask's structure (its kind, as its class's `module:qualname`, and its fields, nested
for `&`, `|`, `~`) becomes a JSON string;
the tensors it holds (document ids, padding lengths, a tensor mask) become a list
beside it, referenced as `{"#": i}`. `encode` is plain attribute reading and string
formatting, which dynamo traces into constants with `fullgraph=True`; `decode` runs
inside the op, eagerly, and builds a new mask each time (a few microseconds: the
prepared call of an equal mask with the same tensors is found by its value).

The tensors are op inputs, so new document ids or lengths do not recompile.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from typing import Any

from torch import Tensor

from attnkit.masks.base import Mask

__all__ = ["decode", "encodable", "encode"]


def encode(mask: object, tensors: list[Tensor]) -> str:
    """The JSON of `mask`; its tensors are appended to `tensors`. A mask is `{"mask":
    kind, "fields": {...}}`, a tuple a list, a tensor `{"#": its index}`."""
    if isinstance(mask, Tensor):
        tensors.append(mask)
        return f'{{"#": {len(tensors) - 1}}}'
    if isinstance(mask, Mask):
        fields = mask._fields()
        body = ", ".join(f"{_string(n)}: {encode(fields[n], tensors)}" for n in sorted(fields))
        kind = f"{type(mask).__module__}:{type(mask).__qualname__}"
        return f'{{"mask": {_string(kind)}, "fields": {{{body}}}}}'
    if isinstance(mask, tuple):
        return "[" + ", ".join(encode(part, tensors) for part in mask) + "]"
    return _number(mask)


def _string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _number(value: object) -> str:
    """A JSON scalar: null, true/false, an int, a float (Python's JSON reads Infinity
    and NaN), a string."""
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, str):
        return _string(value)
    return repr(value)  # an int, a finite float (repr keeps 1.0 a float)


def encodable(mask: object) -> bool:
    """True if `encode` can write `mask`: its fields are numbers, strings, tensors and
    masks, not functions (`Mask.from_mod` holds one: such calls run eagerly)."""
    if isinstance(mask, Mask):
        return all(encodable(value) for value in mask._fields().values())
    if isinstance(mask, tuple):
        return all(encodable(part) for part in mask)
    return mask is None or isinstance(mask, (Tensor, bool, int, float, str))


def decode(spec: str, tensors: list[Tensor]) -> Mask | Tensor | None:
    """The mask `encode` wrote, over these tensors (a new object each time)."""
    built: Mask | Tensor | None = _build(json.loads(spec), tensors)
    return built


def _kind(name: str) -> type[Mask]:
    """The mask class `module:qualname` names (the module is loaded: a mask of that kind
    was encoded)."""
    module, _, qualname = name.partition(":")
    kind: Any = sys.modules.get(module) or importlib.import_module(module)
    for part in qualname.split("."):
        kind = getattr(kind, part)
    assert isinstance(kind, type) and issubclass(kind, Mask), name
    return kind


def _build(value: Any, tensors: list[Tensor]) -> Any:
    if isinstance(value, dict) and "#" in value:
        return tensors[value["#"]]
    if isinstance(value, dict):
        cls = _kind(value["mask"])
        mask = cls.__new__(cls)  # fields as encoded: the original was validated
        for name, field in value["fields"].items():
            setattr(mask, name, _build(field, tensors))
        return mask
    if isinstance(value, list):
        return tuple(_build(part, tensors) for part in value)
    return value
