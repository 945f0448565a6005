"""PyTorch's attention calls with their exact signatures, run by attnkit.

`sdpa` is `torch.nn.functional.scaled_dot_product_attention` and `varlen_attn` is
`torch.nn.attention.varlen.varlen_attn`: swap the import and the call runs on attnkit's
planner (a bool mask with structure, packed sequences, may run block-sparse), exact,
with backward, on CPU too. What differs is written in each docstring.

`sdpa` flattens leading dims to B and reads `is_causal` as `causal(align="top_left")`;
the call is then `attention`'s (planner, fused and block-sparse paths,
`torch.compile(fullgraph=True)`). `varlen_attn` runs each sequence on its own
(`packed.attend_packed`); `max_q`, `max_k` and `num_splits` are accepted and not needed.
Under `torch.compile` its paged keys are gathered once by the table (each sequence's
used pages in order, one index) into the packed form. `packed.window_spans`
turns flash-attention's window into `row_spans`. Every `block_table` is checked first in eager
calls (`check_block_table`: lengths against max_pages · page_size, the used entries, the
first ceil(length / page_size) of a row, against the pool; entries past them are never
read), and `flash_attn_with_kvcache` without one by `check_cache_room`, both before any
write (both in `flash_cache`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit._compat import AuxRequest, broadcast_shapes
from attnkit.call.functional import attention_with_lse
from attnkit.call.paths import run_attention
from attnkit.dropins.flash_cache import check_block_table, decode_pages
from attnkit.dropins.packed import KeySpans, attend_packed, window_mask, window_spans
from attnkit.masks import causal, row_spans
from attnkit.masks.convert import from_torch_mask

__all__ = ["AuxRequest", "sdpa", "varlen_attn"]

_TOP_LEFT = causal(align="top_left")  # SDPA's is_causal (built once: a value)


def sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """`F.scaled_dot_product_attention`, on attnkit: swap the import, keep the call.

    Args:
        query: (B, ..., H, L, D): any leading dims, broadcast as torch's.
        key: (B, ..., Hkv, S, D), query's dtype; Hkv == H, or with `enable_gqa` H % Hkv == 0.
        value: (B, ..., Hkv, S, Dv), query's dtype.
        attn_mask: bool (True = may attend) or float (added to the scores), broadcastable
            to (B, ..., H, L, S), or torch's `CausalBias` (default None).
        dropout_p: dropout on the weights, applied whenever > 0, as torch's (default 0.0).
        is_causal: query i sees keys j <= i (top-left), without attn_mask (default False).
        scale: multiplies q·kᵀ (default None: 1/√D).
        enable_gqa: key and value may have fewer heads than query (default False).

    Returns:
        (B, ..., H, L, Dv) in query's dtype.

    Raises:
        RuntimeError: torch's: inputs of fewer than 2 dims, `is_causal` with
            attn_mask, fewer key heads without `enable_gqa` (naming it), leading dims
            that do not broadcast.
        ValueError: a `CausalBias` with `is_causal=True` (torch's).
        DtypeMismatchError: query, key, value of different dtypes.

    Differs from torch: a query row that sees no key gives 0 (torch's CPU kernels do
    too; some of its GPU kernels give NaN), and its gradients are 0.

    Examples:
        >>> q = torch.randn(2, 4, 6, 8)  # (B, H, L, D)
        >>> k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)  # Hkv = 2
        >>> out = ak.sdpa(q, k, v, is_causal=True, enable_gqa=True)
        >>> out.shape  # (B, H, L, Dv)
        torch.Size([2, 4, 6, 8])
        >>> F = torch.nn.functional
        >>> torch.allclose(out, F.scaled_dot_product_attention(
        ...     q, k, v, is_causal=True, enable_gqa=True), atol=1e-5)
        True
        >>> mask = torch.ones(6, 6, dtype=torch.bool).tril()
        >>> mask[0] = False  # query 0 may see no key
        >>> ak.sdpa(q, k, v, mask, enable_gqa=True)[:, :, 0].abs().max()  # 0, not NaN
        tensor(0.)
    """
    _check_ranks(query, key, value)
    given = from_torch_mask(attn_mask, query.shape[-2], key.shape[-2])
    if is_causal and given is not attn_mask:
        raise ValueError("CausalBias should not be used with causal=True")  # torch's words
    if is_causal and attn_mask is not None:
        raise RuntimeError(
            "_scaled_dot_product_attention: Explicit attn_mask should not be set when "
            "is_causal=True (pass the causal part inside attn_mask, or attnkit masks: "
            "attnkit.attention(q, k, v, ak.causal() & ...))"
        )
    (q, k, v), lead = _flattened(query, key, value, enable_gqa)  # (B, H|Hkv, L|S, E|Ev)
    mask = _TOP_LEFT if is_causal else given
    if isinstance(mask, Tensor):
        mask = _batched_mask(mask, lead)
    out, _ = run_attention(
        q,
        k,
        v,
        mask,
        scale=scale,
        softcap=None,
        dropout_p=dropout_p,
        backend="auto",
        need_lse=False,
        check_bias=False,
    )  # (B, Hq, L, Ev)
    shape = (*lead, *out.shape[1:])
    return out.reshape(shape[len(shape) - max(query.dim(), key.dim(), value.dim()) :])


def _check_ranks(query: Tensor, key: Tensor, value: Tensor) -> None:
    """torch's refusal of inputs of fewer than 2 dims (L and E at least), in its words."""
    if min(query.dim(), key.dim(), value.dim()) < 2:
        raise RuntimeError(
            "Expected query, key, and value to all be  at least 2 dimensional, but got "
            f"query.dim: {query.dim()} key.dim: {key.dim()} and value.dim: {value.dim()} "
            "instead. (sdpa takes (..., L, E) queries and (..., S, E) keys and values: "
            "unsqueeze(0) a single vector.)"
        )


