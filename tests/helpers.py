"""Shared test helpers: the float64 reference rule of flash-attention's tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import attnkit as ak

# Absolute error floors, about 100 ulps at 1 for each dtype: where the reference happens to
# be exact (one visible key makes dq exactly 0), a fused kernel's rounding of the O(1)
# intermediates still shows; real bugs give errors of O(0.1) and above.
FLOOR = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def rounding_floor(truth: torch.Tensor, dtype: torch.dtype) -> float:
    """2x the error of rounding `truth` (+0.3) to `dtype`: flash-attention's hopper tests
    add this to their gradient bounds (`dq_atol`), a kernel's last rounding of a large
    value being a whole ulp of that value."""
    if not truth.numel():
        return 0.0
    t = truth.to(dtype)
    return 2 * ((t + 0.3 - 0.3).double() - t.double()).abs().max().item()


def assert_rule(name: str, got: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor) -> None:
    """`got`'s error against the float64 `truth` is at most 2x `ref`'s (same dtype) + floor."""
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err, ref_err = max_err(got, truth), max_err(ref, truth)
    bound = 2 * ref_err + FLOOR[got.dtype] + rounding_floor(truth, got.dtype)
    assert err <= bound, f"{name}: error {err:.3g} > 2 x reference error {ref_err:.3g} + floor"


def naive_same_dtype(q, k, v, mask, dout, dtype):
    """Out, dq, dk, dv of the textbook computation in `dtype`, as a plain PyTorch program
    in that dtype computes it: every op's result rounded to `dtype` (matrix products
    accumulate in float32 inside, as CPU and GPU libraries do), gradients rounded at the
    same boundaries; a GQA group's key/value gradients rounded per head, summed in
    float32. The comparand of the precision rule for half inputs (flash-attention's tests
    compare against the same computation in the same dtype)."""
    import math

    from attnkit.masks import as_mask
    from attnkit.masks.structure import dense_bias
    from attnkit.softmax import softmax_with_lse

    def r(t):
        return t.to(dtype).to(torch.float32)

    B, H, L, D = q.shape
    S, G = k.shape[2], H // k.shape[1]
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    kr = r(k32.repeat_interleave(G, dim=1))  # (B, H, S, D)
    vr = r(v32.repeat_interleave(G, dim=1))
    scores = r(r(q32 @ kr.transpose(-2, -1)) * (1 / math.sqrt(D)))  # (B, H, L, S)
    visible = None
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        scores = r(scores + mask.to(dtype).float())
    elif mask is not None:
        m = as_mask(mask)
        visible = m.dense(B, H, L, S, q.device)
        if m.has_bias:
            scores = r(scores + dense_bias(m, B, H, L, S, q.device).to(dtype).float())
    if visible is not None:
        scores = scores.masked_fill(~visible, -torch.inf)
    weights = r(softmax_with_lse(scores)[0])
    out = r(weights @ vr)  # (B, H, L, Dv)
    (out * r(dout.float())).sum().backward()
    return tuple(t.to(dtype) for t in (out.detach(), q32.grad, k32.grad, v32.grad))


EXACT_BACKENDS = ["reference", "sdpa", "tiled", "auto"]


def half_kernels(patch, mode: str) -> None:
    """Half inputs compute as `mode` says ("native", "float32" or "auto") until `patch`
    (a pytest MonkeyPatch) undoes it: the runtime's choice, which `ATTNKIT_HALF_KERNELS`
    sets when attnkit is imported."""
    from attnkit import runtime

    patch.setattr(runtime.current().half, "mode", mode)


def span_backend() -> str:
    """The backend `auto` takes for a sparse mask of one key interval per row: attnkit's
    native kernel where it is built, else the composed `tiled` (ATTNKIT_NATIVE=off)."""
    from attnkit.native import unavailable

    return "native" if unavailable() is None else "tiled"  # the backends every input runs on


def small_qkv(B=1, H=2, Hkv=1, L=6, S=6, D=8, Dv=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, L, D, generator=g).to(dtype),
        torch.randn(B, Hkv, S, D, generator=g).to(dtype),
        torch.randn(B, Hkv, S, Dv, generator=g).to(dtype),
    )


def out_and_grads(q, k, v, mask, backend, dout=None, lse=False, **kwargs):
    import attnkit as ak

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if lse:
        out, lse_value = ak.attention_with_lse(q, k, v, mask, backend=backend, **kwargs)
        loss = out.sum() + lse_value.masked_fill(~torch.isfinite(lse_value), 0).sum()
    else:
        out = ak.attention(q, k, v, mask, backend=backend, **kwargs)
        loss = (out * (torch.ones_like(out) if dout is None else dout)).sum()
    return (out.detach(), *torch.autograd.grad(loss, (q, k, v)))


def grid(mask: ak.Mask, L: int, S: int | None = None, batch: int = 0) -> list[list[int]]:
    S = L if S is None else S
    B = mask.batch_size or 1
    return mask.materialize(B, 1, L, S)[batch, 0].int().tolist()


def count_tile_plans(monkeypatch) -> list[tuple[object, ...]]:
    """The tile plans tiled makes from now on (their arguments but the mask), counted;
    prepared calls forgotten first, so the count starts at 0."""
    from attnkit.backends import tiled
    from attnkit.call import dispatch

    planned: list[tuple[object, ...]] = []
    real = tiled.best_plan

    def counting(*args: object) -> object:
        planned.append(args[1:])
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(tiled, "best_plan", counting)
    dispatch.clear()
    return planned
