"""Backend `sdpa`: PyTorch's fused `F.scaled_dot_product_attention`.

SDPA alone gets three things wrong for us, which this file fixes around it: masked keys
holding NaN leak through `0 * NaN`, it returns no log-sum-exp, and a row that sees
nothing has no defined output. Top-left causal masks run as `is_causal=True`, with no
mask tensor at all.

Cleaning the unseen rows and keys (`attnkit.call.visibility`) is skipped where it is provably
unneeded. On a kernel that zeroes empty rows itself (PyTorch's CPU kernel) it is skipped
when one min/max pass shows no score can overflow. A call that needs no gradient and no
lse runs the kernel on the inputs as given and cleans only when the output is not
finite: a key no query sees has score `-inf` and weight exactly 0, so a finite key there
changes nothing and NaN or Inf there shows in the output (gradients would read it
through `dq = dS·K`, so calls with autograd clean first). The check is one pass over the
output (its sum is finite only if every entry is; a sum that overflows sends a finite
output to the cleaning path, which gives the same result), so a decoding step against a
padded cache reads the cache once, as plain SDPA does. A prepared kernel keeps its mask
tensor up to `KEPT_MASK_ELEMENTS` (2²⁰) elements; larger ones are rebuilt per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit._compat import (
    TORCH_SDPA,
    TorchFacts,
    cpu_flash_attention,
    cpu_flash_attention_backward,
)
from attnkit.backends.protocol import Backend, Block, Probe, Work
from attnkit.call import cost
from attnkit.call.precision import HALF, HalfKernels
from attnkit.call.visibility import (
    effective_visibility,
    seen_rows_keys,
    zero_unseen,
    zero_unseen_by_visibility,
)
from attnkit.contracts import AttentionCall, unit_last_stride
from attnkit.heads import repeat_kv_exact_grad, sum_groups
from attnkit.masks import Mask, causal, sliding_window
from attnkit.masks.spans import exact_spans
from attnkit.masks.structure import is_sdpa_causal
from attnkit.softmax import with_lse_gradient

__all__ = ["SdpaBackend"]


def _attn_mask(
    visible: Tensor | None, bias: Tensor | None, dtype: torch.dtype, as_float: bool
) -> Tensor | None:
    """SDPA's `attn_mask`: bool (True = attend) or an additive float of q's dtype."""
    if bias is None and (visible is None or not as_float):
        return visible
    if bias is not None:
        additive = bias.to(dtype)
    else:
        assert visible is not None
        additive = torch.zeros((), dtype=dtype, device=visible.device)
    return additive if visible is None else torch.where(visible, additive, -torch.inf)


def _masked_inputs(
    call: AttentionCall,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    need_lse: bool,
    *,
    clean: bool = True,
    zeroes: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """(q, k, v) with what no one sees zeroed, the kernel's mask, and the (B|1, H|1, L)
    rows that see a key (None if all do).

    One key interval per row: seen rows and keys come from the spans in O(B·L), once
    per mask and size (`visibility.seen`), and a mask under which every row sees every
    key (bottom-right causal at L = 1: decoding) is no mask at all. Otherwise from the
    dense mask, cleaned only where the kernel could not hide what it hides by itself
    (`_kernel_hides_unseen`; `zeroes`: the kernel gives rows that see nothing zeros,
    `TorchFacts.zeroes_empty_rows`). `clean=False`: the kernel's mask alone, inputs as
    given (`run` checks the output instead).
    """
    d, mask = call.dims, call.mask
    if mask is not None and not call.has_bias and mask.sees_all(d.L, d.S):
        return q, k, v, None, None  # every pair visible (a decoding step): no mask at all
    if not clean:
        visible = None if mask is None else mask.dense(d.B, d.H, d.L, d.S, q.device)
        if visible is not None and not call.has_bias and bool(visible.all()):
            return q, k, v, None, None  # every pair visible
        return q, k, v, _attn_mask(visible, call.bias, q.dtype, as_float=need_lse), None
    if mask is not None and not call.has_bias and not mask.head_dependent:
        spans = _spans(mask, d.B, d.L, d.S, q.device)
        if spans is not None:
            lo, hi = spans  # (B, L)
            if bool((lo <= 0).all()) and bool((hi >= d.S).all()):
                return q, k, v, None, None  # every pair visible
            rows_keys = seen_rows_keys(call)  # (B, 1, L), (B, 1, S)
            assert rows_keys is not None
            q, k, v = zero_unseen(q, k, v, *rows_keys)
            dense = mask.dense(d.B, d.H, d.L, d.S, q.device)  # (B|1, 1, L, S)
            rows = None if bool(rows_keys[0].all()) else rows_keys[0]
            return q, k, v, _attn_mask(dense, None, q.dtype, as_float=need_lse), rows
    visible = None if mask is None else mask.dense(d.B, d.H, d.L, d.S, q.device)
    effective = effective_visibility(visible, call.bias)  # (B|1, H|1, L, S)
    if zeroes and _kernel_hides_unseen(q, k, v, call.scale):  # nothing to clean: no copies
        rows = None if not need_lse or effective is None else effective.any(-1)
    else:
        q, k, v, rows = zero_unseen_by_visibility(q, k, v, effective)
    return q, k, v, _attn_mask(visible, call.bias, q.dtype, as_float=need_lse), rows


def _spans(
    mask: Mask, B: int, L: int, S: int, device: torch.device
) -> tuple[Tensor, Tensor] | None:
    """(B, L) key span [lo, hi) of each row, if the mask is one interval per row."""
    spans = exact_spans(mask, B, L, S, device)
    return None if spans is None else (spans[0].expand(B, L), spans[1].expand(B, L))


def _kernel_hides_unseen(q: Tensor, k: Tensor, v: Tensor, scale: float) -> bool:
    """True where the kernel alone gets hidden rows and keys right: finite inputs whose
    scores cannot overflow (an infinite score plus the mask's -inf is NaN), on a kernel
    that gives rows seeing nothing zero outputs and gradients (PyTorch's CPU kernel: the
    caller knows).

    Costs one min/max pass over q, k, v instead of the (L, S) reductions and the copies
    of `zero_unseen_by_visibility`.
    """
    if q.device.type != "cpu":
        return False
    peaks = [
        max(-float(lo), float(hi)) for lo, hi in (torch.aminmax(t.detach()) for t in (q, k, v))
    ]
    bound = peaks[0] * peaks[1] * q.shape[-1] * abs(scale)  # >= every |score|; NaN if any
    return bound < _SAFE_SCORE and math.isfinite(peaks[2])


_SAFE_SCORE = 1e30  # far below float32's overflow (3.4e38), even after the mask's bias


def _check_instead_of_cleaning(call: AttentionCall, need_lse: bool, zeroes: bool) -> bool:
    """True where a finite output from the inputs as given is the exact result, so the
    cleaning (passes over all of K and V per call, what decoding against a padded cache
    pays) can wait until the output shows a non-finite value.

    A key no query sees gets weight exactly 0 (its score is -inf), so finite keys and
    values there never change the output, and NaN or Inf there shows as a non-finite
    output; a row that sees nothing comes out 0 from PyTorch's CPU kernel. Gradients
    are another matter (dq = dS·K reads unseen keys: 0·NaN), so only calls that need
    none, and no log-sum-exp, no dropout, take this path; `zeroes`: the kernel gives
    rows that see nothing zeros (`TorchFacts.zeroes_empty_rows`).
    """
    return (
        not need_lse
        and call.dropout_p == 0
        and not call.requires_grad
        and call.q.device.type == "cpu"
        and zeroes
    )


KEPT_MASK_ELEMENTS = 1 << 20  # a prepared kernel keeps a mask tensor up to this size


@dataclass(frozen=True)
class _Kernel:
    """One SDPA call with everything but q, k, v decided; `checked`: a mask reaches the
    kernel, so a non-finite output (keys no query sees may hold NaN) gives None."""

    dtype: torch.dtype
    kernel_dtype: torch.dtype  # what the kernel computes in
    attn_mask: Tensor | None
    is_causal: bool
    scale: float
    dropout_p: float
    gqa: bool
    checked: bool

    @property
    def serves_any_length(self) -> bool:
        return self.attn_mask is None and not self.is_causal

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
        if self.kernel_dtype != self.dtype:
            q, k, v = q.to(self.kernel_dtype), k.to(self.kernel_dtype), v.to(self.kernel_dtype)
        out = TORCH_SDPA(
            q,
            k,
            v,
            attn_mask=self.attn_mask,
            dropout_p=self.dropout_p,
            is_causal=self.is_causal,
            scale=self.scale,
            enable_gqa=self.gqa,
        )  # (B, H, L, Dv)
        # one pass over the output: its sum is finite only if every entry is (a sum that
        # overflows sends a finite output to `run`, which gives the same result)
        if self.checked and not math.isfinite(out.sum().item()):
            return None
        return out if out.dtype == self.dtype else out.to(self.dtype)


# PyTorch's CPU flash kernel works in blocks: query rows by L (256 from L = 768, 64 from
# 192, else 32), keys by 512; with `is_causal` a block of rows reads whole key blocks up
# to its last row's key.
_QUERY_BLOCKS = ((768, 256), (192, 64), (0, 32))  # (L at least, rows per block)
_KEY_BLOCK = 512


def causal_pairs(L: int, S: int) -> int:
    """The query-key pairs the CPU flash kernel computes per head for `is_causal` (top
    left): each block of rows [m, m + r) computes r × its key blocks up to key m + r,
    masked corners included (0.75 of L×S at L = S = 1024, 0.56 at 4096: measured 0.75
    and 0.55 of the dense call's time on a 2-core AVX512-BF16 CPU)."""
    rows = min(next(size for least, size in _QUERY_BLOCKS if L >= least), L)
    keys = min(_KEY_BLOCK, S)
    total = 0
    for m in range(0, L, rows):
        r = min(rows, L - m)
        total += r * min(S, -(-min(m + r, S) // keys) * keys)
    return total


class SdpaBackend(Backend):
    """Fused kernels from PyTorch; no softcap; log-sum-exp on CPU through the flash op."""

    name = "sdpa"
    fastest_on_dense = True
    # per pair over its dense kernel's (the unit): `is_causal`, per pair it computes
    # (`causal_pairs`: its blocks); with a mask tensor, which it reads, skipping no block
    cost_factors = cost.Factors(
        {"causal": 1.0, "masked": 1.25, "convert": 0.9, "backward": 3.9, "backward_half": 3.0},
        {
            "amx": {"causal": 1.0, "masked": 1.88, "backward_half": 5.2},
            "avx512_bf16": {"backward_half": 3.0},  # not AMX's tiles
            "avx512": {"backward_half": 3.0},
        },
    )
    # `convert`: per element of q, k, v and out cast to the kernel's dtype and back where
    # it computes half inputs in float32 (a decoding step of a bfloat16 cache on an AVX2
    # CPU spends most of its time there: 8 sequences of 2,048 tokens, 37 ms against
    # 9 ms for the same call in bfloat16). `backward`: forward+backward over forward, the
    # `training_factor` (float32 3.9 at S = 4096 on a 2-core AVX512-BF16 CPU, none and
    # causal alike); `backward_half` where the kernel computes half as it is (2.9-3.1;
    # on AMX's tiles 4.3-5.8, median 5.2: benchmarks/results/native_amx.json)

    def __init__(self, facts: TorchFacts, half: HalfKernels) -> None:
        self.facts = facts  # what torch's CPU kernels do (the runtime's, probed once)
        self.half = half  # the runtime's: what half inputs compute in

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None:
        if call.softcap is not None:
            return "F.scaled_dot_product_attention has no softcap"
        if need_lse:
            if call.q.device.type != "cpu" or cpu_flash_attention() is None:
                return f"SDPA returns no log-sum-exp on {call.q.device.type} in this torch"
            if call.dropout_p > 0:
                return "the CPU flash kernel that returns the log-sum-exp has no dropout"
            if call.dims.D != call.dims.Dv:
                return "the CPU flash kernel that returns the log-sum-exp needs D == Dv"
            if call.requires_grad:
                return "the log-sum-exp of the CPU flash kernel carries no gradient"
        return None

    def cost(self, call: AttentionCall, *, need_lse: bool) -> float:
        d, factors = call.dims, self.factors(call.table)
        pairs = d.B * d.H * d.L * d.S
        converted = 0.0
        if self.half.kernel_dtype(call.q.dtype, call.q.device, bias=call.has_bias) != call.q.dtype:
            converted = (
                factors["convert"] * d.B * (d.H * d.L * (d.D + d.Dv) + d.Hkv * d.S * (d.D + d.Dv))
            )
        if self._is_causal(call):
            return factors["causal"] * d.B * d.H * causal_pairs(d.L, d.S) + converted
        return (pairs if call.is_dense else factors["masked"] * pairs) + converted

    def training_factor(self, call: AttentionCall) -> float:
        """`Backend.training_factor`, `backward_half` only where the kernel computes half
        inputs as they are (where it converts them, its backward is float32's)."""
        if not call.requires_grad:
            return 1.0
        q = call.q
        half = self.half.kernel_dtype(q.dtype, q.device, bias=call.has_bias) in HALF
        return self.factors(call.table)["backward_half" if half else "backward"]

    def calibrate(self, probe: Probe) -> dict[str, float]:
        """Its kernel with a mask tensor and with `is_causal` (per pair it computes:
        `causal_pairs`), at L = 4096, where large calls are decided."""
        L = 4096
        q, k, v = probe.inputs(L, H=2)
        band = (causal() & sliding_window(L // 8)).dense(1, 1, L, L)  # (1, 1, L, S)
        masked = probe.time(lambda: TORCH_SDPA(q, k, v, attn_mask=band))
        is_causal = probe.time(lambda: TORCH_SDPA(q, k, v, is_causal=True))
        return {"masked": masked / (2 * L * L), "causal": is_causal / (2 * causal_pairs(L, L))}

    @staticmethod
    def _is_causal(call: AttentionCall) -> bool:
        d = call.dims
        return call.mask is not None and not call.has_bias and is_sdpa_causal(call.mask, d.L, d.S)

    def work(self, call: AttentionCall) -> Work:
        """The whole L×S of each batch row, its upper triangle skipped where the mask is
        SDPA's causal one."""
        d, causal = call.dims, self._is_causal(call)
        return Work(tuple(Block(b, 0, d.L, 0, d.S, causal) for b in range(d.B)), 1, d.L)

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int:
        d = call.dims
        if self._is_causal(call):
            return 0
        batch = d.B if call.mask is not None and call.mask.batch_size else 1
        if call.has_bias or need_lse:  # an additive mask in q's dtype
            return batch * d.H * d.L * d.S * call.q.element_size()
        return batch * d.L * d.S  # a bool mask, broadcast over heads

    def serves_backward(self, call: AttentionCall) -> bool:
        """Calls whose kernel needs no mask (dense, top-left causal) on CPU, D == Dv."""
        d = call.dims
        if cpu_flash_attention_backward() is None or call.q.device.type != "cpu":
            return False
        if d.D != d.Dv or call.softcap is not None:
            return False
        return self._is_causal(call) or call.is_dense

    def backward(
        self, call: AttentionCall, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """Gradients of q, k, v from the call's output and log-sum-exp in one call of the
        CPU flash backward, for calls whose kernel needs no mask (dense, top-left causal);
        None for others. GQA: the op's own in float32; half K/V repeated, their gradients
        summed in float32."""
        d = call.dims
        backward_op = cpu_flash_attention_backward()
        if backward_op is None or not self.serves_backward(call):
            return None
        is_causal = self._is_causal(call)
        kernel_dtype = self.half.kernel_dtype(call.q.dtype, call.q.device)
        q, k, v = (t.to(kernel_dtype) for t in (call.q, call.k, call.v))
        # the op's own GQA sums a K/V head's G gradients in `kernel_dtype`: float32 only
        repeat = d.groups > 1 and (kernel_dtype in HALF or not self.facts.flash_gqa)
        if repeat:
            k, v = k.repeat_interleave(d.groups, 1), v.repeat_interleave(d.groups, 1)
        out, dout = out.to(kernel_dtype), unit_last_stride(dout.to(kernel_dtype))
        if dlse is not None:
            q, k, v, out, dout = with_lse_gradient(q, k, v, out, dout, dlse.to(kernel_dtype))
        gq, gk, gv = backward_op(
            dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=None, scale=call.scale
        )
        dq = gq[..., : d.D]
        dk, dv = gk[..., : d.D], gv[..., : d.Dv]
        if repeat:
            dk, dv = sum_groups(dk, d.groups), sum_groups(dv, d.groups)
        return dq.to(call.q.dtype), dk.to(call.k.dtype), dv.to(call.v.dtype)

    def prepare(self, call: AttentionCall, *, need_lse: bool) -> _Kernel | None:
        """The kernel call `run` makes for `call`, with everything but q, k, v decided
        (`attnkit.call.dispatch` keeps it for repeated calls), or None where `run` has
        per-call work (a bias, the log-sum-exp, cleaning before a masked call with
        gradients, half K/V heads repeated for their gradients) or the mask tensor is
        too large to keep (`KEPT_MASK_ELEMENTS`)."""
        kernel = self._kernel(call, need_lse)
        if kernel is not None and kernel.attn_mask is not None:
            return kernel if kernel.attn_mask.numel() <= KEPT_MASK_ELEMENTS else None
        return kernel

    def _kernel(self, call: AttentionCall, need_lse: bool) -> _Kernel | None:
        """A mask that reaches the kernel runs on the inputs as given only where
        `_check_instead_of_cleaning` allows, and the kernel then checks its output."""
        d, mask = call.dims, call.mask
        if need_lse or call.has_bias:
            return None
        kernel_dtype = self.half.kernel_dtype(call.q.dtype, call.q.device)
        if d.groups > 1 and kernel_dtype in HALF and call.requires_grad:
            return None  # K/V repeated by `run`, their gradients summed in float32
        is_causal = self._is_causal(call)
        attn_mask = None
        if mask is not None and not is_causal:
            attn_mask = _masked_inputs(call, call.q, call.k, call.v, False, clean=False)[3]
            checks = _check_instead_of_cleaning(call, need_lse, self.facts.zeroes_empty_rows)
            if attn_mask is not None and not checks:
                return None  # cleaning first (gradients, dropout, other devices)
        return _Kernel(
            call.q.dtype,
            kernel_dtype,
            attn_mask,
            is_causal,
            call.scale,
            call.dropout_p,
            d.groups > 1,
            checked=attn_mask is not None,
        )

    def run(self, call: AttentionCall, *, need_lse: bool) -> tuple[Tensor, Tensor | None]:
        d = call.dims
        q, k, v, rows, attn_mask = call.q, call.k, call.v, None, None
        # half natively where the hardware is fast, except under a bias (needs float32)
        kernel_dtype = self.half.kernel_dtype(q.dtype, q.device, bias=call.has_bias)
        if kernel_dtype != q.dtype:  # (`.to` costs microseconds even when nothing changes)
            q, k, v = q.to(kernel_dtype), k.to(kernel_dtype), v.to(kernel_dtype)
        is_causal = self._is_causal(call)
        if (call.mask is not None and not is_causal) or call.has_bias:
            if _check_instead_of_cleaning(call, need_lse, self.facts.zeroes_empty_rows):
                kernel = self._kernel(call, need_lse)  # None under a bias
                out = None if kernel is None else kernel(call.q, call.k, call.v)
                if out is not None:
                    return out, None
            zeroes = self.facts.zeroes_empty_rows
            q, k, v, attn_mask, rows = _masked_inputs(call, q, k, v, need_lse, zeroes=zeroes)
        # half K/V heads repeated by attnkit, so that their G gradients sum in float32
        # (PyTorch's CPU kernels sum them in half); float32 and forward-only calls use
        # the kernel's own GQA (the flash op's where it has one)
        repeat = d.groups > 1 and (
            (need_lse and not self.facts.flash_gqa) or (kernel_dtype in HALF and call.requires_grad)
        )
        if repeat:
            k, v = repeat_kv_exact_grad(k, d.groups), repeat_kv_exact_grad(v, d.groups)
        lse = None
        if need_lse:
            flash = cpu_flash_attention()
            assert flash is not None  # can_use refused the call otherwise
            out, lse = flash(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=call.scale)
        else:
            out = TORCH_SDPA(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=call.dropout_p,
                is_causal=is_causal,
                scale=call.scale,
                enable_gqa=d.groups > 1 and not repeat,
            )  # (B, H, L, Dv)
        if rows is not None:
            out = torch.where(rows.unsqueeze(-1), out, 0.0)
            lse = None if lse is None else torch.where(rows, lse, -torch.inf)
        return (out if out.dtype == call.q.dtype else out.to(call.q.dtype)), lse
