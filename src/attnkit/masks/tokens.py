"""The kinds of mask read from per-token tensors: key padding, documents, row spans.

Each holds the tensors it was built from (lengths, a (B, S) validity row, document
ids, per-row key intervals) and checks them against the call's B, L and S. Their
spans come from those tensors in O(B·(L + S)): exact for lengths, runs of real
tokens, sorted document ids and row spans.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from attnkit.errors import MaskConventionWarning, MaskError, ShapeContractError
from attnkit.masks.base import Mask, Predicate
from attnkit.masks.checks import batch_of, check_batch
from attnkit.masks.spans import Spans

__all__ = ["document", "key_padding", "row_spans"]


class _KeyPadding(Mask):
    def __init__(self, valid: Tensor) -> None:
        if valid.dtype == torch.bool:
            if valid.dim() != 2:
                raise ShapeContractError(
                    f"key_padding(valid) takes a (B, S) bool tensor, got shape {tuple(valid.shape)}"
                    "; for lengths pass a (B,) integer tensor."
                )
        elif not valid.is_floating_point() and valid.dim() == 1:
            if (valid < 0).any():
                raise MaskError(
                    f"key_padding lengths must be >= 0 (real keys per batch row), got "
                    f"{valid.tolist()}."
                )
        else:
            raise MaskError(
                f"key_padding takes a (B, S) bool tensor (True = real token) or (B,) integer "
                f"lengths, got dtype {valid.dtype} and shape {tuple(valid.shape)}. For 0/1 "
                "masks use from_hf_attention_mask (1 = real) or from_key_padding_mask "
                "(True = ignore)."
            )
        self.valid = valid

    @property
    def is_lengths(self) -> bool:
        return self.valid.dtype != torch.bool

    @property
    def batch_size(self) -> int | None:
        return self.valid.shape[0]

    def check(self, B: int, H: int, L: int, S: int) -> None:
        check_batch("key_padding", self.valid.shape[0], B)
        if self.is_lengths:
            if (self.valid > S).any():
                raise MaskError(
                    f"key_padding lengths {self.valid.tolist()} exceed S={S} keys; each "
                    "length must lie in [0, S]."
                )
        elif self.valid.shape[1] != S:
            raise ShapeContractError(
                f"key_padding covers {self.valid.shape[1]} keys but k has S={S}; give a "
                "(B, S) mask with one entry per key."
            )

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        valid = self.valid.to(device)
        if self.is_lengths:
            # compact copies: FlexAttention's compiler cannot lower a captured stride-0
            # view (an InductorError on lengths of one row broadcast over the batch)
            lengths = valid.expand(B).contiguous()  # (B,)
            return lambda b, h, i, j: j < lengths[b]
        rows = valid.expand(B, S).contiguous()  # (B, S)
        return lambda b, h, i, j: rows[b, j]

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        """(B, 1): the same keys for every row. Lengths are exact; a bool mask spans its
        first to its last real token, exact when each row's real tokens are one run."""
        valid = self.valid.to(device or "cpu")
        if self.is_lengths:
            hi = valid.view(-1, 1)  # (B, 1)
            return Spans(torch.zeros_like(hi), hi, exact=True)
        position = torch.arange(S, device=valid.device)
        lo = torch.where(valid, position, S).amin(-1, keepdim=True)  # (B, 1)
        hi = torch.where(valid, position + 1, 0).amax(-1, keepdim=True)
        lo = lo.clamp(max=hi)
        exact = bool((valid == ((position >= lo) & (position < hi))).all())
        return Spans(lo, hi, exact)

    def describe(self) -> str:
        kind = "lengths" if self.is_lengths else "valid"
        return f"key_padding({kind}, B={self.valid.shape[0]})"


def key_padding(valid: Tensor) -> Mask:
    """Hide padded keys: the same keys are hidden from every query of a batch row.

    Args:
        valid: (B, S) bool with `True` = real token, or (B,) integer lengths (the first
            `valid[b]` keys of row b are real). nn.MultiheadAttention's `key_padding_mask`
            (`True` = ignore) enters through `from_key_padding_mask`; a bool mask whose
            rows hide every key while other rows keep theirs (that convention read as
            this one) warns with `MaskConventionWarning`.

    Returns:
        A `Mask` holding `valid`, for calls of batch B (or 1) and S keys.

    Raises:
        ShapeContractError: a bool `valid` not 2-D; when the mask meets a call, a batch
            or key count that differs from the call's.
        MaskError: a negative length, another dtype (a 0/1 integer mask is ambiguous:
            `from_hf_attention_mask` or `from_key_padding_mask` says which it is), or a
            length above the call's S.

    Examples:
        >>> import attnkit as ak
        >>> print(ak.key_padding(torch.tensor([3])).draw(2, 4))
        ■ ■ ■ ·
        ■ ■ ■ ·
        >>> valid = torch.tensor([[True, True, False], [True, True, True]])
        >>> print(ak.key_padding(valid).draw(1, 3, batch=0))
        ■ ■ ·
    """
    if valid.dtype == torch.bool:
        _warn_if_inverted(valid)
    return _KeyPadding(valid)


