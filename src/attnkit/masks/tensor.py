"""The masks without structure of their own: a bool tensor, and a `mask_mod` function.

A bool tensor broadcastable to (B, H, L, S) is accepted wherever a `Mask` is
(`as_mask`); where each row's True entries form one run its spans are read from it
(`masks.intervals`, once per wrapper and version of the tensor), so a (B, 1, L, S)
padded causal mask from a framework runs as fast as the structured kind it is.
`Mask.from_mod(fn)` wraps any FlexAttention-style `fn(b, h, q_idx, kv_idx) -> bool`.

A `from_mod` function has no structure: flex runs it natively, `sdpa` and `reference`
evaluate it densely, `tiled` block by block unless it differs between heads (probed
once, by calling it on two heads); inside `torch.compile` such a call runs eagerly (a
graph break). A bool tensor given as the mask is found again by the caller's tensor
object (`given_tensor`), so a mask tensor passed again is planned once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.errors import MaskError
from attnkit.masks.base import Mask, Predicate
from attnkit.masks.checks import check_broadcastable
from attnkit.masks.intervals import row_intervals
from attnkit.masks.spans import Spans

__all__ = ["given_tensor"]


class _TensorMask(Mask):
    def __init__(self, tensor: Tensor) -> None:
        # the caller's tensor: `as_mask` wraps it anew at every call (and may copy it),
        # so what lasts as long as the caller's mask (a prepared call) is found by it
        self._given = tensor
        self._intervals: tuple[object, tuple[Tensor, Tensor] | None] | None = None
        if tensor.dim() > 4:
            check_broadcastable("mask", tuple(tensor.shape), (0, 0, 0, 0))
        if tensor.dim() < 4:
            tensor = tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))
        # an expanded dim (stride 0) holds one value: keep size 1 there, and one compact
        # copy (compiled kernels that index the mask take dense tensors only)
        if 0 in tensor.stride() or not tensor.is_contiguous():
            index = tuple(slice(0, 1) if st == 0 else slice(None) for st in tensor.stride())
            tensor = tensor[index].contiguous()
        self.tensor = tensor  # (B|1, H|1, L|1, S|1): the caller's own where it can be

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        """Each row's one run of visible keys, or None where a row holds more than one or
        the heads differ (found once per version of the tensor)."""
        if self.head_dependent:
            return None
        read = (self.tensor._version, S)
        memo = getattr(self, "_intervals", None)  # absent where the compiled op decoded it
        if memo is None or memo[0] != read:
            memo = self._intervals = (read, row_intervals(self.tensor, S))  # (B|1, L|1) each
        intervals = memo[1]
        if intervals is None:
            return None
        lo, hi = (t.to(device or "cpu") for t in intervals)
        return Spans(lo, hi, exact=True)

    @property
    def batch_size(self) -> int | None:
        return self.tensor.shape[0]

    def check(self, B: int, H: int, L: int, S: int) -> None:
        check_broadcastable("mask", tuple(self.tensor.shape), (B, H, L, S))

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        t = self.tensor.to(device)  # (B|1, H|1, L|1, S|1)
        zero = torch.zeros((), dtype=torch.long, device=device)

        def pick(idx: Tensor, size: int) -> Tensor:
            return idx if size > 1 else zero

        return lambda b, h, i, j: t[
            pick(b, t.shape[0]), pick(h, t.shape[1]), pick(i, t.shape[2]), pick(j, t.shape[3])
        ]

    @property
    def head_dependent(self) -> bool:
        return self.tensor.shape[1] > 1

    def dense(
        self,
        B: int,
        H: int,
        L: int,
        S: int,
        device: torch.device | str | None = None,
        rows: Tensor | None = None,
        cols: Tensor | None = None,
    ) -> Tensor:
        if rows is not None or cols is not None:
            return super().dense(B, H, L, S, device, rows, cols)
        self.check(B, H, L, S)
        return self.tensor.to(device or "cpu")  # itself: no gather of a copy

    def describe(self) -> str:
        return f"tensor{tuple(self.tensor.shape)}"


class _ModMask(Mask):
    def __init__(self, fn: Predicate, name: str | None) -> None:
        if not callable(fn):
            raise TypeError(
                f"Mask.from_mod takes a function (b, h, q_idx, kv_idx) -> bool, "
                f"got {type(fn).__name__}."
            )
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self._per_head: bool | None = None

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        fn, name = self.fn, self.name

        def checked(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            out = fn(b, h, i, j)
            if not isinstance(out, Tensor) or out.dtype != torch.bool:
                got = out.dtype if isinstance(out, Tensor) else type(out).__name__
                raise MaskError(
                    f"mask_mod {name} must return a bool tensor (True = may attend), got "
                    f"{got}; compare indices, e.g. lambda b, h, q, kv: kv <= q."
                )
            return out

        return checked

    @property
    def head_dependent(self) -> bool:
        """Probed once on two heads: an output without a head dim cannot depend on h."""
        if self._per_head is None:
            zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
            heads = torch.arange(2).view(1, 2, 1, 1)
            try:
                out = self.fn(zero, heads, zero, zero)
                self._per_head = not (
                    isinstance(out, Tensor) and out.dim() == 4 and out.shape[1] == 1
                )
            except Exception:  # the real call raises its own error; be safe here
                self._per_head = True
        return self._per_head

    def describe(self) -> str:
        return f"from_mod({self.name})"


def given_tensor(mask: Mask) -> Tensor | None:
    """The caller's tensor a tensor mask was made from by `as_mask` (None for others and
    for a mask decoded inside the compiled op, which holds the op's tensor itself).

    `as_mask` wraps a tensor anew at every call; the prepared calls that should last as
    long as the caller's mask are found by this tensor, not by the wrapper."""
    return getattr(mask, "_given", None) if type(mask) is _TensorMask else None


# what `as_mask` (and so `&`, `|` with a tensor) and `Mask.from_mod` make
Mask._wrappers.update(tensor=_TensorMask, mod=_ModMask)
