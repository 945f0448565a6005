"""Run one fuzz case on every backend and compare with a float64 oracle of its own.

The oracle is the closed loop written out once more, independently of attnkit's code:
scores, softcap, bias, visibility from `Mask.materialize`, a softmax whose empty rows are
zero, the weighted sum, the log-sum-exp, and gradients by autograd. Each backend's
error against the float64 oracle must stay within 2× the error of the same oracle run
in the case's dtype, plus a floor (the flash-attention rule); a refusal must be a typed
error (`ValueError`, `TypeError`) with a reason. See `Outcome` for what is recorded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

import attnkit as ak
from attnkit import runtime
from attnkit.backends import backend_names
from attnkit.call.documents import documents
from attnkit.call.precision import HALF, compute_dtype
from fuzz_cases import Built, Case, build
from fuzz_leak import Leak, checked_gradients, checked_outputs, leak

FUSED = ("sdpa", "tiled", "flex", "auto")
# flex compiles for seconds a shape: only the cases that ask (`case.flex`) run it


def backends() -> tuple[str, ...]:
    """Every registered backend and auto (a backend registered later joins too)."""
    return tuple(name for name in backend_names() if name != "flex")


def reordered(
    backend: str, mask: object = None, q: torch.Tensor | None = None, k: torch.Tensor | None = None
) -> bool:
    """Backends whose scores round differently from the reference's: the fused kernels,
    blockwise (matmuls over key ranges sum in another order) and any other. Each may
    miss the strict rule by the rounding of the scores, eps·max|s| (found: blockwise at
    |logit| ~ 1000, seed 16 case 2467, 1.3x the strict bound in float32), and gets that
    slack. The reference too where the call is cut into packed documents (`q`, `k` and
    the mask given): each document's product is of another size, and the matrix library
    picks another kernel for it, summing over D in another order (an 8-token document at
    |logit| ~ 1000 scored 0.004 off the whole row's product: seed 0 case 775, dq 1.2x
    the strict bound)."""
    if backend != "reference":
        return True
    return q is not None and k is not None and documents(mask, q, k) is not None


# Floors relative to each tensor's magnitude: about 100 ulps for float32 and float64, and
# two ulps of the largest entry for the half types (results and the float64 truth are both
# rounded to the dtype, so one ulp apart is the same answer).
FLOOR = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Fused kernels recompute the weights in the backward pass as exp(s - lse) with lse kept
# in the compute dtype: its rounding, about eps·max|s|, becomes a relative error of the
# gradients (DESIGN.md, "Precision at extreme logits"). The promise: at most this many
# times eps·max|s| of the gradient's magnitude, on top of the rule. |s| is taken as
# Σ|q_d·k_d|·|scale| (+|bias|): the size of a score's own rounding, which exceeds eps·|s|
# where the products cancel (a score of -3 from terms of 1000 is known to about 1e-4).
LSE_ROUNDING = 4.0
_EPS64 = 4 * torch.finfo(torch.float64).eps


@dataclass
class Outcome:
    backend: str
    what: str  # "forward", "forward+lse", "backward", "probs", "explain"
    status: str  # "ok", "refused", "wrong", "crash"
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("wrong", "crash")


@dataclass
class Truth:
    out: torch.Tensor
    lse: torch.Tensor
    probs: torch.Tensor
    grads: tuple[torch.Tensor, ...]  # dq, dk, dv of (out·dout).sum()
    grads_lse: tuple[torch.Tensor, ...]  # ... plus (lse·dlse).sum() over finite lse
    max_logit: float
    # first-order sensitivity of out, and of dq, dk, dv (without and with the lse term),
    # to a relative error of the weights P: where a fused kernel's rounding of scores of
    # size max|s| shows (the online softmax's rescaling, the backward's exp(s - lse))
    sensitivity_out: torch.Tensor | float = 0.0
    sensitivity: tuple[torch.Tensor, ...] = ()
    sensitivity_lse: tuple[torch.Tensor, ...] = ()


def oracle(case: Case, b: Built, work: torch.dtype) -> Truth:
    """The loop in `work` precision from the clean inputs; results in float64."""
    q, k, v = (t.to(work).detach().requires_grad_() for t in b.clean)
    G = case.H // case.Hkv
    scale = case.scale if case.scale is not None else case.D**-0.5
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ kk.transpose(-1, -2) * scale  # (B, H, L, S)
    if case.softcap is not None:
        s = case.softcap * torch.tanh(s / case.softcap)
    if b.bias is not None:
        s = s + b.bias.to(work)
    s = s.masked_fill(~b.visible, -torch.inf)
    with torch.no_grad():  # a score's rounding: eps·Σ|q_d·k_d|·|scale| (+ |bias|), not eps·|s|
        size = q.abs() @ kk.abs().transpose(-1, -2) * abs(scale)  # (B, H, L, S)
        if b.bias is not None:
            size = size + b.bias.to(work).abs()
        size = size[torch.isfinite(s) & torch.isfinite(size)]
    max_logit = float(size.max()) if size.numel() else 0.0
    m = s.amax(-1, keepdim=True).detach() if s.shape[-1] else s.new_zeros(*s.shape[:-1], 1)
    m = torch.where(torch.isfinite(m), m, 0.0)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    seen = total > 0
    p = e / torch.where(seen, total, 1.0)  # (B, H, L, S), empty rows 0
    out = p @ vv  # (B, H, L, Dv)
    lse = torch.where(seen, m + torch.log(torch.where(seen, total, 1.0)), -torch.inf)[..., 0]
    dout, dlse = b.dout.to(work), b.dlse.to(work)
    loss = (out * dout).sum()
    grads = torch.autograd.grad(loss, (q, k, v), retain_graph=True, allow_unused=True)
    lse_term = (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()
    grads_lse = torch.autograd.grad(loss + lse_term, (q, k, v), allow_unused=True)
    tidy = _tidy(case.dtype)
    truth = Truth(
        tidy(out.detach()),
        lse.detach().double(),
        tidy(p.detach()),
        tuple(tidy(gr) for gr in grads),
        tuple(tidy(gr) for gr in grads_lse),
        max_logit,
    )
    if work == torch.float64:
        with torch.no_grad():
            # dS = P∘(dP - Δ): a relative error of P, and the rounding of dP and Δ
            dp = (dout @ vv.transpose(-1, -2)).abs() + (dout * out).sum(-1, keepdim=True).abs()
            args = (p, q.abs(), kk.abs(), dout.abs(), scale, G)
            truth.sensitivity_out = p @ vv.abs()  # (B, H, L, Dv)
            truth.sensitivity = _sensitivity(p * dp, *args)
            truth.sensitivity_lse = _sensitivity(p * (dp + dlse[..., None].abs()), *args)
    return truth


def _sensitivity(
    w: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
    G: int,
) -> tuple[torch.Tensor, ...]:
    """|dq|, |dk|, |dv| that a relative error of every weight would bring: dS = P∘(dP-Δ)
    gives dq = scale·dS·k and dk = scale·dSᵀ·q; dv = Pᵀ·dout."""
    B, H, _, S = p.shape

    def per_kv_head(t: torch.Tensor) -> torch.Tensor:  # (B, H, S, x) -> (B, Hkv, S, x)
        return t.view(B, H // G, G, S, t.shape[-1]).sum(2)

    dq = abs(scale) * w @ k  # (B, H, L, D)
    dk = per_kv_head(abs(scale) * w.transpose(-1, -2) @ q)  # (B, Hkv, S, D)
    dv = per_kv_head(p.transpose(-1, -2) @ dout)  # (B, Hkv, S, Dv)
    return dq, dk, dv


def _tidy(dtype: torch.dtype) -> Callable[[torch.Tensor | None], torch.Tensor]:
    """Round to the case's dtype (what a backend returns), then float64."""

    def tidy(t: torch.Tensor | None) -> torch.Tensor:
        assert t is not None
        return t.to(dtype).double()

    return tidy


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b|; infinities count as equal where b, rounded to a's dtype, is
    infinite or within a rounding of the dtype's largest value (an overflow either way)."""
    if a.numel() == 0:
        return 0.0
    a64 = a.double()
    diff = a64 - b
    edge = torch.finfo(a.dtype).max * 0.99 if a.dtype.is_floating_point else math.inf
    both_inf = torch.isinf(a64) & ((a64 == b) | ((b.abs() >= edge) & (a64.sign() == b.sign())))
    diff = torch.where(both_inf, 0.0, diff.abs())
    return float(torch.nan_to_num(diff, nan=math.inf, posinf=math.inf).max())


