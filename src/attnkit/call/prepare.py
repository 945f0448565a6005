"""`prepare`: a call planned once, to run on new q, k, v (each layer of a step, each
step of a loop); `explain` reads the same plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import cast

import torch
from torch import Tensor

from attnkit import runtime
from attnkit.call.dispatch import prepared_call
from attnkit.call.documents import Documents, documents
from attnkit.call.habits import points_habits
from attnkit.call.key import Options, call_key
from attnkit.call.paths import length, run_attention
from attnkit.call.planner import Plan, plan_call
from attnkit.call.prepared import Prepared, mask_state
from attnkit.contracts import check_sinks, normalize_call
from attnkit.errors import ShapeContractError
from attnkit.masks import Mask
from attnkit.masks.convert import from_torch_mask

__all__ = ["prepare", "prepare_plan"]

MaskLike = Mask | Tensor | None


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
        A decoding step's call (`attnkit.call.steps`: few queries, a mask that sees every
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
    q, k, v = (
        _given(q, dtype, device, requires_grad),
        _given(k, dtype, device, requires_grad),
        _given(v, dtype, device, requires_grad),
    )
    with torch.set_grad_enabled(torch.is_grad_enabled() or requires_grad):
        return prepare_plan(q, k, v, mask, scale, softcap, sinks, dropout_p, backend, need_lse)


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


def prepare_plan(
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
    mask = cast(MaskLike, from_torch_mask(mask, length(q), length(k)))  # else refused later
    prepared = prepared_call(
        q,
        k,
        v,
        mask,
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        backend=backend,
        need_lse=lse,
    )
    packed = documents(mask, q, k)
    runner = partial(
        run_attention,
        mask=mask,
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        backend=backend,
        need_lse=lse,
    )
    numbers = Options(
        None if scale is None else float(scale),
        None if softcap is None else float(softcap),
        float(dropout_p),
        backend,
        lse,
        True,
    )
    key = call_key(q, k, v, q.shape, k.shape, v.shape, mask_state(mask), numbers)
    assert key is not None  # validated: plain numbers
    explained = None
    if packed is not None:
        numbers_of_call = (scale, softcap, dropout_p)
        explained = partial(_documents_plan, packed, numbers_of_call, backend, lse)
    return prepared.with_mask(
        mask,
        key=key,
        sinks=sinks,
        runner=runner,
        per_document=packed is not None,
        explained=explained,
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
        call = normalize_call(
            *one,
            packed.inner,
            scale=scale,
            softcap=softcap,
            dropout_p=dropout_p,
            table=runtime.current().costs.table(),
        )
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
