"""Shape contracts: validate and normalize the arguments of an attention call.

Everything a user passes is checked here, once, at the public boundary; backends never
re-validate. Letters follow DESIGN.md §1: q is (B, H, L, D), k is (B, Hkv, S, D),
v is (B, Hkv, S, Dv), and H % Hkv == 0 (GQA: query head h reads K/V head h // (H/Hkv)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from attnkit.errors import ShapeContractError
from attnkit.masks import Mask, as_mask, check_broadcastable, integer_mask_error

__all__ = [
    "AttentionCall",
    "Dims",
    "ShapeContractError",
    "attention_contract_ok",
    "attention_score_elements",
    "check_attention_contract",
    "normalize_call",
]

MODES = ("self", "cross")


@dataclass(frozen=True)
class Dims:
    """The letters of one call: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)."""

    B: int
    H: int
    Hkv: int
    L: int
    S: int
    D: int
    Dv: int

    @property
    def groups(self) -> int:
        """G = H // Hkv query heads share one K/V head."""
        return self.H // self.Hkv


@dataclass(frozen=True)
class AttentionCall:
    """A validated attention call: what every backend receives."""

    q: Tensor  # (B, H, L, D)
    k: Tensor  # (B, Hkv, S, D)
    v: Tensor  # (B, Hkv, S, Dv)
    mask: Mask | None  # True = may attend (and maybe a structured bias, `Mask.has_bias`)
    bias_tensor: Tensor | None  # a float mask: additive, broadcastable to (B, H, L, S)
    scale: float
    softcap: float | None
    dropout_p: float
    dims: Dims

    @property
    def has_bias(self) -> bool:
        """Something is added to the scores: a float tensor mask or a structured bias."""
        return self.bias_tensor is not None or (self.mask is not None and self.mask.has_bias)

    @cached_property
    def bias(self) -> Tensor | None:
        """Every additive bias as one tensor broadcastable to (B, H, L, S) (dense backends)."""
        return self.bias_rows(None)

    def bias_rows(self, rows: Tensor | None) -> Tensor | None:
        """The additive bias of query `rows` only: (B|1, H|1, R|1, S|1), or None."""
        bias = self.bias_tensor
        if bias is not None:
            bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
            bias = bias if rows is None or bias.shape[2] == 1 else bias[:, :, rows]
        if self.mask is not None and self.mask.has_bias:
            d = self.dims
            structured = self.mask.dense_bias(d.B, d.H, d.L, d.S, self.q.device, rows=rows)
            assert structured is not None
            bias = structured if bias is None else bias + structured
        return bias

    @property
    def requires_grad(self) -> bool:
        """Autograd will need a backward pass through this call."""
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.q, self.k, self.v))


def check_attention_contract(
    q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int], mode: str
) -> Dims:
    """Raise `ShapeContractError` naming the offending dimension, else return the `Dims`.

    Shapes are (B, H, L, D), (B, Hkv, S, D), (B, Hkv, S, Dv). `mode='self'` also needs
    L == S (queries and keys come from the same sequence); `'cross'` lets them differ.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ShapeContractError(
                f"{name} must have 4 dims (B, heads, length, head_dim), got {len(shape)} dims "
                f"{tuple(shape)}. Use split_heads(x, num_heads) to go from (B, L, E), or "
                f"{name}.unsqueeze(1) for a single head."
            )
    B, H, L, D = q_shape
    Bk, Hkv, S, Dk = k_shape
    Bv, Hv, Sv, Dv = v_shape
    if not B == Bk == Bv:
        raise ShapeContractError(
            f"batch mismatch: q has B={B}, k has B={Bk}, v has B={Bv}; all three need the "
            "same batch size."
        )
    if Dk != D:
        raise ShapeContractError(
            f"head dim mismatch: q has D={D} but k has D={Dk}; scores are q·kᵀ, so q and k "
            "need the same head dim (project them to one size)."
        )
    if Sv != S:
        raise ShapeContractError(
            f"K/V length mismatch: k has S={S} keys but v has S={Sv} values; each key needs "
            "exactly one value."
        )
    if Hv != Hkv:
        raise ShapeContractError(
            f"k has Hkv={Hkv} heads but v has {Hv}; k and v must have the same number of heads."
        )
    if Hkv < 1 or H % Hkv != 0:
        raise ShapeContractError(
            f"H={H} query heads is not divisible by Hkv={Hkv} key/value heads; GQA needs "
            f"H % Hkv == 0 (e.g. Hkv in {[d for d in range(1, H + 1) if H % d == 0]})."
        )
    if mode == "self" and L != S:
        raise ShapeContractError(
            f"self-attention needs L == S, got L={L} queries and S={S} keys; use "
            "mode='cross' if they come from different sequences."
        )
    return Dims(B=B, H=H, Hkv=Hkv, L=L, S=S, D=D, Dv=Dv)


def attention_contract_ok(
    q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int], mode: str
) -> bool:
    """True when `check_attention_contract` would pass."""
    try:
        check_attention_contract(q_shape, k_shape, v_shape, mode)
    except ShapeContractError:
        return False
    return True


def attention_score_elements(
    batch_size: int, num_heads: int, seq_len: int, key_len: int | None = None
) -> int:
    """Entries of the score matrix QKᵀ: B·H·L·S. It grows with the square of the length."""
    return batch_size * num_heads * seq_len * (seq_len if key_len is None else key_len)


def _check_tensors(q: object, k: object, v: object) -> tuple[Tensor, Tensor, Tensor]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if not t.is_floating_point():
            raise TypeError(
                f"{name} has dtype {t.dtype}; attention needs floating point "
                "(float32, float16, bfloat16 or float64). Convert with .float()."
            )
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"dtype mismatch: q is {q.dtype}, k is {k.dtype}, v is {v.dtype}; cast them to "
            "one dtype."
        )
    _check_device("k", k, q.device)
    _check_device("v", v, q.device)
    return q, k, v


def _check_device(name: str, t: Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ShapeContractError(
            f"device mismatch: {name} is on {t.device} but q is on {device}; move it with "
            f"{name}.to(q.device)."
        )


def normalize_mask(
    mask: Mask | Tensor | None, dims: Dims, device: torch.device
) -> tuple[Mask | None, Tensor | None]:
    """Split `mask=` into a visibility `Mask` and an additive float bias, both checked."""
    target = (dims.B, dims.H, dims.L, dims.S)
    if mask is None:
        return None, None
    if isinstance(mask, Tensor):
        _check_device("mask", mask, device)
        if mask.is_floating_point():
            check_broadcastable("mask", tuple(mask.shape), target)
            return None, mask
        if mask.dtype != torch.bool:
            raise integer_mask_error("mask", mask.dtype)
    checked = as_mask(mask)
    checked.check(*target)
    return checked, None


def normalize_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
) -> AttentionCall:
    """Validate every argument of `attention(...)` and return the normalized call."""
    q, k, v = _check_tensors(q, k, v)
    dims = check_attention_contract(q.shape, k.shape, v.shape, "cross")
    if dims.L == 0 or dims.S == 0:
        raise ShapeContractError(
            f"empty sequence: L={dims.L} queries, S={dims.S} keys; attention needs at least "
            "one of each (skip the call for empty inputs)."
        )
    visibility, bias = normalize_mask(mask, dims, q.device)
    if scale is None:
        scale = 1.0 / math.sqrt(dims.D)
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale}.")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (s = c·tanh(s/c)), got {softcap}.")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}.")
    return AttentionCall(q, k, v, visibility, bias, float(scale), softcap, dropout_p, dims)
