"""A mask as a string and a list of tensors, and back: how masks cross `torch.compile`.

`torch.library` custom ops take tensors, numbers and strings, not Python objects. A
mask's structure (its kind and fields, nested for `&`, `|`, `~`) becomes a Python
literal string; the tensors it holds (document ids, padding lengths, a tensor mask)
become a list beside it, referenced as `('#', i)`. `encode` is plain attribute reading
and string formatting, which dynamo traces into constants with `fullgraph=True`;
`decode` runs inside the op, eagerly.
"""

from __future__ import annotations

import ast
from typing import Any

from torch import Tensor

from attnkit.bounded import Bounded
from attnkit.masks.base import Mask

__all__ = ["decode", "encodable", "encode"]

# decoded masks with the tensors whose ids key them (held: an id is not reused meanwhile)
# masks remembered (with their tensors): tile plans are kept per mask object
_DECODED: Bounded[tuple[Any, ...], tuple[Mask | Tensor | None, list[Tensor]]] = Bounded(8)


def encode(mask: Mask | Tensor | None, tensors: list[Tensor]) -> str:
    """The literal of `mask`; its tensors are appended to `tensors`."""
    if isinstance(mask, Tensor):
        tensors.append(mask)
        return f"('#', {len(tensors) - 1})"
    if isinstance(mask, Mask):
        fields = ", ".join(
            f"({name!r}, {encode(getattr(mask, name), tensors)})" for name in sorted(vars(mask))
        )
        return f"({type(mask).__name__!r}, ({fields},))"
    if isinstance(mask, tuple):
        return "(" + "".join(encode(part, tensors) + ", " for part in mask) + ")"
    return repr(mask)


def encodable(mask: object) -> bool:
    """True if `encode` can write `mask`: its fields are numbers, strings, tensors and
    masks, not functions (`Mask.from_mod` holds one: such calls run eagerly)."""
    if isinstance(mask, Mask):
        return all(encodable(value) for value in vars(mask).values())
    if isinstance(mask, tuple):
        return all(encodable(part) for part in mask)
    return mask is None or isinstance(mask, (Tensor, bool, int, float, str))


def decode(spec: str, tensors: list[Tensor]) -> Mask | Tensor | None:
    """The mask `encode` wrote (the same object for the same spec and tensor objects)."""
    key = (spec, *((id(t), t._version) for t in tensors))
    found = _DECODED.get(key)
    if found is not None:
        return found[0]
    mask: Mask | Tensor | None = _build(ast.literal_eval(spec), tensors)
    _DECODED.put(key, (mask, list(tensors)))
    return mask


def _build(value: Any, tensors: list[Tensor]) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "#":
        return tensors[value[1]]
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        cls = _kinds().get(value[0])
        if cls is not None and isinstance(value[1], tuple):
            mask = cls.__new__(cls)  # fields as encoded: the original was validated
            for name, field in value[1]:
                setattr(mask, name, _build(field, tensors))
            return mask
    if isinstance(value, tuple):
        return tuple(_build(part, tensors) for part in value)
    return value


def _kinds() -> dict[str, type[Mask]]:
    found: dict[str, type[Mask]] = {}
    todo = [Mask]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            found[sub.__name__] = sub
            todo.append(sub)
    return found
