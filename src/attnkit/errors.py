"""The error types of attnkit.

Those about arguments subclass `ValueError`, so code that already catches `ValueError`
keeps working; `DtypeMismatchError` is both a `TypeError` (attnkit's word for wrong
dtypes) and a `RuntimeError` (what torch's SDPA raises), so code written for either
catches it; `OutOfBlocksError` is a `RuntimeError` (the arguments are fine, the pool
is full); `BlockTableError` is both a `ValueError` and a `RuntimeError` (what
flash-attention raises for a block table). `MaskConventionWarning` warns of a mask that
reads as another library's convention. Every message names the argument, what was
expected, what was given, and the fix.
"""

from __future__ import annotations

__all__ = [
    "BlockTableError",
    "DtypeMismatchError",
    "MaskConventionWarning",
    "MaskError",
    "OutOfBlocksError",
    "PreparedMismatchError",
    "RanksDisagreeError",
    "ShapeContractError",
]


class ShapeContractError(ValueError):
    """Shapes (or devices) of q, k, v or a mask break the attention contract.

    Raised before anything runs, naming the dimension by its letter (B, H, Hkv, L, S,
    D, Dv), what was expected and the fix; an ambiguous causal alignment (L != S) too.

    Examples:
        >>> q = torch.randn(1, 4, 3, 8)  # H = 4 query heads
        >>> kv = torch.randn(1, 3, 3, 8)  # Hkv = 3 does not divide H
        >>> ak.attention(q, kv, kv)
        Traceback (most recent call last):
            ...
        attnkit.errors.ShapeContractError: H=4 query heads is not divisible by Hkv=3 ...
    """


class MaskError(ValueError):
    """A mask is malformed: wrong dtype, ambiguous convention, bad lengths or windows.

    Examples:
        >>> q = torch.randn(1, 1, 3, 8)
        >>> ak.attention(q, q, q, torch.ones(3, 3, dtype=torch.int64))  # 1 = keep? ignore?
        Traceback (most recent call last):
            ...
        attnkit.errors.MaskError: mask has dtype torch.int64: integer masks are ambiguous ...
    """


class DtypeMismatchError(TypeError, RuntimeError):
    """q, k and v (or a mask) have different dtypes.

    Both a `TypeError` and a `RuntimeError` (what torch's SDPA raises), so code written
    for either catches it.

    Examples:
        >>> q = torch.randn(1, 1, 3, 8)
        >>> ak.attention(q, q.double(), q)
        Traceback (most recent call last):
            ...
        attnkit.errors.DtypeMismatchError: dtype mismatch: q is torch.float32, k is ...
    """


class BlockTableError(ValueError, RuntimeError):
    """A `block_table` lists too few pages for a sequence's length, or a page id that is
    no page of the pool; checked before anything is read or written.

    Both a `ValueError` and a `RuntimeError` (what flash-attention raises), so code
    written for either catches it.

    Examples:
        >>> pages = torch.randn(2, 4, 1, 8)  # 2 pages of 4 slots, Hkv = 1, D = 8
        >>> table = torch.tensor([[0]], dtype=torch.int32)  # 1 page: 4 positions
        >>> ak.varlen_attn(torch.randn(1, 1, 8), pages, pages, torch.tensor([0, 1]), None,
        ...                1, 6, seqused_k=torch.tensor([6]), block_table=table)
        Traceback (most recent call last):
            ...
        attnkit.errors.BlockTableError: varlen_attn: sequence 0 has 6 positions ...
    """


class OutOfBlocksError(RuntimeError):
    """A `PagedKVCache` step needs more free blocks than the pool has; nothing changed.

    Examples:
        >>> pool = ak.PagedKVCache(1, 1, 8, num_blocks=1, block_size=4,
        ...                        dtype=torch.float32, device="cpu")
        >>> pool.step([pool.add()], [5])  # 5 tokens need 2 blocks of 4
        Traceback (most recent call last):
            ...
        attnkit.errors.OutOfBlocksError: this step needs 2 free blocks for 5 tokens and 1 ...
    """


class PreparedMismatchError(ValueError):
    """A prepared call (`attnkit.prepare`) was given inputs of other sizes, dtypes,
    devices or grad mode than it was prepared for, or its mask changed in place.

    Examples:
        >>> q = torch.randn(1, 2, 4, 8)
        >>> run = ak.prepare(q, q, q, ak.causal())
        >>> run(q[:, :, :3], q[:, :, :3], q[:, :, :3])  # L = 3, prepared for 4
        Traceback (most recent call last):
            ...
        attnkit.errors.PreparedMismatchError: this call was prepared for q's shape ...
    """


class RanksDisagreeError(ValueError):
    """The ranks of a context-parallel call passed different masks, shapes or options.

    Raised on every rank by `attnkit.distributed.attention` (and its siblings) before
    any traffic, naming the ranks that differ: with 2 ranks, rank 0 passing `causal()`
    and rank 1 `sliding_window(4)`, both raise `RanksDisagreeError: the 2 ranks of a
    context-parallel call must pass the same global problem, but mask differs ...`.

    Examples:
        >>> try:  # a ValueError: code that catches argument errors catches it
        ...     raise ak.RanksDisagreeError("the 2 ranks of a context-parallel call ...")
        ... except ValueError as err:
        ...     print(type(err).__name__)
        RanksDisagreeError
    """


class MaskConventionWarning(UserWarning):
    """A mask that reads as another library's convention: a boolean `key_padding` mask
    that hides every key of some batch rows while other rows keep theirs, as PyTorch's
    `key_padding_mask` (True = padding) does for rows without padding. attnkit reads
    True = real token; the fix is `~mask` or `from_key_padding_mask(mask)`. A filter
    silences it where such rows are meant (`warnings.simplefilter("ignore",
    ak.MaskConventionWarning)`).

    Examples:
        >>> import warnings
        >>> padding = torch.tensor([[False, False], [False, True]])  # PyTorch's: True = pad
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     mask = ak.key_padding(padding)
        >>> caught[0].category.__name__
        'MaskConventionWarning'
        >>> print(ak.key_padding(~padding).draw(1, 2, batch=1))  # True = real token
        ■ ·
    """
