"""Every torch-version and feature probe of attnkit, and the typed doors to the few
torch APIs its stubs leave untyped (`apply`, `eager`, `broadcast_shapes`).

Core code asks these names; it never inspects `torch.__version__` itself.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import torch

if TYPE_CHECKING:
    from torch.nn.attention.bias import CausalBias

__all__ = [
    "CPU_KINDS",
    "TORCH_SDPA",
    "AuxRequest",
    "TorchFacts",
    "apply",
    "broadcast_shapes",
    "cpu_features",
    "cpu_flash_attention",
    "cpu_flash_attention_backward",
    "cpu_kind",
    "dynamo_recompile_limit",
    "eager",
    "flex_attention_module",
    "half_matmul_is_fast",
    "probe_empty_rows",
    "probe_flash_gqa",
]


# torch's own SDPA, bound where torch defines it: code that routes
# `F.scaled_dot_product_attention` to `attnkit.sdpa` (a drop-in's usual use) must not make
# attnkit's backends call themselves
TORCH_SDPA = torch._C._nn.scaled_dot_product_attention


F = TypeVar("F", bound=Callable[..., Any])


def apply(function: type[torch.autograd.Function], *args: Any) -> Any:
    """`function.apply(*args)`: an autograd function's forward, recorded for backward."""
    return function.apply(*args)  # type: ignore[no-untyped-call]


def eager(fn: F) -> F:
    """`torch.compiler.disable(fn)`: `fn` runs eagerly inside compiled code."""
    return cast(F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]


def broadcast_shapes(*shapes: tuple[int, ...] | torch.Size) -> torch.Size:
    """`torch.broadcast_shapes`: the shape the given ones broadcast to (or a RuntimeError)."""
    return cast(torch.Size, torch.broadcast_shapes(*shapes))  # type: ignore[no-untyped-call]


def cpu_flash_attention() -> Any | None:
    """The CPU flash-attention op that also returns the log-sum-exp, or None.

    `aten::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
    *, attn_mask, scale) -> (out, logsumexp)` is what `F.scaled_dot_product_attention`
    dispatches to on CPU; it is private, so we probe for it rather than assume it.
    """
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def cpu_flash_attention_backward() -> Any | None:
    """The backward of `cpu_flash_attention`, taking the output and log-sum-exp, or None.

    `(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale)
    -> (grad_q, grad_k, grad_v)`: it recomputes the weights from the log-sum-exp given,
    which lets a blocked forward pass reuse it block by block.
    """
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class TorchFacts:
    """What the installed torch's CPU kernels do, probed at the first question and kept
    (the runtime holds one: `attnkit.runtime`)."""

    @functools.cached_property
    def flash_gqa(self) -> bool:
        """`probe_flash_gqa()`, once."""
        return probe_flash_gqa()

    @functools.cached_property
    def zeroes_empty_rows(self) -> bool:
        """`probe_empty_rows()`, once."""
        return probe_empty_rows()


def probe_flash_gqa() -> bool:
    """True if the CPU flash op and its backward take K/V with fewer heads than q (GQA,
    each K/V head serving H/Hkv query heads, its gradient summed over them) and agree
    with K/V repeated; where not, callers repeat K/V heads themselves."""
    forward, backward = cpu_flash_attention(), cpu_flash_attention_backward()
    if forward is None or backward is None:
        return False
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, 3, 4, generator=g) for h in (2, 1, 1, 2))
    repeated = [t.repeat_interleave(2, 1) for t in (k, v)]
    try:
        grouped = _flash_grads(forward, backward, (q, k, v), dout)
        plain = _flash_grads(forward, backward, (q, *repeated), dout)
    except RuntimeError:
        return False
    dk, dv = (g.reshape(1, 1, 2, 3, 4).sum(2) for g in plain[3:])
    want = (*plain[:3], dk, dv)
    return all(
        a.shape == b.shape and torch.allclose(a, b) for a, b in zip(grouped, want, strict=True)
    )