def _warn_if_inverted(valid: Tensor) -> None:
    """Warn where some rows hide every key and others keep theirs: what PyTorch's
    `key_padding_mask` (True = padding) gives for rows without padding."""
    real = valid.any(-1)  # (B,)
    if bool(real.all()) or not bool(real.any()):
        return
    empty = (~real).nonzero().flatten().tolist()
    warnings.warn(
        f"key_padding: batch row(s) {empty[:8]} hide every key (all False) while other rows "
        "keep theirs; those rows will output zeros. attnkit reads True = real token; "
        "PyTorch's key_padding_mask reads True = padding: if this mask is one, pass ~mask "
        "(or from_key_padding_mask(mask)).",
        MaskConventionWarning,
        stacklevel=3,
    )


class _Document(Mask):
    def __init__(self, q_ids: Tensor, kv_ids: Tensor | None) -> None:
        for name, ids in (("ids", q_ids), ("kv_ids", kv_ids)):
            if ids is None:
                continue
            if ids.is_floating_point() or ids.dtype == torch.bool or ids.dim() not in (1, 2):
                raise MaskError(
                    f"document {name} must be an integer (S,) or (B, S) tensor of document "
                    f"ids, got dtype {ids.dtype} and shape {tuple(ids.shape)}."
                )
        self.q_ids = q_ids if q_ids.dim() == 2 else q_ids.unsqueeze(0)
        self.kv_ids = None if kv_ids is None else (kv_ids if kv_ids.dim() == 2 else kv_ids[None])

    @property
    def batch_size(self) -> int | None:
        return batch_of(self.q_ids.shape[0], None if self.kv_ids is None else self.kv_ids.shape[0])

    def check(self, B: int, H: int, L: int, S: int) -> None:
        kv_ids = self.q_ids if self.kv_ids is None else self.kv_ids
        check_batch("document ids", self.q_ids.shape[0], B)
        check_batch("document kv_ids", kv_ids.shape[0], B)
        if self.kv_ids is None and L != S:
            raise ShapeContractError(
                f"document(ids) with L={L} queries and S={S} keys: one id sequence cannot "
                "label both. Use document(q_ids, kv_ids) with (B, L) and (B, S) ids."
            )
        if self.q_ids.shape[1] != L or kv_ids.shape[1] != S:
            raise ShapeContractError(
                f"document ids have lengths {self.q_ids.shape[1]} (queries) and "
                f"{kv_ids.shape[1]} (keys) but the call has L={L}, S={S}; give one id per "
                "position."
            )

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        q_ids = self.q_ids.to(device).expand(B, L).contiguous()  # (B, L), compact as above
        kv_ids = q_ids if self.kv_ids is None else self.kv_ids.to(device).expand(B, S)
        kv_ids = kv_ids.contiguous()  # (B, S)
        return lambda b, h, i, j: q_ids[b, i] == kv_ids[b, j]

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        """Sorted ids: each row's document is one run of keys, found by binary search
        (B|1, L); unsorted documents are not contiguous runs: no spans."""
        if not self._sorted():
            return None
        q_ids = self.q_ids.to(device or "cpu")  # (B|1, L)
        kv_ids = q_ids if self.kv_ids is None else self.kv_ids.to(q_ids.device)  # (B|1, S)
        batch = max(q_ids.shape[0], kv_ids.shape[0])
        q_ids, kv_ids = q_ids.expand(batch, L).contiguous(), kv_ids.expand(batch, S).contiguous()
        lo = torch.searchsorted(kv_ids, q_ids, side="left")
        hi = torch.searchsorted(kv_ids, q_ids, side="right")
        return Spans(lo, hi, exact=True)

    def _sorted(self) -> bool:
        kv_ids = self.q_ids if self.kv_ids is None else self.kv_ids
        return all(bool((ids[:, 1:] >= ids[:, :-1]).all()) for ids in (self.q_ids, kv_ids))

    def describe(self) -> str:
        return f"document(B={self.batch_size})"


