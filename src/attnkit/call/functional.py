"""The production call: `attention`, `attention_with_lse`, `explain` (`prepare` in
`call/prepare.py`).

Data flows one way: arguments -> contracts (validate, normalize) -> mask -> plan
(choose a backend) -> backend -> result; `attnkit.call.dispatch` runs it, and remembers the
validated plan of a repeated call.
"""

from __future__ import annotations

from torch import Tensor

from attnkit.call.habits import points_habits
from attnkit.call.paths import run_attention
from attnkit.call.planner import Plan
from attnkit.call.prepare import prepare_plan
from attnkit.contracts import check_sinks
from attnkit.masks import Mask
from attnkit.softmax import add_sinks

__all__ = ["attention", "attention_with_lse", "explain"]

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

    Query head `h` reads key/value head `h // G`, G = H // Hkv (GQA); conventions:
    [Design §2][2-semantics-that-never-change].

    Args:
        q: (B, H, L, D) queries: float16, bfloat16, float32 or float64.
        k: (B, Hkv, S, D) keys, q's dtype and device; H % Hkv == 0.
        v: (B, Hkv, S, Dv) values, q's dtype and device.
        mask: a `Mask` (`causal()`, `key_padding(...)`, their `&`), a bool tensor
            broadcastable to (B, H, L, S) (`True` = may attend) or a float one added to
            the scores (0 keeps, `-inf` removes). Default None: every key visible.
        scale: multiplies q·kᵀ, any finite float (default None: 1/√D).
        softcap: if set, scores become `c·tanh(s/c)` before masks and bias (default None).
        sinks: (H,) attention sinks: a logit per head added to each row's softmax
            denominator, with no value (default None).
        dropout_p: dropout on the weights, applied whenever > 0 (default 0.0).
        backend: `"auto"` (default: the cheapest that can serve the call, by the cost
            table; `explain` says which and why), `"reference"` (the readable loop,
            serves everything), `"sdpa"` (torch's `F.scaled_dot_product_attention`),
            `"tiled"` (a flash kernel over only the tiles the mask lets through),
            `"blockwise"` (the reference in blocks of query rows, O(rows·S) memory),
            `"native"` (attnkit's C++ CPU kernel for one key interval per row, where
            built) or `"flex"` (FlexAttention under `torch.compile`).

    Returns:
        (B, H, L, Dv) tensor in q's dtype; a query that sees no key gets 0.

    Raises:
        ShapeContractError: sizes that do not fit (named by letter), or a causal mask
            with L != S and no alignment.
        MaskError: an integer mask, or a float mask of only 0s and 1s.
        DtypeMismatchError: q, k, v of different dtypes.
        TypeError: SDPA's or nn.MultiheadAttention's keywords (`is_causal`, ...),
            naming the attnkit way.
        ValueError: an unknown backend, or one that cannot serve the call, saying why.

    Examples:
        >>> q = torch.randn(2, 8, 16, 64)  # (B, H, L, D)
        >>> k, v = torch.randn(2, 2, 16, 64), torch.randn(2, 2, 16, 64)  # Hkv = 2
        >>> out = ak.attention(q, k, v, ak.causal())
        >>> out.shape  # (B, H, L, Dv)
        torch.Size([2, 8, 16, 64])
        >>> torch.allclose(out, ak.attention(q, k, v, ak.causal(), backend="reference"), atol=1e-5)
        True
    """
    if sinks is not None:  # the sinks merge in through the log-sum-exp
        return attention_with_lse(
            q,
            k,
            v,
            mask,
            scale=scale,
            softcap=softcap,
            sinks=sinks,
            dropout_p=dropout_p,
            backend=backend,
        )[0]
    return run_attention(
        q,
        k,
        v,
        mask,
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        backend=backend,
        need_lse=False,
    )[0]


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

    Args:
        q: (B, H, L, D) queries.
        k: (B, Hkv, S, D) keys.
        v: (B, Hkv, S, Dv) values.
        mask: as `attention` (default None).
        scale: as `attention` (default None: 1/√D).
        softcap: as `attention` (default None).
        sinks: (H,) logits, as `attention` (default None).
        dropout_p: as `attention` (default 0.0).
        backend: as `attention` (default `"auto"`).

    Returns:
        out (B, H, L, Dv) and lse (B, H, L), natural log, float32 for half inputs,
        `-inf` on rows that see nothing (with `sinks`: the sink's logit included, so
        such a row's lse is its sink). Two results over disjoint key sets merge
        exactly with `attnkit.softmax.merge_partials`.

    Raises:
        ShapeContractError: and the other errors of `attention`, for the same causes.

    Examples:
        >>> q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
        >>> out, lse = ak.attention_with_lse(q, k, v, ak.causal())
        >>> lse.shape  # (B, H, L)
        torch.Size([1, 2, 4])
        >>> score = (q[:, :, 0] * k[:, :, 0]).sum(-1) / 8**0.5  # row 0 sees key 0 alone
        >>> torch.allclose(lse[:, :, 0], score)
        True
    """
    if sinks is not None:
        sinks = check_sinks(sinks, q)
    out, lse = run_attention(
        q,
        k,
        v,
        mask,
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        backend=backend,
        need_lse=True,
    )
    assert lse is not None
    return (out, lse) if sinks is None else add_sinks(out, lse, sinks)


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
    verbose: bool = False,
) -> Plan:
    """What `attention(...)` with these arguments would run, and why; runs nothing.

    `print(plan)` shows the choice, the reasons and the cost: `prepare(...).explain()`.

    Args:
        q: (B, H, L, D) queries.
        k: (B, Hkv, S, D) keys.
        v: (B, Hkv, S, Dv) values.
        mask: as `attention` (default None).
        scale: as `attention` (default None: 1/√D).
        softcap: as `attention` (default None).
        sinks: as `attention`; they need the log-sum-exp, as `need_lse` (default None).
        dropout_p: as `attention` (default 0.0).
        backend: as `attention` (default `"auto"`).
        need_lse: plan for `attention_with_lse` (default False).
        verbose: add the cost model's figures to the notes (default False: the table's
            source alone).

    Returns:
        A `Plan`: the backend, each other backend's reason, FLOPs, memory, the mask.

    Raises:
        ShapeContractError: and the other errors of `attention`, for the same causes.

    Examples:
        >>> q = torch.randn(1, 2, 4, 8)
        >>> plan = ak.explain(q, q, q, ak.causal())
        >>> plan.mask, plan.density, plan.flops  # 10 of 16 pairs: 2·B·H·10·(D + Dv)
        ('causal()', 0.625, 640)
        >>> plan.reasons[plan.backend] is None  # the chosen one has no reason against
        True
    """
    prepared = prepare_plan(q, k, v, mask, scale, softcap, sinks, dropout_p, backend, need_lse)
    return prepared.explain(verbose=verbose)