def _flattened(
    query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool
) -> tuple[tuple[Tensor, Tensor, Tensor], tuple[int, ...]]:
    """SDPA's (N, ..., H, L, E) inputs as attention's (B, H, L, E), with their leading
    dims broadcast as torch's (heads too, without GQA), and those leading dims."""
    rank = max(query.dim(), key.dim(), value.dim(), 3)
    q, k, v = (t.reshape((1,) * (rank - t.dim()) + t.shape) for t in (query, key, value))
    Hq, Hk, Hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if enable_gqa:
        if Hk != Hv or Hq % Hk:
            raise RuntimeError(
                f"sdpa with enable_gqa: query heads ({Hq}) must be a multiple of key and "
                f"value heads, which must be equal (got key {Hk}, value {Hv})"
            )
        lead = _broadcast(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        heads = (Hq, Hk, Hk)
    else:  # heads broadcast as any other leading dim
        if Hk == Hv and 1 < Hk < Hq and Hq % Hk == 0:
            raise RuntimeError(
                f"sdpa: query has {Hq} heads but key and value have {Hk}: grouped-query "
                "attention needs enable_gqa=True (each group of "
                f"{Hq // Hk} query heads reads one key/value head)."
            )
        lead = _broadcast(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        lead, heads = lead[:-1], (lead[-1],) * 3
    B = math.prod(lead)
    qf, kf, vf = (
        t.expand(*lead, h, *t.shape[-2:]).reshape(B, h, *t.shape[-2:])
        for t, h in zip((q, k, v), heads, strict=True)
    )
    return (qf, kf, vf), lead


def _broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """torch's broadcasting of leading dims, with its error on a mismatch."""
    try:
        return tuple(broadcast_shapes(*shapes))
    except RuntimeError as err:
        if isinstance(err, RecursionError):
            raise
        raise RuntimeError(f"sdpa: the leading dims of query, key and value: {err}") from None


def _batched_mask(mask: Tensor | None, lead: tuple[int, ...]) -> Tensor | None:
    """attn_mask broadcastable to (*lead, H, L, S) -> (B | 1, H | 1, L | 1, S | 1).

    With at most one leading dim the caller's own tensor is returned: attention reads it
    as it is, and its structure (the rows' key runs) and the prepared call are kept per
    tensor object, so a mask given again is not examined again (a view made per call
    would be a new object every call)."""
    if mask is None or len(lead) <= 1:
        return mask
    rank = len(lead) + 3
    if mask.dim() > rank:
        raise RuntimeError(
            f"sdpa: attn_mask of shape {tuple(mask.shape)} has more dims than the call "
            f"({rank}: (*batch, heads, L, S))"
        )
    m = mask.reshape((1,) * (rank - mask.dim()) + mask.shape)
    if all(n == 1 for n in m.shape[:-3]):  # no batch: broadcast by attention itself
        return m.reshape(1, *m.shape[-3:])
    m = m.expand(*lead, *m.shape[-3:])
    return m.reshape(math.prod(lead), *m.shape[-3:])


def varlen_attn(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seq_q: Tensor,
    cu_seq_k: Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: AuxRequest | None = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: Tensor | None = None,
    block_table: Tensor | None = None,
    num_splits: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """`torch.nn.attention.varlen.varlen_attn`, on attnkit (CPU included, with backward).

    Sequences of different lengths packed along one dim: sequence n is query rows
    cu_seq_q[n] .. cu_seq_q[n+1]-1 and attends only to its own keys.

    Args:
        query: (T_q, H, D) packed sequences.
        key: (T_k, Hkv, D), query's dtype; or with `block_table` pages
            (total_pages, page_size, Hkv, D).
        value: (T_k, Hkv, Dv), laid out as `key`.
        cu_seq_q: (N + 1,) int cumulative query lengths, from 0 to T_q.
        cu_seq_k: (N + 1,) int cumulative key lengths; may be None with `block_table`.
        max_q: the longest query sequence (accepted; attnkit reads the lengths).
        max_k: the longest key sequence (accepted likewise).
        return_aux: `AuxRequest(lse=True)` also returns the log-sum-exp (default None).
        scale: multiplies q·kᵀ (default None: 1/√D).
        window_size: (left, right), flash-attention's convention: query i of a sequence
            sees its keys j with i' - left <= j <= i' + right, i' = i + (len_k - len_q)
            (bottom-right aligned); -1 is unlimited; (-1, 0) is causal (default (-1, -1)).
        enable_gqa: key and value may have fewer heads than query (default False).
        seqused_k: (N,) int keys used per sequence: its first seqused_k[n] (default None).
        block_table: (N, max_pages) int32 page ids of each sequence's keys, in order;
            needs `seqused_k` (default None).
        num_splits: accepted and not used (a hint for CUDA kernels' key splitting).

    Returns:
        out (T_q, H, Dv) in query's dtype, contiguous; with `return_aux.lse`,
        `(out, lse)`, lse (T_q, H) float32 (float64 for float64), contiguous, -inf where
        a query sees nothing.

    Raises:
        ValueError: head counts as torch's (naming `enable_gqa=True`), a window_size not
            of 2, cu offsets or seqused_k that do not fit, `block_table` without
            `seqused_k`.
        BlockTableError: a length past max_pages · page_size, or a used page id outside
            the pool, before anything is read.

    Differs from torch: runs on any device attnkit serves; a query that sees no key
    gives 0 (lse -inf); backward works with `seqused_k` and `block_table` too. Each
    sequence is attended on its own (`attnkit.dropins.packed`), so its outputs and gradients are
    bitwise the same whatever else is packed with it, in any order (under
    `torch.compile` the pack is one call over each query's key interval: exact, not
    order-invariant).

    Examples:
        >>> from attnkit.dropins.pytorch import AuxRequest
        >>> q, k, v = torch.randn(7, 2, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
        >>> cu = torch.tensor([0, 3, 7])  # two sequences: rows 0..2 and 3..6
        >>> out, lse = ak.varlen_attn(q, k, v, cu, cu, 4, 4, window_size=(-1, 0),
        ...                           return_aux=AuxRequest(lse=True))  # causal
        >>> out.shape, lse.shape  # (T_q, H, Dv), (T_q, H)
        (torch.Size([7, 2, 8]), torch.Size([7, 2]))
        >>> heads = lambda t: t.transpose(0, 1)[None]  # (n, H, D) -> (1, H, n, D)
        >>> second = ak.attention(heads(q[3:]), heads(k[3:]), heads(v[3:]), ak.causal())
        >>> torch.allclose(out[3:], second[0].transpose(0, 1), atol=1e-6)  # as if alone
        True
    """
    _check_heads(query.shape[1], key.shape[2 if block_table is not None else 1], enable_gqa)
    if len(window_size) != 2:
        raise ValueError(f"window_size must have length 2, got {len(window_size)}")
    if block_table is not None:
        if seqused_k is None:
            raise ValueError("varlen_attn with block_table needs seqused_k (keys per sequence)")
        pool = (key.shape[0], key.shape[1])  # (pages, page_size)
        check_block_table("varlen_attn", block_table, seqused_k, pool, "seqused_k[{n}]")
        window = (int(window_size[0]), int(window_size[1]))
        decoded = decode_packed(
            query, key, value, cu_seq_q, block_table, seqused_k, window, scale, 0.0
        )
        if decoded is not None:  # (T_q, H, Dv), (T_q, H)
            return decoded if return_aux is not None and return_aux.lse else decoded[0]
        key, value, cu_seq_k = gather_pages(key, value, block_table, seqused_k)
    elif cu_seq_k is None:
        raise ValueError("varlen_attn needs cu_seq_k (or block_table with seqused_k)")
    if torch.compiler.is_compiling():  # lengths unknown: the pack as one call
        spans, _ = packed_spans(cu_seq_q, cu_seq_k, query.shape[0], window_size, seqused_k)
        q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # (1, H, T, D)
        out, lse = attention_with_lse(q, k, v, row_spans(spans.lo, spans.hi), scale=scale)
        out, lse = out[0].transpose(0, 1), lse[0]  # (T_q, H, Dv), (H, T_q)
    else:  # each sequence on its own: order-invariant
        window = (int(window_size[0]), int(window_size[1]))
        out, lse = attend_packed(
            query,
            key,
            value,
            cu_seq_q,
            cu_seq_k,
            lambda n, L, S: window_mask(window, L, S),
            scale=scale,
            used=seqused_k,
        )
    out = out.contiguous()  # (T_q, H, Dv): .view(T_q, H * Dv) works
    if return_aux is not None and return_aux.lse:
        return out, lse.transpose(0, 1).contiguous()  # (T_q, H)
    return out


def _check_heads(Hq: int, Hkv: int, enable_gqa: bool) -> None:
    """torch's varlen_attn checks of the head counts, with its words."""
    if not enable_gqa and Hq != Hkv:
        raise ValueError(
            f"Expect query and key/value to have the same number of heads but got Hq={Hq} "
            f"and Hkv={Hkv}. Try setting enable_gqa=True for GQA."
        )
    if enable_gqa and Hq % Hkv != 0:
        raise ValueError(
            "Expect number of query heads to be a multiple of kv heads for GQA but got "
            f"Hq={Hq} and Hkv={Hkv}."
        )


def decode_packed(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_q: Tensor,
    block_table: Tensor,
    lengths: Tensor,
    window: tuple[int, int],
    scale: float | None,
    softcap: float,
) -> tuple[Tensor, Tensor] | None:
    """A pack of one query per sequence (T_q = N) against its paged keys, on the paged
    kernel (`flash_cache.decode_pages`: pages read in place, each sequence's result the
    same whatever else is packed): out (T_q, H, Dv) and lse (T_q, H); None where the
    pack holds another shape, autograd records or torch.compile traces (the packed path
    serves)."""
    N = block_table.shape[0]
    if query.shape[0] != N or torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return None
    if not bool((cu_q.long().cpu() == torch.arange(N + 1)).all()):
        return None
    zeros = torch.zeros(N, 1, dtype=torch.long)
    spans = window_spans(zeros, lengths.long().cpu()[:, None], 1, zeros, window)
    decoded = decode_pages(
        query[:, None], key, value, block_table, spans.lo[:, 0], spans.hi[:, 0], scale, softcap
    )
    return None if decoded is None else (decoded[0][:, 0].contiguous(), decoded[1][:, :, 0])


def packed_rows(cu_q: Tensor, T_q: int) -> tuple[Tensor, Tensor]:
    """(T_q,) each packed query's sequence and its row within it."""
    cu_q = cu_q.long()
    checkable = not torch.compiler.is_compiling()  # data-dependent: eager calls only
    if checkable and (int(cu_q[-1]) != T_q or bool((cu_q[1:] < cu_q[:-1]).any())):
        raise ValueError(
            f"cu_seq_q must rise from 0 to the {T_q} packed queries, got {cu_q.tolist()}"
        )
    rows = torch.arange(T_q, device=cu_q.device)
    seq = (torch.searchsorted(cu_q, rows, right=True) - 1).clamp(0, cu_q.shape[0] - 2)
    return seq, rows - cu_q[seq]


def packed_spans(
    cu_q: Tensor, cu_k: Tensor, T_q: int, window: tuple[int, int], used: Tensor | None
) -> tuple[KeySpans, Tensor]:
    """Each packed query's keys (its sequence's, cut by the window) and its sequence."""
    seq, row = packed_rows(cu_q, T_q)
    cu_q, cu_k = cu_q.long(), cu_k.long().to(cu_q.device)
    len_k = cu_k[1:] - cu_k[:-1] if used is None else used.long().to(cu_q.device)
    spans = window_spans(cu_k[seq], len_k[seq], (cu_q[1:] - cu_q[:-1])[seq], row, window)
    return spans, seq


def gather_pages(
    key: Tensor, value: Tensor, block_table: Tensor, used: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Paged keys and values (pages, page_size, Hkv, D) -> packed (T_k, Hkv, D): each
    sequence's pages in table order, in one gather, and their cumulative lengths."""
    page_size = key.shape[1]
    count = (used.long() + page_size - 1) // page_size  # (N,) pages in use
    taken = torch.arange(block_table.shape[1], device=block_table.device) < count[:, None]
    pages = block_table[taken].long()  # (pages used,) sequence by sequence
    cu_k = torch.nn.functional.pad((count * page_size).cumsum(0), (1, 0))
    k, v = (t[pages].flatten(0, 1) for t in (key, value))  # (pages·page_size, Hkv, D)
    return k, v, cu_k
