"""The `Mask` type: a visibility rule over `(b, h, i, j)`, and its algebra (`&`, `|`, `~`).

`True` = query `i` may attend to key `j`, everywhere. A `Mask` is evaluated by
broadcasting `arange`s, so nothing builds the full (B, H, L, S) tensor unless asked to
(`materialize`). The kinds of mask live in `kinds.py`, the converters in `convert.py`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from attnkit.errors import MaskError, ShapeContractError

__all__ = [
    "CHUNK_ELEMENTS",
    "Align",
    "BiasFn",
    "Mask",
    "Predicate",
    "and_masks",
    "as_mask",
    "causal_offset",
    "check_broadcastable",
    "integer_mask_error",
    "or_masks",
    "seen_from_spans",
]

Align = Literal["top_left", "bottom_right"]
# (b, h, i, j) index tensors, broadcastable to (B, H, L, S) -> bool tensor
Predicate = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
# (b, h, i, j) index tensors -> float tensor added to the scores
BiasFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

_ALIGNS = ("top_left", "bottom_right")
ALLOWED, HIDDEN = "■", "·"


class Mask:
    """A visibility rule over `(b, h, i, j)`; compose with `&`, `|`, `~`."""

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        """The rule for a (B, H, L, S) problem, as a function of broadcast index tensors."""
        raise NotImplementedError

    def check(self, B: int, H: int, L: int, S: int) -> None:
        """Raise `ShapeContractError` or `MaskError` if this mask cannot serve (B, H, L, S)."""

    @property
    def batch_size(self) -> int | None:
        """The batch size this mask carries data for, or None if it holds for any batch."""
        return None

    @property
    def num_heads(self) -> int | None:
        """The query-head count this mask is built for (`alibi`'s slopes), or None if any."""
        return None

    def is_sdpa_causal(self, L: int, S: int) -> bool:
        """True if this mask is exactly SDPA's `is_causal=True` with every key seen.

        That is top-left causal with L >= S: no empty row, no key hidden from all queries.
        """
        return False

    @property
    def head_dependent(self) -> bool:
        """True if different heads see different keys (only a tensor mask can)."""
        return False

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Key span `[lo, hi)` holding every key visible to query rows `first..last`.

        `first`, `last`: (T,) row ranges (of query tiles). Returns `lo`, `hi` of shape
        (B|1, T), computed from the structure alone, never from an L×S tensor. The span
        may be loose (a superset); the tiled backend masks inside it exactly.
        """
        zeros = torch.zeros(1, first.shape[0], dtype=torch.long, device=first.device)
        return zeros, zeros + S

    def exact_spans(self, B: int, L: int, S: int) -> bool:
        """True if each query row sees exactly the span `key_bounds` gives for it alone.

        Then one interval per row describes the mask completely (causal, sliding window,
        sorted documents, prefix-LM, length padding and their `&`), and the tiled backend
        builds its tile-local masks from two (B, L) tensors instead of the predicate.
        """
        return False

    def sees_all(self, L: int, S: int) -> bool:
        """True if every query row may see every key (no mask needed), from the structure
        alone in O(1): bottom-right causal at L = 1 (a decoding step), a window as wide as
        the keys. False where unsure (masks holding tensors)."""
        return False

    def seen(
        self, B: int, H: int, L: int, S: int, device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """Which query rows see some key, (B, H|1, L), and which keys some query row of
        their head sees, (B, H|1, S) (H only for a `head_dependent` mask).

        Backends zero the rest (they may hold NaN or Inf). One key interval per row
        (`exact_spans`) takes O(B·L); otherwise the mask is evaluated in row chunks.
        """
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if not self.head_dependent and self.exact_spans(B, L, S):
            index = torch.arange(L, device=dev)
            lo, hi = (t.to(dev).expand(B, L) for t in self.key_bounds(B, L, S, index, index))
            rows, keys = seen_from_spans(lo, hi, S)
            return rows[:, None], keys[:, None]
        heads = H if self.head_dependent else 1
        rows = torch.zeros(B, heads, L, dtype=torch.bool, device=dev)
        keys = torch.zeros(B, heads, S, dtype=torch.bool, device=dev)
        chunk = max(1, CHUNK_ELEMENTS // max(1, B * heads * S))
        for start in range(0, L, chunk):
            index = torch.arange(start, min(L, start + chunk), device=dev)
            part = self.dense(B, H, L, S, dev, rows=index)[:, :heads]  # (B|1, H|1, R|1, S|1)
            rows[:, :, index] = part.any(-1)
            keys |= part.any(-2)
        return rows, keys

    def state(self) -> tuple[tuple[int, int], ...]:
        """The identity and version of every tensor this mask holds (its parts' included).

        Caches keyed by a mask object (tile plans) compare it: an in-place change to a
        mask's tensor changes its state.
        """
        return tuple((t.data_ptr(), t._version) for t in self.tensors())

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor this mask holds, its parts' included (a mask is a value: the
        same tensors for its whole life)."""
        found: list[Tensor] = []
        for value in vars(self).values():
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, Tensor):
                    found.append(item)
                elif isinstance(item, Mask):
                    found.extend(item.tensors())
        return tuple(found)

    @property
    def has_bias(self) -> bool:
        """True if this mask also adds a structured bias to the scores (e.g. `alibi`)."""
        return False

    @property
    def has_dense_tensor(self) -> bool:
        """True if some part is an L×S tensor mask (its predicate gathers, block by block)."""
        return False

    def bias(self, B: int, H: int, L: int, S: int, device: torch.device) -> BiasFn | None:
        """The additive score bias as a function of broadcast (b, h, i, j), or None."""
        return None

    def dense_bias(
        self,
        B: int,
        H: int,
        L: int,
        S: int,
        device: torch.device | str | None = None,
        rows: Tensor | None = None,
    ) -> Tensor | None:
        """The bias as the smallest float tensor broadcastable to (B, H, L|R, S), or None."""
        dev = torch.device(device) if device is not None else torch.device("cpu")
        fn = self.bias(B, H, L, S, dev)
        if fn is None:
            return None
        b, h, i, j = _indices(B, H, L, S, dev, rows, None)
        value = fn(b, h, i, j)
        return value.reshape((1,) * (4 - value.dim()) + tuple(value.shape))

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
        """Evaluate to the smallest bool tensor broadcastable to (B, H, L, S).

        `rows` / `cols` restrict the query / key positions (the last two dims then have
        their lengths).
        """
        self.check(B, H, L, S)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        b, h, i, j = _indices(B, H, L, S, dev, rows, cols)
        allowed = self.predicate(B, H, L, S, dev)(b, h, i, j)
        return allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))

    def materialize(
        self, B: int, H: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Tensor:
        """The full bool tensor (B, H, L, S), `True` = may attend (a broadcast view)."""
        return self.dense(B, H, L, S, device).expand(B, H, L, S)

    def to_block_mask(
        self,
        B: int,
        H: int,
        L: int,
        S: int,
        *,
        block_size: int = 128,
        device: torch.device | str | None = None,
    ) -> Any:
        """FlexAttention's `BlockMask` of this mask for (B, H, L, S), the way to feed an
        attnkit mask to `flex_attention` (on a GPU too): the same present and full
        blocks as `create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=block_size)`,
        built from the key spans in O(blocks) where each row sees one interval
        (`exact_spans`), else evaluated in row chunks; its `mask_mod` is this mask's
        predicate (a bias such as `alibi` is not part of it: pass it as a score_mod)."""
        from attnkit.masks.blocks import block_mask

        return block_mask(self, B, H, L, S, block_size=block_size, device=device)

    def draw(self, L: int, S: int | None = None, *, batch: int = 0, head: int = 0) -> str:
        """Text picture of the L×S matrix for one batch row and head: ■ may attend, · hidden."""
        S = L if S is None else S
        B = self.batch_size or 1
        grid = self.materialize(B, self.num_heads or head + 1, L, S)[batch, head]  # (L, S)
        return "\n".join(" ".join(ALLOWED if x else HIDDEN for x in row) for row in grid.tolist())

    def describe(self) -> str:
        raise NotImplementedError

    @staticmethod
    def from_mod(fn: Predicate, name: str | None = None) -> Mask:
        """A mask from any `fn(b, h, q_idx, kv_idx) -> bool` (FlexAttention's `mask_mod`).

        `fn` is called with broadcast index tensors (b: (B,1,1,1), h: (1,H,1,1), q_idx:
        (1,1,L,1), kv_idx: (1,1,1,S), or row/column subsets of them), so it must use
        tensor operations only, as a mask_mod for FlexAttention must. It has no structure
        attnkit can read: backends evaluate it (flex natively, the others block by block
        or as a dense mask). Prefer a built-in kind where one fits.

        >>> print(Mask.from_mod(lambda b, h, i, j: (j <= i) & ((i - j) % 2 == 0)).draw(3))
        ■ · ·
        · ■ ·
        ■ · ■
        """
        return _ModMask(fn, name)

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        return f"Mask[{self.describe()}]"

    def _repr_html_(self) -> str:
        """What a notebook shows: the description and a drawing (`masks.picture`)."""
        from attnkit.masks.picture import mask_html

        return mask_html(self)

    def __and__(self, other: Mask | Tensor) -> Mask:
        return _Combine("&", (self, as_mask(other)))

    def __rand__(self, other: Tensor) -> Mask:
        return _Combine("&", (as_mask(other), self))

    def __or__(self, other: Mask | Tensor) -> Mask:
        return _Combine("|", (self, as_mask(other)))

    def __ror__(self, other: Tensor) -> Mask:
        return _Combine("|", (as_mask(other), self))

    def __invert__(self) -> Mask:
        return _Not(self)


# ----------------------------------------------------------------------------- helpers

CHUNK_ELEMENTS = 1 << 24  # mask entries evaluated at once (Mask.seen, the planner's count)


def seen_from_spans(lo: Tensor, hi: Tensor, S: int) -> tuple[Tensor, Tensor]:
    """(B, L) rows that see a key and (B, S) keys some row sees, from per-row spans.

    Row i sees keys [lo[b, i], hi[b, i]); a key is seen where the count of spans that
    open before it exceeds the count that close (a difference array, O(B·(L + S))).
    """
    B = lo.shape[0]
    rows = hi > lo  # (B, L)
    count = torch.zeros(B, S + 1, dtype=torch.long, device=lo.device)
    ones = rows.long()
    count.scatter_add_(1, torch.where(rows, lo, S), ones)
    count.scatter_add_(1, torch.where(rows, hi, S), -ones)
    return rows, count.cumsum(1)[:, :S] > 0


def _indices(
    B: int, H: int, L: int, S: int, dev: torch.device, rows: Tensor | None, cols: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcast (b, h, i, j) index tensors over (B, H, L|R, S|C)."""
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1)
    i = (torch.arange(L, device=dev) if rows is None else rows.to(dev)).view(1, 1, -1, 1)
    j = (torch.arange(S, device=dev) if cols is None else cols.to(dev)).view(1, 1, 1, -1)
    return b, h, i, j


def _check_align(align: str | None) -> None:
    if align is not None and align not in _ALIGNS:
        raise MaskError(f"align={align!r} is not a causal alignment; use one of {_ALIGNS}.")


def _check_offset(align: str | None, offset: object) -> int | None:
    """An explicit diagonal offset (any int), exclusive with `align`."""
    if offset is None:
        return None
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(
            f"offset must be an int (key j visible iff j <= i + offset), got "
            f"{type(offset).__name__}."
        )
    if align is not None:
        raise MaskError(
            f"give align={align!r} or offset={offset}, not both: an offset fixes the "
            "alignment itself (top_left is offset=0, bottom_right is offset=S-L)."
        )
    return offset


def causal_offset(
    align: str | None, L: int, S: int, who: str = "causal", offset: int | None = None
) -> int:
    """How far the diagonal of query `i` shifts right: key `i + offset` is the last visible.

    An explicit `offset` wins (the mask was built with one); else the alignment decides.
    """
    if offset is not None:
        return offset
    if align is None and L != S:
        raise ShapeContractError(
            f"{who} mask with L={L} queries and S={S} keys: the alignment is ambiguous. "
            f"Choose {who}(align='top_left') (key j visible to query i iff j <= i, as SDPA's "
            f"is_causal), {who}(align='bottom_right') (iff j <= i + S - L, as flash-attention "
            f"and KV-cache decoding) or {who}(offset=n) (iff j <= i + n, for a cache whose "
            "offset is neither)."
        )
    return S - L if align == "bottom_right" else 0


def _check_int(name: str, value: object, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
    if value < minimum:
        raise MaskError(f"{name}={value} is negative; it counts keys, so use {name} >= 0.")
    return value


def _check_batch(name: str, got: int, B: int) -> None:
    if got not in (1, B):
        raise ShapeContractError(
            f"{name} holds {got} batch rows but q has B={B}; give one row per batch element "
            "(or a single row to share)."
        )


def check_broadcastable(name: str, shape: tuple[int, ...], target: tuple[int, ...]) -> None:
    """Raise unless a tensor of `shape` broadcasts to `target` = (B, H, L, S)."""
    if len(shape) > 4:
        raise ShapeContractError(
            f"{name} has {len(shape)} dims, shape {shape}; it must broadcast to (B, H, L, S), "
            "so it has at most 4 dims."
        )
    padded = (1,) * (4 - len(shape)) + shape
    for got, want, letter in zip(padded, target, "BHLS", strict=True):
        if got not in (1, want):
            raise ShapeContractError(
                f"{name} of shape {shape} does not broadcast to (B, H, L, S) = {target}: its "
                f"{letter} dim is {got}, expected 1 or {want}. Reshape it (a (B, S) padding "
                "mask becomes (B, 1, 1, S)), or use key_padding(valid) for padding."
            )


def _batch_of(*sizes: int | None) -> int | None:
    known = [s for s in sizes if s is not None and s != 1]
    return max(known) if known else (1 if any(s == 1 for s in sizes) else None)


class _TensorMask(Mask):
    def __init__(self, tensor: Tensor) -> None:
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

    def intervals(self, S: int) -> tuple[Tensor, Tensor] | None:
        """(lo, hi), (B|1, L|1): each row's one run of visible keys, or None where a row
        holds more than one or the heads differ (`masks.intervals`, found once per
        version of the tensor)."""
        if self.head_dependent:
            return None
        from attnkit.masks.intervals import row_intervals_of

        return row_intervals_of(self.tensor, S)

    def exact_spans(self, B: int, L: int, S: int) -> bool:
        return self.intervals(S) is not None

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        found = self.intervals(S)
        if found is None:
            return super().key_bounds(B, L, S, first, last)
        from attnkit.masks.intervals import range_bounds

        lo, hi = (t.to(first.device) for t in found)  # (B|1, L|1)
        return range_bounds(lo, hi, first, last)

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

    @property
    def has_dense_tensor(self) -> bool:
        return True

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
                self._per_head = not (isinstance(out, Tensor) and out.dim() == 4
                                      and out.shape[1] == 1)  # fmt: skip
            except Exception:  # the real call raises its own error; be safe here
                self._per_head = True
        return self._per_head

    def describe(self) -> str:
        return f"from_mod({self.name})"


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
        return _batch_of(*(p.batch_size for p in self.parts))

    @property
    def num_heads(self) -> int | None:
        return next((n for p in self.parts if (n := p.num_heads) is not None), None)

    def check(self, B: int, H: int, L: int, S: int) -> None:
        for part in self.parts:
            part.check(B, H, L, S)

    @property
    def head_dependent(self) -> bool:
        return any(p.head_dependent for p in self.parts)

    @property
    def has_dense_tensor(self) -> bool:
        return any(p.has_dense_tensor for p in self.parts)

    def key_bounds(
        self, B: int, L: int, S: int, first: Tensor, last: Tensor
    ) -> tuple[Tensor, Tensor]:
        bounds = [p.key_bounds(B, L, S, first, last) for p in self.parts]
        lo, hi = bounds[0]
        for part_lo, part_hi in bounds[1:]:  # & intersects the spans, | takes their hull
            if self.op == "&":
                lo, hi = torch.maximum(lo, part_lo), torch.minimum(hi, part_hi)
            else:
                lo, hi = torch.minimum(lo, part_lo), torch.maximum(hi, part_hi)
        return lo, hi.clamp(min=lo) if self.op == "&" else hi

    def exact_spans(self, B: int, L: int, S: int) -> bool:
        return self.op == "&" and all(p.exact_spans(B, L, S) for p in self.parts)

    def sees_all(self, L: int, S: int) -> bool:
        found = (p.sees_all(L, S) for p in self.parts)
        return all(found) if self.op == "&" else any(found)

    def is_sdpa_causal(self, L: int, S: int) -> bool:
        """`&` of SDPA's causal mask with masks that hide nothing is that mask."""
        if self.op != "&" or self.has_bias:
            return False
        causal = [p.is_sdpa_causal(L, S) for p in self.parts]
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

    @property
    def has_dense_tensor(self) -> bool:
        return self.inner.has_dense_tensor

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        inner = self.inner.predicate(B, H, L, S, device)
        return lambda b, h, i, j: ~inner(b, h, i, j)

    def describe(self) -> str:
        return f"~{self.inner.describe()}"


def and_masks(*masks: Mask | Tensor) -> Mask:
    """Keys visible under every mask (FlexAttention's `and_masks`)."""
    if not masks:
        raise MaskError("and_masks needs at least one mask, e.g. and_masks(causal(), mask).")
    return _Combine("&", tuple(as_mask(m) for m in masks))


def or_masks(*masks: Mask | Tensor) -> Mask:
    """Keys visible under any mask (FlexAttention's `or_masks`)."""
    if not masks:
        raise MaskError("or_masks needs at least one mask, e.g. or_masks(prefix_lm(4), mask).")
    return _Combine("|", tuple(as_mask(m) for m in masks))


def integer_mask_error(name: str, dtype: torch.dtype) -> MaskError:
    return MaskError(
        f"{name} has dtype {dtype}: integer masks are ambiguous (1 means 'real token' in "
        "Hugging Face but 'ignore' in other code), so attnkit refuses them. Convert "
        "explicitly: from_hf_attention_mask(m) if 1 = real token, "
        "from_key_padding_mask(m.bool()) if 1 = padding, or m.bool() if 1 = may attend."
    )


# the tensor each tensor mask was made from, while the mask lives (`given_tensor`)
_GIVEN: weakref.WeakKeyDictionary[Mask, Tensor] = weakref.WeakKeyDictionary()


def given_tensor(mask: Mask) -> Tensor | None:
    """The caller's tensor a tensor mask was made from by `as_mask` (None for others).

    `as_mask` wraps a tensor anew at every call; caches that should last as long as the
    caller's mask (tiled's plans) key on this tensor, not on the wrapper."""
    return _GIVEN.get(mask)


def as_mask(mask: Mask | Tensor) -> Mask:
    """A `Mask` from a `Mask` or a bool tensor (broadcastable to (B, H, L, S))."""
    if isinstance(mask, Mask):
        return mask
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a Mask or a bool tensor, got {type(mask).__name__}.")
    if mask.dtype == torch.bool:
        wrapper = _TensorMask(mask)
        _GIVEN[wrapper] = mask
        return wrapper
    if mask.is_floating_point():
        raise MaskError(
            f"mask has dtype {mask.dtype}: a float tensor is an additive bias (0 keeps, -inf "
            "removes) and cannot be combined with &, |, ~. Pass it alone as mask=, or turn "
            "it into a visibility mask with from_additive_mask(m)."
        )
    raise integer_mask_error("mask", mask.dtype)
