"""The production call: `attention`, `attention_with_lse`, `attention_probs`, `explain`.

Data flows one way: arguments -> contracts (validate, normalize) -> mask -> plan
(choose a backend) -> backend -> result; `attnkit.dispatch` runs it, and remembers the
validated plan of a repeated call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnkit.contracts import check_sinks, normalize_call
from attnkit.dispatch import attention_call
from attnkit.documents import attend_documents, documents
from attnkit.errors import ShapeContractError
from attnkit.habits import points_habits
from attnkit.masks import Mask
from attnkit.masks.convert import from_torch_mask
from attnkit.planner import Plan, plan_call
from attnkit.reference import weights_and_lse
from attnkit.softmax import add_sinks
from attnkit.visibility import effective_visibility, hide_unseen

__all__ = ["attention", "attention_probs", "attention_with_lse", "explain"]

MaskLike = Mask | Tensor | None


@points_habits
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: MaskLike = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> Tensor:
    """Exact attention, on the fastest backend that can serve the call.

    Args:
        q: (B, H, L, D); k: (B, Hkv, S, D); v: (B, Hkv, S, Dv), with H % Hkv == 0.
        mask: a `Mask`, a bool tensor broadcastable to (B, H, L, S) (`True` = may
            attend), or a float tensor added to the scores (0 keeps, `-inf` removes).
        scale: multiplies q·kᵀ; default 1/√D.
        softcap: if set, scores become `c·tanh(s/c)` before masks and bias.
        sinks: (H,) attention sinks: a logit per head added to each row's softmax
            denominator, with no value (`attnkit.softmax.add_sinks`).
        dropout_p: dropout on the weights (applied whenever > 0).
        backend: "auto", "reference", "sdpa", "tiled" or "flex".
    Returns:
        (B, H, L, Dv) in q's dtype; a query that sees no key gets 0.
    """
    if sinks is not None:  # the sinks merge in through the log-sum-exp
        return attention_with_lse(
            q, k, v, mask, scale=scale, softcap=softcap, sinks=sinks, dropout_p=dropout_p,
            backend=backend,
        )[0]  # fmt: skip
    return attend(
        q, k, v, mask, scale=scale, softcap=softcap, dropout_p=dropout_p, backend=backend,
        need_lse=False,
    )[0]  # fmt: skip


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: object,
    *,
    scale: float | None,
    softcap: float | None,
    dropout_p: float,
    backend: str,
    need_lse: bool,
    check_bias: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """`attention_with_lse` without sinks (lse None unless `need_lse` where nothing
    compiles): eagerly through the prepared calls, or as one custom op under
    `torch.compile` (`attnkit.compiled`). torch's `CausalBias` enters as the `causal`
    mask it stands for. `check_bias`: refuse float masks that look like mistakes
    (`masks.check_additive`; `sdpa` adds them as torch does)."""
    mask = from_torch_mask(mask, _length(q), _length(k))
    found = None if torch.compiler.is_compiling() else documents(mask, q, k)
    if found is not None and isinstance(mask, Mask):  # packed documents: a call each
        normalize_call(q, k, v, mask, scale=scale, softcap=softcap, dropout_p=dropout_p)

        def one(
            q: Tensor, k: Tensor, v: Tensor, inner: Mask | None
        ) -> tuple[Tensor, Tensor | None]:
            return attend(
                q, k, v, inner, scale=scale, softcap=softcap, dropout_p=dropout_p,
                backend=backend, need_lse=need_lse,
            )  # fmt: skip

        return attend_documents(q, k, v, found, one)
    if torch.compiler.is_compiling():  # one custom op in the graph (attnkit.compiled)
        from attnkit.compiled import traced_attention  # loaded under torch.compile only

        return traced_attention(
            q, k, v, mask, scale=scale, softcap=softcap, dropout_p=dropout_p,  # type: ignore[arg-type]
            backend=backend, need_lse=need_lse,
        )  # fmt: skip
    return attention_call(
        q, k, v, mask, scale=scale, softcap=softcap, dropout_p=dropout_p,  # type: ignore[arg-type]
        backend=backend, need_lse=need_lse, check_bias=check_bias,
    )  # fmt: skip


def _length(t: object) -> int | None:
    """L or S of a (..., L|S, D) tensor, None for anything else (the contracts say why)."""
    return t.shape[-2] if isinstance(t, Tensor) and t.dim() >= 2 else None


@points_habits
def attention_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: MaskLike = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """`attention` plus the log-sum-exp of each row's scores.

    Returns:
        out (B, H, L, Dv) and lse (B, H, L), natural log, float32 for half inputs,
        `-inf` on rows that see nothing (with `sinks`: the sink's logit included, so
        such a row's lse is its sink). Two results over disjoint key sets merge
        exactly with `attnkit.softmax.merge_partials`.
    """
    if sinks is not None:
        sinks = check_sinks(sinks, q)
    out, lse = attend(
        q, k, v, mask, scale=scale, softcap=softcap, dropout_p=dropout_p, backend=backend,
        need_lse=True,
    )  # fmt: skip
    assert lse is not None
    return (out, lse) if sinks is None else add_sinks(out, lse, sinks)


def _row_index(
    rows: int | Sequence[int] | slice | Tensor | None, L: int, device: torch.device
) -> Tensor:
    if rows is None:
        return torch.arange(L, device=device)
    if isinstance(rows, slice):
        return torch.arange(L, device=device)[rows]
    index = torch.as_tensor(rows, device=device).reshape(-1)
    if index.numel() == 0:  # `rows=[]`: no rows (torch reads an empty list as float)
        return index.long()
    if index.is_floating_point() or index.dtype == torch.bool:
        raise TypeError(f"rows must be integer query positions, got dtype {index.dtype}.")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= L):
        raise ShapeContractError(
            f"rows {index.tolist()[:8]} fall outside the L={L} query positions [0, {L - 1}]."
        )
    return index


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

    Returns:
        (B, H, R, S) in q's dtype, R = L or the number of rows asked for; masked entries
        exactly 0, rows that see nothing all 0. With `sinks` a row sums to less than 1:
        the sink takes the rest.
    """
    if torch.compiler.is_compiling():  # reads mask tensors as data: eager, a graph break
        from attnkit.compiled import run_eagerly

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
    index = _row_index(rows, d.L, q.device)
    if d.B * d.H * index.numel() * d.S == 0:  # an empty result
        return q.new_zeros(d.B, d.H, index.numel(), d.S)
    visible = (
        None if call.mask is None else call.mask.dense(d.B, d.H, d.L, d.S, q.device, rows=index)
    )  # (B|1, H|1, R, S)
    bias = call.bias_rows(index)  # (B|1, H|1, R|1, S|1) or None
    q_rows = call.q[:, :, index]  # (B, H, R, D)
    q_rows, k_seen, _, _ = hide_unseen(q_rows, call.k, call.k, effective_visibility(visible, bias))
    weights, lse = weights_and_lse(
        q_rows, k_seen, visible, bias, scale=call.scale, softcap=call.softcap
    )  # (B, H, R, S), (B, H, R)
    if sinks is not None:
        weights = add_sinks(weights, lse, sinks)[0]
    return weights.to(q.dtype)


@points_habits
def explain(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: MaskLike = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    need_lse: bool = False,
) -> Plan:
    """What `attention(...)` with these arguments would run, and why; runs nothing.

    `print(plan)` shows the choice, the reasons and the cost. Sinks need the backend's
    log-sum-exp (with its gradient), as `need_lse=True` does.
    """
    if sinks is not None:
        check_sinks(sinks, q)
    call = normalize_call(q, k, v, mask, scale=scale, softcap=softcap, dropout_p=dropout_p)
    plan = plan_call(call, backend, need_lse=need_lse or sinks is not None)
    found = documents(mask, q, k)  # a CausalBias is never packed documents
    if found is not None:
        calls = sum(len(row) for row in found.lengths)
        plan.notes.append(
            f"packed documents: runs as {calls} calls, one per document, each planned on its "
            "own (a document's result does not depend on the pack); the plan above is the "
            "whole row's"
        )
    return plan
