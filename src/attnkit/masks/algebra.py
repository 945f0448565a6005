"""The algebra of masks: `a & b`, `a | b` (`_Combine`) and `~a` (`_Not`).

`&` intersects the parts' key spans row by row (exact where every part's are), `|` takes
their hull (a superset); a bias such as `alibi` combines by `&` only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.errors import MaskError
from attnkit.masks.base import BiasFn, Mask, Predicate
from attnkit.masks.checks import batch_of
from attnkit.masks.spans import Spans


class _Combine(Mask):
    def __init__(self, op: str, parts: tuple[Mask, ...]) -> None:
        if op == "|" and any(p.has_bias for p in parts):
            raise MaskError(
                "a bias (such as alibi) adds to the scores; it combines with masks by `&` "
                "only, e.g. causal() & alibi(8)."
            )
        self.op = op
        self.parts = parts

    @property
    def has_bias(self) -> bool:
        return any(p.has_bias for p in self.parts)

    def bias(self, B: int, H: int, L: int, S: int, device: torch.device) -> BiasFn | None:
        fns = [f for p in self.parts if (f := p.bias(B, H, L, S, device)) is not None]
        if not fns:
            return None
        return lambda b, h, i, j: sum((f(b, h, i, j) for f in fns[1:]), fns[0](b, h, i, j))

    @property
    def batch_size(self) -> int | None:
        return batch_of(*(p.batch_size for p in self.parts))

    @property
    def num_heads(self) -> int | None:
        return next((n for p in self.parts if (n := p.num_heads) is not None), None)

    def check(self, B: int, H: int, L: int, S: int) -> None:
        for part in self.parts:
            part.check(B, H, L, S)

    @property
    def head_dependent(self) -> bool:
        return any(p.head_dependent for p in self.parts)

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        """`&` intersects the parts' intervals row by row, `|` takes their hull."""
        spans = [p.key_spans(B, L, S, device) for p in self.parts]
        known = [s for s in spans if s is not None]
        if not known or (self.op == "|" and len(known) < len(spans)):
            return None
        lo, hi = known[0].lo, known[0].hi
        pick_lo, pick_hi = (
            (torch.maximum, torch.minimum) if self.op == "&" else (torch.minimum, torch.maximum)
        )
        for part in known[1:]:
            lo, hi = pick_lo(lo, part.lo), pick_hi(hi, part.hi)
        exact = self.op == "&" and len(known) == len(spans) and all(s.exact for s in known)
        return Spans(lo, hi.clamp(min=lo) if self.op == "&" else hi, exact)

    def sees_all(self, L: int, S: int) -> bool:
        answers = (p.sees_all(L, S) for p in self.parts)
        return all(answers) if self.op == "&" else any(answers)

    def _sdpa_causal(self, L: int, S: int) -> bool | None:
        """`&` of SDPA's causal mask with masks that hide nothing is that mask."""
        if self.op != "&" or self.has_bias:
            return False
        causal = [p._sdpa_causal(L, S) for p in self.parts]
        if any(c is None for c in causal):
            return None  # a part without an O(1) answer: derive from the spans
        rest = all(c or p.sees_all(L, S) for c, p in zip(causal, self.parts, strict=True))
        return any(causal) and rest

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        preds = [p.predicate(B, H, L, S, device) for p in self.parts]
        combine = torch.logical_and if self.op == "&" else torch.logical_or

        def pred(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            out = preds[0](b, h, i, j)
            for p in preds[1:]:
                out = combine(out, p(b, h, i, j))
            return out

        return pred

    def describe(self) -> str:
        return "(" + f" {self.op} ".join(p.describe() for p in self.parts) + ")"


class _Not(Mask):
    def __init__(self, inner: Mask) -> None:
        if inner.has_bias:
            raise MaskError("~ of a bias (such as alibi) has no meaning; negate masks only.")
        self.inner = inner

    @property
    def batch_size(self) -> int | None:
        return self.inner.batch_size

    @property
    def num_heads(self) -> int | None:
        return self.inner.num_heads

    def check(self, B: int, H: int, L: int, S: int) -> None:
        self.inner.check(B, H, L, S)

    @property
    def head_dependent(self) -> bool:
        return self.inner.head_dependent

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        inner = self.inner.predicate(B, H, L, S, device)
        return lambda b, h, i, j: ~inner(b, h, i, j)

    def describe(self) -> str:
        return f"~{self.inner.describe()}"


# what `&`, `|`, `and_masks`, `or_masks` and `~` make
Mask._wrappers.update(combine=_Combine, not_=_Not)