def document(ids: Tensor, kv_ids: Tensor | None = None) -> Mask:
    """Packed sequences: a query sees only keys of its own document.

    Args:
        ids: (S,) or (B, S) integer document ids, one per position (sorted ids let every
            backend skip other documents' keys; self-attention then runs each document
            as its own call).
        kv_ids: for cross attention, the keys' (S,) or (B, S) ids; `ids` are then the
            queries' (L,) or (B, L) ones. Default None: `ids` label both (L == S).

    Returns:
        A `Mask` holding the ids. `& causal()` gives packed causal language modelling.

    Raises:
        MaskError: ids that are not a 1-D or 2-D integer tensor.
        ShapeContractError: when the mask meets a call, ids whose lengths or batch
            differ from the call's L, S and B.

    Examples:
        >>> import attnkit as ak
        >>> ids = torch.tensor([0, 0, 1, 1])
        >>> print(ak.document(ids).draw(4))
        ■ ■ · ·
        ■ ■ · ·
        · · ■ ■
        · · ■ ■
        >>> print((ak.document(ids) & ak.causal()).draw(4))
        ■ · · ·
        ■ ■ · ·
        · · ■ ·
        · · ■ ■
    """
    return _Document(ids, kv_ids)


class _RowSpans(Mask):
    def __init__(self, lo: Tensor, hi: Tensor) -> None:
        for name, t in (("lo", lo), ("hi", hi)):
            if t.is_floating_point() or t.dtype == torch.bool or t.dim() not in (1, 2):
                raise MaskError(
                    f"row_spans {name} must be an integer (L,) or (B, L) tensor of key "
                    f"positions, got dtype {t.dtype} and shape {tuple(t.shape)}."
                )
        if lo.shape != hi.shape:
            raise MaskError(
                f"row_spans lo and hi need one shape, got {tuple(lo.shape)} and {tuple(hi.shape)}."
            )
        lo, hi = (t.long() if t.dim() == 2 else t.long()[None] for t in (lo, hi))
        empty = hi <= lo
        self.lo = torch.where(empty, 0, lo)  # (B|1, L); a row that sees nothing: [0, 0)
        self.hi = torch.where(empty, 0, hi)

    @property
    def batch_size(self) -> int | None:
        return self.lo.shape[0]

    def check(self, B: int, H: int, L: int, S: int) -> None:
        check_batch("row_spans", self.lo.shape[0], B)
        if self.lo.shape[1] != L:
            raise ShapeContractError(
                f"row_spans has spans for {self.lo.shape[1]} query rows but the call has "
                f"L={L}; give one span per query row."
            )

    def predicate(self, B: int, H: int, L: int, S: int, device: torch.device) -> Predicate:
        lo, hi = (t.to(device).expand(B, L).contiguous() for t in (self.lo, self.hi))
        return lambda b, h, i, j: (j >= lo[b, i]) & (j < hi[b, i])

    def key_spans(
        self, B: int, L: int, S: int, device: torch.device | str | None = None
    ) -> Spans | None:
        lo, hi = (t.to(device or "cpu").clamp(0, S) for t in (self.lo, self.hi))  # (B|1, L)
        return Spans(lo, hi, exact=True)

    def describe(self) -> str:
        return f"row_spans(B={self.batch_size})"


def row_spans(lo: Tensor, hi: Tensor) -> Mask:
    """Query row `i` sees exactly the keys `lo[i] <= j < hi[i]`: any mask of one key
    interval per row, given as its intervals. Packed sequences with per-sequence
    windows (`attnkit.varlen_attn`) are such a mask.

    Args:
        lo: (L,) or (B, L) integer tensor, each row's first visible key.
        hi: integer tensor of `lo`'s shape, one past each row's last visible key;
            `hi <= lo`: the row sees nothing (its output is 0).

    Returns:
        A `Mask` with exact spans, for calls of L query rows and batch B (or 1).

    Raises:
        MaskError: `lo` or `hi` not 1-D or 2-D integer tensors, or of different shapes.
        ShapeContractError: when the mask meets a call, spans for another number of
            query rows or batch rows.

    Examples:
        >>> import attnkit as ak
        >>> lo, hi = torch.tensor([0, 0, 1]), torch.tensor([1, 3, 2])
        >>> print(ak.masks.row_spans(lo, hi).draw(3))
        ■ · ·
        ■ ■ ■
        · ■ ·
    """
    return _RowSpans(lo, hi)
