"""Visibility: the rows that see no key and the keys no row sees, zeroed before a kernel.

A hidden entry gets weight 0, but `0 * NaN = NaN`: padded keys holding garbage, or a
query row that sees nothing, would still poison outputs and gradients through the
matrix products. So every backend takes its inputs cleaned here: the rows nobody's
keys reach and the keys nobody sees (`seen`) are found once per prepared call (from the
mask's spans in O(B·(L + S)) where it has exact ones, else by evaluating it in row
chunks: `masks.structure.seen`, or by a backend's cheaper way: tiled walks its plan's
blocks), kept by the prepared call for its runs (`call.derived`), and zeroed
(`zero_unseen`, `cleaned`). A float bias's `-inf` entries hide too
(`effective_visibility`); backends that build the dense mask anyway take rows and keys
from it (`hide_unseen`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnkit.contracts import AttentionCall
from attnkit.masks import structure

__all__ = ["cleaned", "effective_visibility", "hide_unseen", "seen", "zero_unseen"]

Seen = tuple[Tensor, Tensor]  # (B, H|1, L) rows that see a key, (B, H|1, S) keys seen


def seen(call: AttentionCall, find: Callable[[], Seen] | None = None) -> Seen | None:
    """Which query rows see some key, (B, H|1, L), and which keys some query row of
    their head sees, (B, H|1, S) (H only for a `head_dependent` mask), by the call's
    mask; None without a mask (every row sees every key).

    Found once per prepared call (`call.derived`): by `find` where the backend has a
    cheaper way, else `masks.structure.seen`.
    """
    mask, d = call.mask, call.dims
    if mask is None:
        return None

    def computed() -> Seen:
        if find is not None:
            return find()
        return structure.seen(mask, d.B, d.H, d.L, d.S, call.q.device)

    return call.derived.get("seen", computed)


def zero_unseen(
    q: Tensor, k: Tensor, v: Tensor, rows: Tensor, cols: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Zero query rows that see nothing and keys/values that no query sees.

    Args:
        rows: (B|1, H|1, L|1) bool, the query sees some key.
        cols: (B|1, H|1, S|1) bool, some query of that head sees the key; under GQA a
            K/V head counts as seen where any query head of its group sees it.
    """
    H, Hkv = q.shape[1], k.shape[1]
    if cols.shape[1] == H and H != Hkv:
        cols = cols.view(cols.shape[0], Hkv, H // Hkv, -1).any(2)  # (B|1, Hkv, S|1)
    if not bool(rows.all()):
        q = torch.where(rows.unsqueeze(-1), q, 0.0)
    if not bool(cols.all()):
        k = torch.where(cols.unsqueeze(-1), k, 0.0)
        v = torch.where(cols.unsqueeze(-1), v, 0.0)
    return q, k, v


def hide_unseen(
    q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """`zero_unseen` from a bool visibility tensor.

    Returns the cleaned `(q, k, v)` and the (B|1, H|1, L) bool "row sees something", or
    None if all rows do.

    Args:
        q: (B, H, L, D); k: (B, Hkv, S, D); v: (B, Hkv, S, Dv).
        visible: bool broadcastable to (B, H, L, S), `True` = may attend, or None.
    """
    if visible is None:
        return q, k, v, None
    rows = visible.any(-1)  # (B|1, H|1, L|1)
    q, k, v = zero_unseen(q, k, v, rows, visible.any(-2))
    return q, k, v, (None if bool(rows.all()) else rows)


def effective_visibility(visible: Tensor | None, bias: Tensor | None) -> Tensor | None:
    """What may be attended once a bias's `-inf` entries also count as hidden."""
    if bias is None:
        return visible
    finite = bias > -torch.inf  # (bias's broadcast shape)
    return finite if visible is None else visible & finite


def cleaned(
    call: AttentionCall, q: Tensor | None = None, k: Tensor | None = None, v: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """The call's q, k, v (or these, cast for a kernel) with the rows that see nothing
    and the keys no one sees zeroed: by the mask (`seen`), and by a bias tensor's `-inf`
    entries."""
    d = call.dims
    q, k, v = call.q if q is None else q, call.k if k is None else k, call.v if v is None else v
    if call.bias_tensor is not None:  # its -inf entries hide too: the pairs, exactly
        bias = call.bias_tensor
        visible = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)) > -torch.inf
        if call.mask is not None:
            visible = visible & call.mask.dense(d.B, d.H, d.L, d.S, q.device)
        rows_keys: Seen | None = (visible.any(-1), visible.any(-2))  # (B|1, H|1, L|1), (.., S|1)
    else:
        rows_keys = seen(call)
    return (q, k, v) if rows_keys is None else zero_unseen(q, k, v, *rows_keys)