def compare(
    name: str,
    got: torch.Tensor | None,
    truth: torch.Tensor,
    ref: torch.Tensor,
    dtype: torch.dtype,
    extra: torch.Tensor | float = 0.0,
    max_logit: float = 0.0,
) -> str | None:
    """None if `got` keeps the rule against `truth` (with `ref` the same-dtype oracle).

    In float64 the same-dtype oracle is the truth itself, so the rule alone would ask
    for no error at all; there the floor grows with the rounding of the scores
    (eps·max|s|), which any other order of summation brings.
    """
    if got is None:
        return f"{name}: no gradient"
    if tuple(got.shape) != tuple(truth.shape):
        return f"{name}: shape {tuple(got.shape)} != {tuple(truth.shape)}"
    finite = truth[torch.isfinite(truth)]
    magnitude = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    floor = FLOOR[dtype] + (_EPS64 * max_logit if dtype == torch.float64 else 0.0)
    bound = 2 * _err(ref, truth) + floor * magnitude
    err = _err(got, truth)
    if not err <= bound and isinstance(extra, torch.Tensor):  # elementwise, with the slack
        same = got.double() == truth  # equal infinities (lse -inf of rows that see nothing)
        diff = torch.nan_to_num((got.double() - truth).abs(), nan=math.inf, posinf=math.inf)
        diff = diff.masked_fill(same, 0.0)
        excess = diff - extra
        err = float(excess.max()) if excess.numel() else 0.0
    if not err <= bound:
        kind = "non-finite values" if math.isinf(err) else f"error {err:.3g} > bound {bound:.3g}"
        return f"{name}: {kind}"
    return None


