"""Which dtype each step computes in: the readable path, and the fused kernels.

The reference (and every softmax of attnkit) computes float16 and bfloat16 in float32.
Fused kernels take half inputs natively where the hardware multiplies half matrices
fast (a GPU; a CPU with AVX512-BF16 or AMX): they accumulate in float32 inside, and
attnkit sums what their inputs fan out to (the key/value gradients of the G query heads
of a GQA group) in float32 itself. Elsewhere (a CPU with AVX2 only, where a bfloat16
matrix product is many times slower than a float32 one) they run in float32, which is
then faster and also more precise.

`kernel_dtype` decides: half runs natively on GPUs and on CPUs with AVX512-BF16 or AMX
(bfloat16) or AMX-FP16 (float16), probed once (`_compat.half_matmul_is_fast`);
`ATTNKIT_HALF_KERNELS=native|float32` overrides the probe, and the test matrix runs both
paths on every machine. On the native half path GQA K/V are repeated by
`heads.repeat_kv_exact_grad` (its backward sums the G heads in float32; float32 calls
use the kernels' own GQA, the CPU flash op's too where `_compat.TorchFacts.flash_gqa` finds
it), `tiled` merges block results and sums block gradients in float32 buffers, and a
call with a score bias (alibi, a float mask) runs in float32. Flex on CPU computes half
in float32.

The error bound of DESIGN.md §2 compares against the naive same-dtype computation,
`tests/helpers.naive_same_dtype` (every op rounded to the dtype, products accumulated in
float32, as a half PyTorch program computes); gradient bounds add flash-attention's
`dq_atol` (twice the rounding of the true value in the dtype).
"""

from __future__ import annotations

import os

import torch

from attnkit._compat import half_matmul_is_fast

__all__ = ["HALF", "OVERRIDE_ENV", "compute_dtype", "kernel_dtype"]

HALF = (torch.float16, torch.bfloat16)
OVERRIDE_ENV = "ATTNKIT_HALF_KERNELS"  # "native" or "float32" overrides the hardware probe


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16 and bfloat16 are computed in float32 (DESIGN.md §2); others as they are."""
    return torch.float32 if dtype in HALF else dtype


def kernel_dtype(dtype: torch.dtype, device: torch.device, *, bias: bool = False) -> torch.dtype:
    """The dtype a fused kernel runs a call of `dtype` on `device` in.

    Half stays half where `half_matmul_is_fast` (or `ATTNKIT_HALF_KERNELS=native`), else
    float32 (or `ATTNKIT_HALF_KERNELS=float32`); other dtypes run as they are. A call
    with a score `bias` runs in float32 always: the kernels read the bias in their own
    dtype, and half would round it (ALiBi's -1000 is -1000 ± 4 in bfloat16).
    """
    if dtype not in HALF:
        return dtype
    if bias:
        return torch.float32
    choice = os.environ.get(OVERRIDE_ENV, "auto")
    if choice == "native":
        return dtype
    if choice == "float32":
        return torch.float32
    return dtype if half_matmul_is_fast(dtype, device.type) else torch.float32