def _flash_grads(
    forward: Any, backward: Any, qkv: tuple[torch.Tensor, ...], dout: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """out, lse, dq, dk, dv of one causal CPU flash call."""
    q, k, v = qkv
    out, lse = forward(q, k, v, 0.0, True, attn_mask=None, scale=None)
    dq, dk, dv = backward(dout, q, k, v, out, lse, 0.0, True, attn_mask=None, scale=None)
    return out, lse, dq, dk, dv


def dynamo_recompile_limit(limit: int) -> Any:
    """A context raising torch.compile's per-function recompile limit (8 by default).

    FlexAttention compiles once per shape and mask; past the limit dynamo silently falls
    back to an unfused kernel that builds the full score matrix. The option is
    `recompile_limit` in recent torch and `cache_size_limit` before.
    """
    import contextlib

    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    if not hasattr(dynamo_config, name):
        return contextlib.nullcontext()
    return dynamo_config.patch(**{name: max(limit, getattr(dynamo_config, name))})


class AuxRequest(NamedTuple):
    """Which extra outputs `varlen_attn` returns: `lse=True` adds the log-sum-exp.

    The same NamedTuple as torch's `torch.nn.attention.varlen.AuxRequest` (2.9+), and
    either works: the drop-in reads `.lse`. It is not imported from torch, because that
    module loads the compiler (about 3 s) and `import attnkit` should not.

    Attributes:
        lse: also return the log-sum-exp, (T_q, H) float32 (float64 for float64 inputs)
            (default False).

    Examples:
        >>> from attnkit.dropins.pytorch import AuxRequest
        >>> q = torch.randn(5, 2, 8)  # (T, H, D): one sequence of 5
        >>> cu = torch.tensor([0, 5])
        >>> out, lse = ak.varlen_attn(q, q, q, cu, cu, 5, 5, return_aux=AuxRequest(lse=True))
        >>> lse.shape  # (T_q, H)
        torch.Size([5, 2])
        >>> AuxRequest()  # the default asks for nothing extra: out alone
        AuxRequest(lse=False)
    """

    lse: bool = False


def flex_attention_module() -> Any | None:
    """`torch.nn.attention.flex_attention` where this torch has it, else None."""
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        return None
    return flex_attention


# the CPU features that multiply half matrices at least as fast as float32 ones
_HALF_UNITS = {
    torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
    torch.float16: ("_is_amx_fp16_supported",),
}


def half_matmul_is_fast(dtype: torch.dtype, device_type: str) -> bool:
    """True where `dtype` matrix products run at least at float32's speed.

    Always on GPUs; on CPUs with AVX512-BF16 or AMX for bfloat16, AMX-FP16 for float16
    (probed through torch.cpu's private `_is_*_supported`; absent probes read False).
    """
    return device_type != "cpu" or dtype in _HALF_FAST


def cpu_features() -> dict[str, bool]:
    """The CPU's vector and matrix units that matter to attention, by name."""
    names = {
        "AVX2": "_is_avx2_supported",
        "AVX512": "_is_avx512_supported",
        "AVX512-BF16": "_is_avx512_bf16_supported",
        "AMX": "_is_amx_tile_supported",
        "AMX-FP16": "_is_amx_fp16_supported",
    }
    return {unit: _has(probe) for unit, probe in names.items()}


def _has(probe: str) -> bool:
    """torch.cpu's private `_is_*_supported` probe `probe`; an absent one reads False."""
    return bool(getattr(torch.cpu, probe, lambda: False)())


# what the cost model's built-in tables are kept for: the CPU's best unit, best first
# ("other": no AVX2, such as ARM or an old x86)
CPU_KINDS = ("amx", "avx512_bf16", "avx512", "avx2", "other")


def cpu_kind() -> str:
    """This CPU's kind among `CPU_KINDS`: the best of the units attention uses that it has
    (AMX tiles, AVX512 with bfloat16, AVX512, AVX2), as `cpu_features` finds them."""
    return _CPU_KIND


def _kind_of(units: dict[str, bool]) -> str:
    for kind, unit in (("amx", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512", "AVX512")):
        if units[unit]:
            return kind
    return "avx2" if units["AVX2"] else "other"


# the CPU's facts, probed once at import (a few microseconds): its kind, and the half
# dtypes its units multiply at least at float32's speed
_CPU_KIND = _kind_of(cpu_features())
_HALF_FAST = frozenset(
    dtype for dtype, probes in _HALF_UNITS.items() if any(_has(probe) for probe in probes)
)


def probe_empty_rows() -> bool:
    """True if CPU `F.scaled_dot_product_attention` gives a query whose mask row is all
    False a zero output and zero gradients (it does in torch 2.5+, which attnkit's
    fused path then relies on instead of cleaning such rows itself). Asked in a fresh
    thread: the caller may run under no_grad or inside an op's implementation, where
    the probe's backward would fail and wrongly say no."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_empty_rows_here).result()


def _empty_rows_here() -> bool:
    q, k, v = (torch.ones(1, 1, n, 2, requires_grad=True) for n in (2, 3, 3))
    visible = torch.tensor([[True, True, False], [False, False, False]])
    try:
        out = TORCH_SDPA(q, k, v, attn_mask=visible)
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    except RuntimeError:
        return False
    zero_row = bool((out[0, 0, 1] == 0).all()) and bool((dq[0, 0, 1] == 0).all())
    return zero_row and all(bool(torch.isfinite(g).all()) for g in (dq, dk, dv))


def torch_causal_bias() -> tuple[type[CausalBias], Any] | None:
    """torch's `CausalBias` tensor class and its `CausalVariant` enum
    (`torch.nn.attention.bias`, PyTorch 2.2+), or None: also while that module is not
    loaded, since no `CausalBias` exists then (importing it loads dynamo: seconds)."""
    if "torch.nn.attention.bias" not in sys.modules:
        return None
    try:
        from torch.nn.attention.bias import CausalBias, CausalVariant
    except ImportError:
        return None
    return CausalBias, CausalVariant
