"""The production call: `attention`, `attention_with_lse`, `prepare`, `explain`.

Data flows one way: arguments -> contracts (validate, normalize) -> mask -> plan
(choose a backend) -> backend -> result; `attnkit.dispatch` runs it, and remembers the
validated plan of a repeated call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import torch
from torch import Tensor

from attnkit.contracts import check_sinks, normalize_call
from attnkit.dispatch import attention_call, prepared_call
from attnkit.documents import Documents, attend_documents, documents
from attnkit.errors import ShapeContractError
from attnkit.habits import points_habits
from attnkit.masks import Mask
from attnkit.masks.convert import from_torch_mask
from attnkit.planner import Plan, plan_call
from attnkit.prepared import Prepared, fit, mask_state
from attnkit.softmax import add_sinks

__all__ = ["attention", "attention_with_lse", "explain", "prepare"]

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
    """`attention_with_lse` without sinks (lse None unless `need_lse`), eagerly or as one
    custom op under `torch.compile`; a `CausalBias` enters as its `causal` mask.
    `check_bias`: refuse float masks that look like mistakes (`sdpa` adds them)."""
    if not (mask is None or type(mask) is Tensor or isinstance(mask, Mask)):
        mask = from_torch_mask(mask, _length(q), _length(k))  # a CausalBias, or refused later
    packed = None if torch.compiler.is_compiling() else documents(mask, q, k)
    if packed is not None and isinstance(mask, Mask):  # packed documents: a call each
        normalize_call(q, k, v, mask, scale=scale, softcap=softcap, dropout_p=dropout_p)

        def one(
            q: Tensor, k: Tensor, v: Tensor, inner: Mask | None
        ) -> tuple[Tensor, Tensor | None]:
            return attend(
                q, k, v, inner, scale=scale, softcap=softcap, dropout_p=dropout_p,
                backend=backend, need_lse=need_lse,
            )  # fmt: skip

        return attend_documents(q, k, v, packed, one)
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
    out, lse = attend(
        q, k, v, mask, scale=scale, softcap=softcap, dropout_p=dropout_p, backend=backend,
        need_lse=True,
    )  # fmt: skip
    assert lse is not None
    return (out, lse) if sinks is None else add_sinks(out, lse, sinks)


@points_habits
def prepare(
    q: Tensor | Sequence[int],
    k: Tensor | Sequence[int],
    v: Tensor | Sequence[int],
    mask: MaskLike = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    need_lse: bool = False,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    requires_grad: bool = False,
) -> Prepared:
    """The call `attention(q, k, v, mask, ...)` prepared once, to run on new q, k, v.

    Validation, the backend's choice and what derives from the mask and sizes are done
    once and kept by the `Prepared`, so a model running many layers of one kind per
    step prepares once per step; calling it checks that the inputs fit and runs.

    Args:
        q: (B, H, L, D), or its shape: inputs given as shapes take `dtype` (default
            float32), `device` (default cpu) and `requires_grad` (plan for a backward).
        k: (B, Hkv, S, D), or its shape.
        v: (B, Hkv, S, Dv), or its shape.
        mask: as `attention`, kept by the `Prepared` (its tensors must not change).
        scale: as `attention` (default None: 1/√D).
        softcap: as `attention` (default None).
        sinks: (H,) logits, as `attention` (default None).
        dropout_p: as `attention` (default 0.0).
        backend: as `attention` (default `"auto"`); the prepared call keeps its choice.
        need_lse: the log-sum-exp is wanted, for `with_lse` (default False).
        dtype: the dtype of inputs given as shapes (default None: float32).
        device: the device of inputs given as shapes (default None: the CPU).
        requires_grad: inputs given as shapes will require grad (default False).

    Returns:
        A `Prepared`: call it as `attention`, `.with_lse` as `attention_with_lse`; a
        call whose inputs do not fit raises `PreparedMismatchError`, naming what changed.
        A decoding step's call (`attnkit.steps`: few queries, a mask that sees every
        key but key padding) takes k and v of any length S, the cache growing step by
        step, planned once per bucket of S as `attention` plans it.

    Raises:
        ShapeContractError: and the other errors of `attention`, for the same causes.

    Examples:
        >>> q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
        >>> step = ak.prepare(q, k, v, ak.causal())
        >>> torch.allclose(step(q, k, v), ak.attention(q, k, v, ak.causal()))
        True
    """
    q, k, v = _given(q, dtype, device, requires_grad), _given(k, dtype, device,
                     requires_grad), _given(v, dtype, device, requires_grad)  # fmt: skip
    with torch.set_grad_enabled(torch.is_grad_enabled() or requires_grad):
        return _prepare(q, k, v, mask, scale, softcap, sinks, dropout_p, backend, need_lse)


def _given(
    x: Tensor | Sequence[int],
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    requires_grad: bool,
) -> Tensor:
    """A tensor as given, or one of its shape to prepare with (never read)."""
    if isinstance(x, Tensor):
        if dtype is not None or device is not None or requires_grad:
            raise TypeError(
                "dtype, device and requires_grad describe inputs given as shapes; q, k and v "
                "are tensors here, so they say it themselves."
            )
        return x
    if not isinstance(x, Sequence) or isinstance(x, str):
        raise TypeError(f"q, k and v must be tensors or shapes, got {type(x).__name__}.")
    shape = tuple(x)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
        raise ShapeContractError(f"a shape holds sizes (ints >= 0), got {shape}.")
    dev = torch.device("cpu" if device is None else device)
    tensor = torch.empty(shape, dtype=dtype or torch.float32, device=dev)
    return tensor.requires_grad_() if requires_grad else tensor


def _prepare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: MaskLike,
    scale: float | None,
    softcap: float | None,
    sinks: Tensor | None,
    dropout_p: float,
    backend: str,
    need_lse: bool,
) -> Prepared:
    if sinks is not None:
        sinks = check_sinks(sinks, q)
    lse = need_lse or sinks is not None  # sinks merge in through the log-sum-exp
    mask = from_torch_mask(mask, _length(q), _length(k))  # type: ignore[assignment]
    options = dict(scale=scale, softcap=softcap, dropout_p=dropout_p, backend=backend)
    prepared = prepared_call(q, k, v, mask, **options, need_lse=lse)  # type: ignore[arg-type]
    packed = documents(mask, q, k)
    route = partial(attend, mask=mask, **options, need_lse=lse)  # type: ignore[arg-type]
    numbers = (None if scale is None else float(scale), None if softcap is None else
               float(softcap), float(dropout_p), backend, lse, True)  # fmt: skip
    key = fit(q, k, v, q.shape, k.shape, v.shape, mask_state(mask), numbers)
    assert key is not None  # validated: plain numbers
    explained = None
    if packed is not None:
        numbers_of_call = (scale, softcap, dropout_p)
        explained = partial(_documents_plan, packed, numbers_of_call, backend, lse)
    return prepared.bound(
        mask, fit=key, sinks=sinks, route=route, routed=packed is not None, explained=explained
    )


def _documents_plan(
    packed: Documents,
    numbers: tuple[float | None, float | None, float],
    backend: str,
    need_lse: bool,
    row: Plan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    verbose: bool,
) -> Plan:
    """The plan of packed documents, which run one call per document, each planned on its
    own: headed by the backend that does most of the work (its reasons: its largest
    document's), a note counting the documents each backend runs; sizes, work and
    density the row's."""
    plans: dict[int, Plan] = {}
    for n in sorted({n for lengths in packed.lengths for n in lengths}):
        scale, softcap, dropout_p = numbers
        one = (q[:1, :, :n], k[:1, :, :n], v[:1, :, :n])  # (1, H|Hkv, n, D|Dv)
        call = normalize_call(*one, packed.inner, scale=scale, softcap=softcap, dropout_p=dropout_p)
        plans[n] = plan_call(call, backend, need_lse=need_lse, verbose=verbose)
    counts: Counter[str] = Counter()
    work: Counter[str] = Counter()
    for n in (n for lengths in packed.lengths for n in lengths):
        counts[plans[n].backend] += 1
        work[plans[n].backend] += plans[n].flops
    main = max(work, key=lambda name: work[name])
    largest = plans[max(n for n, plan in plans.items() if plan.backend == main)]
    each = ", ".join(f"{name} {counts[name]}" for name, _ in work.most_common())
    note = (
        f"packed documents: {sum(counts.values())} calls, one per document, each planned on "
        f"its own (a document's result does not depend on the pack); documents per backend: "
        f"{each}; the reasons above are the largest {main} document's (L = S = "
        f"{largest.shapes['q'][2]})"
    )
    return replace(
        largest,
        shapes=row.shapes,
        flops=row.flops,
        peak_bytes=max(plan.peak_bytes for plan in plans.values()),
        mask=row.mask,
        density=row.density,
        notes=[note, *largest.notes],
    )


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
    prepared = _prepare(q, k, v, mask, scale, softcap, sinks, dropout_p, backend, need_lse)
    return prepared.explain(verbose=verbose)
