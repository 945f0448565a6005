"""The exact attention weights of a call: `attention_probs`, for all query rows or some.

A row's softmax needs only its own scores, so the weights of a few rows of a long
sequence cost (B, H, rows, S), never L×S: the reference's steps on those rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnkit.call.habits import points_habits
from attnkit.call.visibility import effective_visibility, zero_unseen_by_visibility
from attnkit.contracts import check_sinks, normalize_call, row_index
from attnkit.masks import Mask
from attnkit.reference import weights_and_lse
from attnkit.softmax import add_sinks

__all__ = ["attention_probs"]

MaskLike = Mask | Tensor | None


@points_habits
def attention_probs(
    q: Tensor,
    k: Tensor,
    mask: MaskLike = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    rows: int | Sequence[int] | slice | Tensor | None = None,
) -> Tensor:
    """The exact attention weights, for all query rows or just `rows`.

    Each row's softmax needs only that row's scores, so `rows` keeps the cost at
    (B, H, len(rows), S) however long L is.

    Args:
        q: (B, H, L, D) queries.
        k: (B, Hkv, S, D) keys (no values: the weights do not need them).
        mask: as `attention` (default None).
        scale: as `attention` (default None: 1/√D).
        softcap: as `attention` (default None).
        sinks: (H,) logits, as `attention` (default None).
        rows: the query rows: an int, a sequence of ints, a slice or an integer tensor
            (default None: all L).

    Returns:
        (B, H, R, S) in q's dtype, R = L or the number of rows asked for; masked entries
        exactly 0, rows that see nothing all 0. With `sinks` a row sums to less than 1:
        the sink takes the rest.

    Raises:
        ShapeContractError: rows outside [0, L); the errors of `attention`.
        TypeError: rows that are not integers.

    Examples:
        >>> q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        >>> p = ak.attention_probs(q, k, ak.causal(), rows=[5])  # the last query alone
        >>> p.shape, torch.allclose(p.sum(-1), torch.ones(1, 2, 1))
        (torch.Size([1, 2, 1, 6]), True)
    """
    if torch.compiler.is_compiling():  # reads mask tensors as data: eager, a graph break
        from attnkit.call.compiled import run_eagerly

        probs: Tensor = run_eagerly(_probs, q, k, mask, scale, softcap, sinks, rows)
        return probs
    return _probs(q, k, mask, scale, softcap, sinks, rows)


def _probs(
    q: Tensor,
    k: Tensor,
    mask: MaskLike,
    scale: float | None,
    softcap: float | None,
    sinks: Tensor | None,
    rows: int | Sequence[int] | slice | Tensor | None,
) -> Tensor:
    sinks = None if sinks is None else check_sinks(sinks, q)
    call = normalize_call(q, k, k, mask, scale=scale, softcap=softcap)
    d = call.dims
    index = row_index(rows, d.L, q.device)
    if d.B * d.H * index.numel() * d.S == 0:  # an empty result
        return q.new_zeros(d.B, d.H, index.numel(), d.S)
    visible = (
        None if call.mask is None else call.mask.dense(d.B, d.H, d.L, d.S, q.device, rows=index)
    )  # (B|1, H|1, R, S)
    bias = call.bias_rows(index)  # (B|1, H|1, R|1, S|1) or None
    q_rows = call.q[:, :, index]  # (B, H, R, D)
    q_rows, k_seen, _, _ = zero_unseen_by_visibility(
        q_rows, call.k, call.k, effective_visibility(visible, bias)
    )
    weights, lse = weights_and_lse(
        q_rows, k_seen, visible, bias, scale=call.scale, softcap=call.softcap
    )  # (B, H, R, S), (B, H, R)
    if sinks is not None:
        weights = add_sinks(weights, lse, sinks)[0]
    return weights.to(q.dtype)
