"""Backend `flex`: FlexAttention compiled by `torch.compile`, with a `Mask` as `mask_mod`.

A `Mask`'s predicate is already a function of `(b, h, q_idx, kv_idx)`, so it is the
`mask_mod` as it stands. The `BlockMask` (`Mask.to_block_mask`: from the key spans, no pair
evaluated where each row sees one interval) is built once per prepared call (never kept
on the mask); the compiled kernel is cached by `torch.compile` per
shape. Compiling costs seconds (about 20 s on the 2-core CPU machines), so `auto` only
picks `flex` for a call whose kernel is already compiled ("warm"); `backend="flex"`
compiles on first use. Preparing and running run in a fresh thread: inside a compiled
graph's op, FlexAttention's `vmap` fails in the op's dispatch state.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnkit._compat import dynamo_recompile_limit, flex_attention_module
from attnkit.backends.protocol import Backend, Block, Work
from attnkit.call import cost
from attnkit.call.precision import HalfKernels, compute_dtype
from attnkit.call.threads import in_fresh_thread
from attnkit.call.visibility import zero_unseen_of_call
from attnkit.contracts import AttentionCall
from attnkit.masks import blocks
from attnkit.reference import attend

__all__ = ["FlexBackend"]

CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what its CPU kernel lowers
RECOMPILE_LIMIT = 256  # one compiled kernel per shape and mask structure kept warm
CHECK_ROWS = 16  # query rows of a first call checked against the reference
BROKEN = (
    "compiled FlexAttention gave wrong results for this shape and mask (checked against the "
    "reference on its first call; PyTorch 2.13's CPU kernels misread some small ragged "
    "shapes, e.g. L=16, S=8); another backend serves it"
)


def _kernel_dtype(call: AttentionCall, half: HalfKernels) -> torch.dtype:
    """Half natively on GPUs (as `half.kernel_dtype` says); on CPU in float32, where compiled
    flex kernels of half inputs are another compile per dtype and gain nothing."""
    if call.q.device.type == "cpu":
        return compute_dtype(call.q.dtype)
    return half.kernel_dtype(call.q.dtype, call.q.device, bias=call.has_bias)


def _signature(call: AttentionCall, half: HalfKernels) -> tuple[Any, ...]:
    """What a compiled kernel is specialised on (besides tensors captured by the mask)."""
    return (
        str(call.mask),
        tuple(call.q.shape),
        tuple(call.k.shape),
        tuple(call.v.shape),
        _kernel_dtype(call, half),
        call.q.device.type,
        call.softcap is not None,
    )


class FlexBackend(Backend):
    """FlexAttention: block-sparse compiled kernels; forward only on CPU (PyTorch 2.13)."""

    name = "flex"
    # per pair in its 128×128 blocks, warm (not calibrated: measuring it compiles);
    # `backward` (a GPU's: no backward on CPU) taken as tiled's
    cost_factors = cost.Factors({"pair": 2.4, "backward": 3.7})

    def __init__(self, half: HalfKernels) -> None:
        self.half = half  # the runtime's: what half inputs compute in (GPUs)
        self._compiled: Any = None
        self._warm: set[tuple[Any, ...]] = set()  # compiled, and checked on its first call
        self._broken: dict[tuple[Any, ...], str] = {}  # failed or found wrong: why

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None:
        if flex_attention_module() is None:
            return "this torch has no FlexAttention"
        cpu = call.q.device.type == "cpu"
        if cpu and call.requires_grad:
            return "FlexAttention has no backward on CPU in this torch"
        if cpu and need_lse:
            return "compiled FlexAttention returns no log-sum-exp on CPU in this torch"
        if cpu and call.q.dtype not in CPU_DTYPES:
            return f"FlexAttention on CPU takes float32, float16 and bfloat16, not {call.q.dtype}"
        if call.has_bias or call.dropout_p > 0:
            return "an additive bias or dropout is not wired to FlexAttention here"
        if call.mask is None:
            return "no mask: nothing for block sparsity to skip"
        broken = self._broken.get(_signature(call, self.half)) if self._broken else None
        if broken is not None:
            return broken
        return None

    @property
    def version(self) -> int:
        """Changes whenever a kernel turns warm or broken (cached plans key on it)."""
        return len(self._warm) + len(self._broken)

    def is_warm(self, call: AttentionCall) -> bool:
        # (no signature to build, a string of the mask, while nothing is warm)
        if not self._warm or call.mask is None:
            return False
        return _signature(call, self.half) in self._warm

    def cost(self, call: AttentionCall, *, need_lse: bool) -> float:
        if not self.is_warm(call):
            return math.inf  # a first call compiles for ~20 s: never worth it for one call
        block_mask = self._block_mask(call)
        tile = block_mask.BLOCK_SIZE[0] * block_mask.BLOCK_SIZE[1]
        blocks = int(block_mask.kv_num_blocks.sum()) * (
            call.dims.B // block_mask.kv_num_blocks.shape[0]
        )
        if block_mask.full_kv_num_blocks is not None:
            blocks += int(block_mask.full_kv_num_blocks.sum()) * (
                call.dims.B // block_mask.full_kv_num_blocks.shape[0]
            )
        return float(self.factors(call.table)["pair"] * blocks * tile * call.dims.H)

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int:
        d = call.dims
        return d.B * d.H * d.L * (d.Dv + 1) * 4

    def work(self, call: AttentionCall) -> Work | None:
        """The blocks of the call's `BlockMask` that hold a visible pair (None without a
        mask: every block)."""
        if call.mask is None:
            return None
        d = call.dims
        block = call.mask.to_block_mask(d.B, 1, d.L, d.S)
        size_q, size_k = block.BLOCK_SIZE
        computed = block.to_dense()  # (B|1, 1, L blocks, S blocks), nonzero = computed
        return Work(
            tuple(
                Block(b, i * size_q, size_q, j * size_k, size_k)
                for b in range(d.B)
                for i, j in computed[min(b, computed.shape[0] - 1), 0].nonzero().tolist()
            ),
            1,
            size_q,
        )

    def _block_mask(self, call: AttentionCall) -> Any:
        """The `BlockMask` of a call, made once per prepared call (`call.plan_values`).
        Masks are values: nothing is stored on them."""
        mask = call.mask
        assert mask is not None
        d = call.dims

        def make() -> Any:
            return in_fresh_thread(  # vmap inside: it fails in a compiled graph's op
                lambda: blocks.block_mask(
                    mask, d.B, d.H, d.L, d.S, device=call.q.device, broadcast=True
                )
            )

        return call.plan_values.get("flex.block_mask", make)

    def run(self, call: AttentionCall, *, need_lse: bool) -> tuple[Tensor, Tensor | None]:
        flex = flex_attention_module()
        assert flex is not None and call.mask is not None
        if self._compiled is None:
            self._compiled = torch.compile(flex.flex_attention, dynamic=False)
        kernel_dtype = _kernel_dtype(call, self.half)
        score_mod = None
        if call.softcap is not None:
            cap = call.softcap

            def score_mod(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
                return cap * torch.tanh(score / cap)

        block_mask = self._block_mask(call)
        # keys no query sees may hold NaN: flex masks their scores, but 0·NaN still leaks
        q, k, v = zero_unseen_of_call(
            call, call.q.to(kernel_dtype), call.k.to(kernel_dtype), call.v.to(kernel_dtype)
        )
        signature = _signature(call, self.half)

        def kernel() -> Tensor:
            with dynamo_recompile_limit(RECOMPILE_LIMIT):
                out: Tensor = self._compiled(
                    q,
                    k,
                    v,
                    score_mod=score_mod,
                    block_mask=block_mask,
                    scale=call.scale,
                    enable_gqa=call.dims.groups > 1,
                )
            return out

        try:
            out = in_fresh_thread(kernel)  # it may run inside a compiled graph's op
        except Exception as err:  # the compiler's own failure (InductorError, ...)
            if signature in self._warm:
                raise
            first = str(err).splitlines()[0][:200] if str(err) else ""
            self._broken[signature] = (
                f"torch.compile failed to build its kernel for this shape and mask "
                f"({type(err).__name__}: {first}); another backend serves it"
            )
            raise ValueError(
                f"backend 'flex' cannot serve this call: {self._broken[signature]}."
            ) from err
        if signature not in self._warm:
            if not _agrees_with_reference(call, q, k, v, out):
                self._broken[signature] = BROKEN
                raise ValueError(f"backend 'flex' cannot serve this call: {BROKEN}.")
            self._warm.add(signature)
        return out.to(call.q.dtype), None


def _agrees_with_reference(
    call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, out: Tensor
) -> bool:
    """Whether a new kernel's output matches `reference` on a few evenly spaced rows."""
    d = call.dims
    assert call.mask is not None
    rows = torch.linspace(0, d.L - 1, min(d.L, CHECK_ROWS), device=q.device).round().long()
    visible = call.mask.dense(d.B, d.H, d.L, d.S, q.device, rows=rows)  # (B|1, H|1, R, S|1)
    bias = call.bias_rows(rows)
    want, _, _ = attend(q[:, :, rows], k, v, visible, bias, scale=call.scale, softcap=call.softcap)
    got = out[:, :, rows]  # (B, H, R, Dv)
    tolerance = 1e-3 * max(1.0, float(want.abs().max()) if want.numel() else 1.0)
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= tolerance
