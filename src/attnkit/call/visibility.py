"""Visibility: the rows that see no key and the keys no row sees, zeroed before a kernel.

A hidden entry gets weight 0, but `0 * NaN = NaN`: padded keys holding garbage, or a
query row that sees nothing, would still poison outputs and gradients through the
matrix products. So every backend takes its inputs cleaned here: the rows nobody's
keys reach and the keys nobody sees (`seen`) are found once per prepared call (from the
mask's spans in O(B·(L + S)) where it has exact ones, else by evaluating it in row
chunks: `masks.structure.seen_rows_keys`, or by a backend's cheaper way: tiled walks its plan's
blocks), kept by the prepared call for its runs (`call.plan_values`), and zeroed
(`zero_unseen`, `zero_unseen_of_call`). A float bias's `-inf` entries hide too
(`effective_visibility`); backends that build the dense mask anyway take rows and keys
from it (`zero_unseen_by_visibility`).

A key some rows see and others hide is another matter: zeroing it would change the rows
that see it. A non-finite value there reaches exactly the rows that see the key: the
readable loops sum the finite values and add what the others make of each row
(`values_poison`); a kernel that multiplies hidden weights by the values anyway runs on
the keys with their non-finite entries zeroed and gets the same addition
(`run_masking_values`), after one cheap check of K and V finds a non-finite entry
(`may_leak`, `all_finite`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from attnkit.contracts import AttentionCall
from attnkit.masks import Mask, structure

__all__ = [
    "all_finite",
    "effective_visibility",
    "may_leak",
    "run_masking_values",
    "seen_rows_keys",
    "values_poison",
    "zero_unseen",
    "zero_unseen_by_visibility",
    "zero_unseen_of_call",
]

SeenRowsKeys = tuple[Tensor, Tensor]  # (B, H|1, L) rows that see a key, (B, H|1, S) keys seen


def seen_rows_keys(
    call: AttentionCall, find: Callable[[], SeenRowsKeys] | None = None
) -> SeenRowsKeys | None:
    """Which query rows see some key, (B, H|1, L), and which keys some query row of
    their head sees, (B, H|1, S) (H only for a `head_dependent` mask), by the call's
    mask; None without a mask (every row sees every key).

    Found once per prepared call (`call.plan_values`): by `find` where the backend has a
    cheaper way, else `masks.structure.seen_rows_keys`.
    """
    mask, d = call.mask, call.dims
    if mask is None:
        return None

    def computed() -> SeenRowsKeys:
        if find is not None:
            return find()
        return structure.seen_rows_keys(mask, d.B, d.H, d.L, d.S, call.q.device)

    return call.plan_values.get("seen_rows_keys", computed)


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


def zero_unseen_by_visibility(
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


def zero_unseen_of_call(
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
        rows_keys: SeenRowsKeys | None = (
            visible.any(-1),
            visible.any(-2),
        )  # (B|1, H|1, L|1), (.., S|1)
    else:
        rows_keys = seen_rows_keys(call)
    return (q, k, v) if rows_keys is None else zero_unseen(q, k, v, *rows_keys)


def may_leak(call: AttentionCall) -> tuple[int, int] | None:
    """Where a non-finite key or value could reach a row that hides its key through a
    kernel that multiplies hidden weights (0) by it (0·NaN = NaN): None where no key is
    seen by some rows and hidden from others (no mask; one query row per head under a
    mask the same for every head: a decoding step), else the keys `[a, b)` that every
    row sees (a value there reaches every row alike: no check needed; `a == b`: check
    every key)."""
    d, mask = call.dims, call.mask
    if call.bias_tensor is not None:
        return (0, 0)
    if mask is None or (d.L == 1 and not mask.head_dependent):
        return None
    return call.plan_values.get("visibility.may_leak", lambda: _seen_by_all(mask, d.B, d.L, d.S))


def _seen_by_all(mask: Mask, B: int, L: int, S: int) -> tuple[int, int] | None:
    if mask.sees_all(L, S):
        return None
    spans = None if mask.head_dependent else mask.key_spans(B, L, S)
    if spans is None or not spans.exact:
        return (0, 0)
    a, b = int(spans.lo.max()), int(spans.hi.min())
    return (a, b) if a < b else (0, 0)


def all_finite(k: Tensor, v: Tensor, seen_by_all: tuple[int, int] = (0, 0)) -> bool:
    """The one cheap check: a sum over K and V outside the keys `seen_by_all` (a decoding
    chunk checks only its last keys). A NaN or an infinity makes the sum non-finite; an
    overflow of the dtype is summed again in float64."""
    a, b = seen_by_all
    parts = (
        [k, v] if a >= b else [t[:, :, r] for t in (k, v) for r in (slice(0, a), slice(b, None))]
    )
    parts = [t.detach() for t in parts if t.numel()]
    if math.isfinite(float(sum(t.sum() for t in parts))):
        return True
    return math.isfinite(float(sum(t.double().sum() for t in parts)))


def values_poison(seen: Tensor, values: Tensor) -> Tensor:
    """What the non-finite values of some keys add to each row's weighted sum: NaN,
    `+inf` or `-inf` in a column where the row sees a key holding one there (`+inf` and
    `-inf` together, or NaN: NaN), 0 elsewhere.

    Args:
        seen: (B|1, H|1, L|1, N|1) bool, the query row sees the key.
        values: (B|1, H|1, N, Dv) those keys' values (finite entries count for nothing).

    Returns:
        (B, H, L, Dv) float32, added to the sum of the finite values.
    """
    hits = seen.to(torch.float32).expand(*seen.shape[:-1], values.shape[-2])  # a mask of any S

    def reaches(where: Tensor) -> Tensor:  # (B, H, L, Dv): some seen key holds it
        return (hits @ where.to(torch.float32)) > 0

    nan, pos, neg = (
        reaches(values.isnan()),
        reaches(values == math.inf),
        reaches(values == -math.inf),
    )
    zero = hits.new_zeros(())
    signed = torch.where(pos, math.inf, torch.where(neg, -math.inf, zero))
    return torch.where(nan | (pos & neg), math.nan, signed)


Run = Callable[[AttentionCall], tuple[Tensor, Tensor | None]]


def run_masking_values(call: AttentionCall, run: Run) -> tuple[Tensor, Tensor | None]:
    """`run(call)` where K or V hold a non-finite entry, reaching only the rows that see
    its key: the kernel runs on K and V with those entries zeroed (exact for every row
    that hides the key), then each row that sees a non-finite key gets NaN (a score of
    NaN or an infinity: its softmax is NaN) and each row that sees a non-finite value gets
    it in that column (`values_poison`); their log-sum-exp is NaN where a key was.
    Gradients flow as through the zeroed inputs."""
    d = call.dims
    k_bad = ~torch.isfinite(call.k).all(-1)  # (B, Hkv, S)
    v_bad = ~torch.isfinite(call.v)  # (B, Hkv, S, Dv)
    cols = (k_bad | v_bad.any(-1)).any(1).any(0).nonzero().flatten()  # (N,)
    if cols.numel() == 0:  # the check's sum overflowed: every entry is finite
        return run(call)
    k = torch.where(k_bad.unsqueeze(-1), 0.0, call.k)
    v = torch.where(v_bad, 0.0, call.v)
    out, lse = run(replace(call, k=k, v=v))
    seen = _seen_at(call, cols)  # (B|1, H|1, L|1, N)
    G = d.H // d.Hkv
    key_rows = (seen & k_bad[:, :, cols].repeat_interleave(G, 1).unsqueeze(2)).any(-1)  # (B, H, L)
    poison = values_poison(seen, call.v[:, :, cols].repeat_interleave(G, 1))  # (B, H, L, Dv)
    poison = torch.where(key_rows.unsqueeze(-1), math.nan, poison)
    out = out + poison.to(out.dtype)
    if lse is not None:
        lse = torch.where(key_rows, math.nan, lse)
    return out, lse


def _seen_at(call: AttentionCall, cols: Tensor) -> Tensor:
    """(B|1, H|1, L|1, N) bool: which rows see the keys `cols`, by the mask and a bias
    tensor's `-inf` entries."""
    d = call.dims
    seen = torch.ones((1, 1, 1, cols.numel()), dtype=torch.bool, device=cols.device)
    if call.mask is not None:
        seen = call.mask.dense(d.B, d.H, d.L, d.S, call.q.device, cols=cols)
    if call.bias_tensor is not None:
        bias = call.bias_tensor
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        seen = seen & ((bias if bias.shape[-1] == 1 else bias[..., cols]) > -math.inf)
    return seen
