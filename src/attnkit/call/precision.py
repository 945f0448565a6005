"""Which dtype each step computes in: the readable path, and the fused kernels.

The reference (and every softmax of attnkit) computes float16 and bfloat16 in float32.
Fused kernels take half inputs natively where the hardware multiplies half matrices
fast (a GPU; a CPU with AVX512-BF16 or AMX): they accumulate in float32 inside, and
attnkit sums what their inputs fan out to (the key/value gradients of the G query heads
of a GQA group) in float32 itself. Elsewhere (a CPU with AVX2 only, where a bfloat16
matrix product is many times slower than a float32 one) they run in float32, which is
then faster and also more precise.

`HalfKernels.kernel_dtype` decides: half runs natively on GPUs and on CPUs with
AVX512-BF16 or AMX (bfloat16) or AMX-FP16 (float16), probed once
(`_compat.half_matmul_is_fast`). The runtime holds the process's `HalfKernels`
(`runtime.current().half`), read from `ATTNKIT_HALF_KERNELS=native|float32|amx` once when
attnkit is imported: `native` or `float32` overrides the probe (`use` changes it in a
running process), and the test matrix runs both paths on every machine. `amx` is
`native`, and the native kernel's bfloat16 blocks that every row sees whole multiply on
AMX's tiles where the CPU has them (`cpublas::brgemm`); `auto` asks for the tiles on a
CPU with AMX (`_compat.cpu_kind`), where they run those blocks faster than the pair
dots, and the amx kind's cost table (from `benchmarks/results/native_amx.md`, measured
in that mode) prices the kernel on them.

On the native half path GQA K/V are repeated by
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
import warnings

import torch
from torch import Tensor

from attnkit._compat import cpu_kind, half_matmul_is_fast

__all__ = ["HALF", "MODES", "OVERRIDE_ENV", "HalfKernels", "compute_dtype"]

HALF = (torch.float16, torch.bfloat16)
OVERRIDE_ENV = "ATTNKIT_HALF_KERNELS"  # a mode other than "auto" overrides the hardware probe
MODES = ("auto", "native", "float32", "amx")  # the probe; half; float32; half with AMX's tiles


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16 and bfloat16 are computed in float32 (DESIGN.md §2); others as they are."""
    return torch.float32 if dtype in HALF else dtype


class HalfKernels:
    """What the fused kernels compute half inputs in: the process's choice, held by the
    runtime (`runtime.current().half`) and by the backends it made.

    Args:
        mode: `"auto"` (half natively where `half_matmul_is_fast`, else float32; whole
            bfloat16 blocks on AMX's tiles where the CPU has them),
            `"native"` (always half), `"float32"` (always float32) or `"amx"` (always
            half, and the native kernel's whole bfloat16 blocks on AMX's tiles where the
            CPU has them).

    Examples:
        >>> from attnkit.call.precision import HalfKernels
        >>> cpu = torch.device("cpu")
        >>> HalfKernels("native").kernel_dtype(torch.bfloat16, cpu)
        torch.bfloat16
        >>> HalfKernels("native").kernel_dtype(torch.bfloat16, cpu, bias=True)
        torch.float32
        >>> HalfKernels("float32").kernel_dtype(torch.float16, cpu)
        torch.float32
    """

    def __init__(self, mode: str = "auto") -> None:
        self.mode = "auto"
        self.use(mode)

    @classmethod
    def from_environment(cls) -> HalfKernels:
        """The choice `ATTNKIT_HALF_KERNELS` names (unset or empty: `"auto"`; a value
        that is not a mode warns, naming the modes, and gives `"auto"`)."""
        mode = os.environ.get(OVERRIDE_ENV, "").strip().lower() or "auto"
        if mode not in MODES:
            warnings.warn(
                f"{OVERRIDE_ENV}={mode!r} is not one of {', '.join(MODES)}: half inputs "
                "run as the hardware probe says ('auto').",
                stacklevel=2,
            )
            mode = "auto"
        return cls(mode)

    def use(self, mode: str) -> None:
        """Compute half inputs as `mode` says from now on (calls prepared before plan
        again: the dtype is part of their key)."""
        if mode not in MODES:
            raise ValueError(f"half kernels run in one of {', '.join(MODES)} (got {mode!r}).")
        self.mode = mode

    def kernel_dtype(
        self, dtype: torch.dtype, device: torch.device, *, bias: bool = False
    ) -> torch.dtype:
        """The dtype a fused kernel runs a call of `dtype` on `device` in.

        Half stays half where `half_matmul_is_fast` (or the mode is `"native"`), else
        float32; other dtypes run as they are. A call with a score `bias` runs in float32
        always: the kernels read the bias in their own dtype, and half would round it
        (ALiBi's -1000 is -1000 ± 4 in bfloat16).
        """
        if dtype not in HALF:
            return dtype
        if bias or self.mode == "float32":
            return torch.float32
        if self.mode in ("native", "amx"):
            return dtype
        return dtype if half_matmul_is_fast(dtype, device.type) else torch.float32

    def plan_key(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, bool]:
        """What a plan for half inputs of `dtype` depends on: the dtype they compute in,
        and whether AMX's tiles are asked for (a prepared call's key holds it)."""
        return self.kernel_dtype(dtype, device), self.asks_tiles()

    def asks_tiles(self) -> bool:
        """Whether whole bfloat16 blocks are asked onto AMX's tiles: the mode `"amx"`, or
        `"auto"` on a CPU with AMX (the kernel checks again that it can pack for them)."""
        return self.mode == "amx" or (self.mode == "auto" and cpu_kind() == "amx")

    def on_half_units(self, q: Tensor, *, alibi: bool) -> bool:
        """Whether the native kernels multiply q's blocks on the CPU's bfloat16 units:
        bfloat16 that runs natively, without ALiBi (its bias stays in float32); a build
        without the units converts to float32 whatever this says."""
        dtype = q.dtype
        return dtype == torch.bfloat16 and self.kernel_dtype(dtype, q.device, bias=alibi) in HALF

    def on_amx_tiles(self, q: Tensor, *, alibi: bool) -> bool:
        """Whether the native kernel is asked to multiply q's whole blocks on AMX's tiles
        (`asks_tiles`), on the half units; the kernel checks the CPU has the tiles
        (elsewhere the half units' own products run)."""
        return self.asks_tiles() and self.on_half_units(q, alibi=alibi)