def _inputs(b: Built, grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not grad:
        return b.q, b.k, b.v
    return tuple(t.detach().requires_grad_() for t in (b.q, b.k, b.v))  # type: ignore[return-value]


def _call(fn: Callable[[], Outcome]) -> Outcome:
    try:
        return fn()
    except (ValueError, TypeError) as err:  # typed refusals: ShapeContractError, MaskError, ...
        message = str(err)
        return Outcome("", "", "refused" if message else "crash", message or "empty message")
    except Exception as err:  # anything else is a crash
        return Outcome("", "", "crash", f"{type(err).__name__}: {str(err)[:300]}")


def run_case(case: Case, only: tuple[str, ...] = ()) -> list[Outcome]:
    """Every backend (and attention_probs, explain, to_block_mask) on one case; `only`:
    those backends alone."""
    b = build(case)
    truth = oracle(case, b, torch.float64)
    ref = oracle(case, b, compute_dtype(case.dtype))
    kwargs = {"scale": case.scale, "softcap": case.softcap}
    outcomes = []
    names = only or ((*backends(), "flex") if case.flex else backends())
    for backend in names:
        for what in ("forward", "backward"):
            result = _call(
                lambda backend=backend, what=what: _check_backend(
                    case, b, truth, ref, backend, what, kwargs
                )
            )
            result.backend, result.what = backend, result.what or what
            outcomes.append(result)
    leaked = leak(case, b)
    for backend in names if leaked is not None else ():
        for what in ("leak forward", "leak backward"):
            result = _call(
                lambda backend=backend, what=what: _check_leak(
                    case, b, leaked, truth, ref, backend, what, kwargs
                )
            )
            result.backend, result.what = backend, what
            outcomes.append(result)
    checks = (("probs", _check_probs), ("explain", _check_explain), ("blocks", _check_blocks))
    for what, fn in () if only else checks:
        result = _call(lambda fn=fn: fn(case, b, truth, ref, kwargs))  # type: ignore[misc]
        result.backend, result.what = "api", what
        outcomes.append(result)
    for o in outcomes:  # every drawn call is valid: reference serves it, so these may not refuse
        if o.status == "refused" and o.backend in ("reference", "auto", "api"):
            o.status, o.detail = "wrong", f"refused a valid call: {o.detail}"
    return outcomes


def _check_backend(
    case: Case,
    b: Built,
    truth: Truth,
    ref: Truth,
    backend: str,
    what: str,
    kwargs: dict[str, float | None],
) -> Outcome:
    dtype = case.dtype
    if what == "forward":
        with torch.no_grad():
            try:
                out, lse = ak.attention_with_lse(b.q, b.k, b.v, b.mask, backend=backend, **kwargs)
                what = "forward+lse"
            except ValueError:  # this backend has no lse here: the output alone
                out, lse = ak.attention(b.q, b.k, b.v, b.mask, backend=backend, **kwargs), None
        moved = reordered(backend, b.mask, b.q, b.k)
        slack = _rounding(case, truth, backend) * truth.sensitivity_out if moved else 0.0
        problems = [compare("out", out, truth.out, ref.out, dtype, slack, truth.max_logit)]
        with torch.no_grad():  # the output alone, until served prepared (a repeated call)
            for _ in range(2 if lse is not None else 1):
                again = ak.attention(b.q, b.k, b.v, b.mask, backend=backend, **kwargs)
        problems.append(
            compare("out again", again, truth.out, ref.out, dtype, slack, truth.max_logit)
        )
        if lse is not None:
            lse_dtype = compute_dtype(dtype)
            # half kernels round the weights they sum: lse moves by about that much
            # a score rounded in another summation order moves the lse by as much (its
            # sensitivity to a relative error of every weight is 1): the reordering slack
            # of the precision bound (found: native, seed 0 native case 1126, bfloat16
            # inputs summed in float32 GEMMs of one key per row, |logit| ~ 1000: 1.16x)
            moved_by = _rounding(case, truth, backend) if moved else 0.0
            half = _half_kernel_rounding(case, truth, backend)
            lse_slack = torch.full_like(truth.lse, max(moved_by, half))
            problems.append(
                compare("lse", lse, truth.lse, ref.lse, lse_dtype, lse_slack, truth.max_logit)
            )
            if lse.dtype != compute_dtype(dtype):
                problems.append(f"lse dtype {lse.dtype}")
        if out.dtype != dtype:
            problems.append(f"out dtype {out.dtype} != {dtype}")
        return _outcome(what, problems)
    q, k, v = _inputs(b, grad=True)
    try:
        out, lse = ak.attention_with_lse(q, k, v, b.mask, backend=backend, **kwargs)
        want, ref_grads, sens = truth.grads_lse, ref.grads_lse, truth.sensitivity_lse
        loss = (out * b.dout).sum() + (lse.masked_fill(~torch.isfinite(lse), 0) * b.dlse).sum()
        what = "backward+lse"
    except ValueError:
        out = ak.attention(q, k, v, b.mask, backend=backend, **kwargs)
        want, ref_grads, sens = truth.grads, ref.grads, truth.sensitivity
        loss = (out * b.dout).sum()
    if not loss.requires_grad:  # a user's .backward() would raise
        return _outcome(what, ["the result is not joined to q, k, v: backward() raises"])
    got = torch.autograd.grad(loss, (q, k, v), allow_unused=True)
    moved = reordered(backend, b.mask, b.q, b.k)
    slack = [_rounding(case, truth, backend) * t if moved else 0.0 for t in sens]
    names = ("dq", "dk", "dv")
    problems = [
        compare(n, g, t, r, dtype, x, truth.max_logit)
        for n, g, t, r, x in zip(names, got, want, ref_grads, slack, strict=True)
    ]
    return _outcome(what, problems)


def _check_leak(
    case: Case,
    b: Built,
    leaked: Leak,
    truth: Truth,
    ref: Truth,
    backend: str,
    what: str,
    kwargs: dict[str, float | None],
) -> Outcome:
    """`fuzz_leak`: the rows and keys a NaN at a key some rows hide may not reach keep the
    rule against the truth of the clean inputs."""
    moved = reordered(backend, b.mask, b.q, b.k)
    rounding = _rounding(case, truth, backend) if moved else 0.0
    if what == "leak forward":
        out, problems = checked_outputs(backend, leaked, b.mask, kwargs, truth.out)
        slack = rounding * truth.sensitivity_out
        problems.append(compare("out", out, truth.out, ref.out, case.dtype, slack, truth.max_logit))
        return _outcome(what, problems)
    grads = checked_gradients(backend, leaked, b.mask, kwargs, b.dout, truth.grads)
    problems = [
        compare(n, g, t, r, case.dtype, rounding * x, truth.max_logit)
        for n, g, t, r, x in zip(
            ("dq", "dk", "dv"), grads, truth.grads, ref.grads, truth.sensitivity, strict=True
        )
    ]
    return _outcome(what, problems)


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the fused kernels run a CPU call of `dtype` in (the runtime's choice)."""
    return runtime.current().half.kernel_dtype(dtype, torch.device("cpu"))


def _rounding(case: Case, truth: Truth, backend: str | None = None) -> float:
    """Relative error of the weights a fused kernel may bring: eps·max|s| (and eps), eps
    of the dtype the kernel runs in (half natively where the runtime's `HalfKernels` says so)."""
    work = compute_dtype(case.dtype)
    if backend in FUSED:
        work = _kernel_dtype(case.dtype)
    return LSE_ROUNDING * torch.finfo(work).eps * max(1.0, truth.max_logit)


def _half_kernel_rounding(case: Case, truth: Truth, backend: str) -> float:
    """Absolute lse slack of a kernel running half natively (0 otherwise)."""
    if backend not in FUSED or _kernel_dtype(case.dtype) not in HALF:
        return 0.0
    return _rounding(case, truth, backend)


def _check_probs(
    case: Case, b: Built, truth: Truth, ref: Truth, kwargs: dict[str, float | None]
) -> Outcome:
    rows = list(case.rows)
    with torch.no_grad():
        got = ak.attention_probs(b.q, b.k, b.mask, rows=rows, **kwargs)
    index = torch.tensor(rows, dtype=torch.long)
    want, want_ref = truth.probs[:, :, index], ref.probs[:, :, index]
    # a few rows take another matrix product than all of them (the oracle's): another
    # summation order, whose rounding of scores of size max|s| moves each weight by
    # about eps·max|s| of itself
    slack = _rounding(case, truth) * want
    problem = compare("probs", got, want, want_ref, case.dtype, slack, truth.max_logit)
    return _outcome("probs", [problem])


def _check_explain(
    case: Case, b: Built, truth: Truth, ref: Truth, kwargs: dict[str, float | None]
) -> Outcome:
    plan = ak.explain(b.q, b.k, b.v, b.mask, **kwargs)
    mask = b.mask
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        mask = None  # a bias: explain counts the pairs of the visibility mask only
    if mask is None:
        pairs = case.B * case.H * case.L * case.S
    elif isinstance(mask, torch.Tensor):
        pairs = int(mask.expand(case.B, case.H, case.L, case.S).sum())
    else:
        pairs = int(mask.materialize(case.B, case.H, case.L, case.S).sum())
    flops = 2 * pairs * (case.D + case.Dv)
    problems = [None if plan.flops == flops else f"flops {plan.flops} != {flops}"]
    return _outcome("explain", problems)


def _check_blocks(
    case: Case, b: Built, truth: Truth, ref: Truth, kwargs: dict[str, float | None]
) -> Outcome:
    """`Mask.to_block_mask`: its present and full blocks against the case's visibility
    truth, reduced block by block (a block past L or S is padding: never full)."""
    from attnkit._compat import flex_attention_module
    from attnkit.masks import as_mask

    mask = b.mask
    empty = min(case.B, case.L, case.S) == 0  # to_block_mask refuses empty sizes
    if flex_attention_module() is None or mask is None or empty:
        return _outcome("blocks", [])
    if isinstance(mask, torch.Tensor):
        if mask.is_floating_point():
            return _outcome("blocks", [])
        mask = as_mask(mask)
    bs = (4, 8, 16)[case.seed % 3]
    got = mask.to_block_mask(case.B, case.H, case.L, case.S, block_size=bs)
    nq, nkv = -(-case.L // bs), -(-case.S // bs)
    visible = torch.nn.functional.pad(
        b.visible.bool(), (0, nkv * bs - case.S, 0, nq * bs - case.L)
    ).view(case.B, case.H, nq, bs, nkv, bs)
    full = visible.all(-1).all(-2)
    want = {"partial": visible.any(-1).any(-2) & ~full, "full": full}
    found = {
        "partial": _dense_blocks(got.kv_num_blocks, got.kv_indices),
        "full": _dense_blocks(got.full_kv_num_blocks, got.full_kv_indices),
    }
    problems = [
        None if torch.equal(found[k], want[k]) else f"{k} blocks differ (block_size {bs})"
        for k in want
    ]
    return _outcome("blocks", problems)


def _dense_blocks(count: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(B, H, nq, nkv) bool from a BlockMask's counts and indices (a permutation)."""
    used = torch.arange(indices.shape[-1]) < count[..., None]
    return torch.zeros_like(used).scatter_(-1, indices.long(), used)


def _outcome(what: str, problems: list[str | None]) -> Outcome:
    found = [p for p in problems if p]
    return Outcome("", what, "wrong" if found else "ok", "; ".join(found))
