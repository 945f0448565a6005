"""Shape contracts: validate and normalize the arguments of an attention call.

Everything a user passes is checked here, once, at the public boundary; backends never
re-validate. Letters follow the Design page, §1: q is (B, H, L, D), k is (B, Hkv, S, D),
v is (B, Hkv, S, Dv), and H % Hkv == 0 (GQA: query head h reads K/V head h // (H/Hkv)).

`normalize_call` makes layouts, scale and empty sizes safe for every kernel: an input
whose last dim has a stride other than 1 is copied once (PyTorch's CPU flash kernels
misread it; other strides pass as views); a scale <= 0 is folded into q exactly (`scale
< 0`: `-q` with `-scale`; `scale = 0`: every score 0), since fused kernels mask with
`-inf` before they scale and would turn hidden scores into NaN; D = 0 gives the kernels
one zero feature joined to q and k (`normalize_inputs`), so q and k get gradients of
their own (..., 0) shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from attnkit.call.cost import CostTable
from attnkit.call.validated import AttentionCall, Dims
from attnkit.errors import DtypeMismatchError, ShapeContractError
from attnkit.masks import Mask, as_mask, check_broadcastable, integer_mask_error
from attnkit.masks.checks import check_additive
from attnkit.masks.convert import from_torch_mask

__all__ = [
    "AttentionCall",
    "Dims",
    "ShapeContractError",
    "attention_contract_ok",
    "attention_score_elements",
    "check_attention_contract",
    "normalize_call",
    "normalize_inputs",
    "row_index",
    "unit_last_stride",
]

MODES = ("self", "cross")


def check_attention_contract(
    q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int], mode: str
) -> Dims:
    """Check the shapes of an attention call, naming the offending dimension.

    Args:
        q_shape: (B, H, L, D) of positive ints.
        k_shape: (B, Hkv, S, D), with H % Hkv == 0 (GQA).
        v_shape: (B, Hkv, S, Dv).
        mode: `"self"` (queries and keys from one sequence: L == S) or `"cross"`.

    Returns:
        The `Dims` (B, H, Hkv, L, S, D, Dv) of the call.

    Raises:
        ShapeContractError: a dimension breaks the contract; the message names it.
        ValueError: an unknown `mode`.

    Examples:
        >>> ak.check_attention_contract((2, 8, 16, 64), (2, 2, 16, 64), (2, 2, 16, 32), "self")
        Dims(B=2, H=8, Hkv=2, L=16, S=16, D=64, Dv=32)
        >>> ak.check_attention_contract((1, 4, 8, 64), (1, 4, 6, 64), (1, 4, 6, 64), "self")
        Traceback (most recent call last):
            ...
        attnkit.errors.ShapeContractError: self-attention needs L == S, got L=8 ...
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    dims = _check_shapes(q_shape, k_shape, v_shape, minimum=1)
    if mode == "self" and dims.L != dims.S:
        raise ShapeContractError(
            f"self-attention needs L == S, got L={dims.L} queries and S={dims.S} keys; use "
            "mode='cross' if they come from different sequences."
        )
    return dims


def _check_shapes(
    q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int], *, minimum: int
) -> Dims:
    """The cross-attention contract; sizes B, L, S, Dv may be 0 when `minimum` is 0."""
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ShapeContractError(
                f"{name} must have 4 dims (B, heads, length, head_dim), got {len(shape)} dims "
                f"{tuple(shape)}. Use split_heads(x, num_heads) to go from (B, L, E), or "
                f"{name}.unsqueeze(1) for a single head."
            )
        if type(shape) is torch.Size and min(shape) >= minimum:
            continue  # ints by construction (the common case: no scan in Python)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < minimum for n in shape):
            raise ShapeContractError(
                f"{name} has shape {tuple(shape)}; every size must be an int >= {minimum}."
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
    if H and (Hkv < 1 or H % Hkv != 0):  # H = 0 (minimum 0): an empty call, as torch's
        raise ShapeContractError(
            f"H={H} query heads is not divisible by Hkv={Hkv} key/value heads; GQA needs "
            f"H % Hkv == 0 with both >= 1 (e.g. Hkv in "
            f"{[d for d in range(1, H + 1) if H % d == 0]})."
        )
    return Dims(B=B, H=H, Hkv=Hkv, L=L, S=S, D=D, Dv=Dv)


def attention_contract_ok(
    q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int], mode: str
) -> bool:
    """True when `check_attention_contract` would pass; False for an unknown `mode` too.

    Args:
        q_shape: (B, H, L, D).
        k_shape: (B, Hkv, S, D).
        v_shape: (B, Hkv, S, Dv).
        mode: `"self"` (L == S) or `"cross"`.

    Returns:
        A bool; it never raises.

    Examples:
        >>> ak.attention_contract_ok((2, 8, 16, 64), (2, 2, 16, 64), (2, 2, 16, 64), "self")
        True
        >>> ak.attention_contract_ok((2, 8, 16, 64), (2, 3, 16, 64), (2, 3, 16, 64), "self")
        False
    """
    try:
        check_attention_contract(q_shape, k_shape, v_shape, mode)
    except ValueError:  # ShapeContractError, or an unknown mode (the seed returns False)
        return False
    return True


def attention_score_elements(
    batch_size: int, num_heads: int, seq_len: int, key_len: int | None = None
) -> int:
    """Entries of the score matrix QKᵀ: B·H·L·S. It grows with the square of the length.

    Args:
        batch_size: B.
        num_heads: H, query heads.
        seq_len: L, query length.
        key_len: S, key length (default None: L, self-attention).

    Returns:
        The int B·H·L·S.

    Raises:
        ValueError: a size that is not an int >= 0.

    Examples:
        >>> ak.attention_score_elements(1, 8, 1, 4096)  # a decoding step: 8·4096
        32768
    """
    key_len = seq_len if key_len is None else key_len
    sizes = {"batch_size": batch_size, "num_heads": num_heads, "seq_len": seq_len}
    for name, value in {**sizes, "key_len": key_len}.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}.")
    return batch_size * num_heads * seq_len * key_len


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
        raise DtypeMismatchError(
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
    mask: object, dims: Dims, device: torch.device, *, check_bias: bool = True
) -> tuple[Mask | None, Tensor | None]:
    """Split `mask=` into a visibility `Mask` and an additive float bias, both checked.

    torch's `CausalBias` is read as the `causal` mask it stands for. A float mask's
    values are checked (`masks.check_additive`: no +inf or NaN, not a keep-mask cast to
    float) if `check_bias`: `sdpa` adds whatever torch would add, and a compiled call
    does not read the mask's values at each step.
    """
    target = (dims.B, dims.H, dims.L, dims.S)
    if mask is None:
        return None, None
    mask = from_torch_mask(mask, dims.L, dims.S)
    if isinstance(mask, Tensor):
        _check_device("mask", mask, device)
        if mask.is_floating_point():
            check_broadcastable("mask", tuple(mask.shape), target)
            if check_bias:
                check_additive("mask", mask)
            return None, mask
        if mask.dtype != torch.bool:
            raise integer_mask_error("mask", mask.dtype)
    checked = as_mask(mask)
    checked.check(*target)
    return checked, None


def row_index(
    rows: int | Sequence[int] | slice | Tensor | None, L: int, device: torch.device
) -> Tensor:
    """`attention_probs`' `rows=` as a 1-D index of query positions in [0, L)."""
    if rows is None:
        return torch.arange(L, device=device)
    if isinstance(rows, slice):
        return torch.arange(L, device=device)[rows]
    index = torch.as_tensor(rows, device=device).reshape(-1)
    if index.numel() == 0:  # `rows=[]`: no rows (torch reads an empty list as float)
        return index.long()
    if index.is_floating_point() or index.dtype == torch.bool:
        raise TypeError(f"rows must be integer query positions, got dtype {index.dtype}.")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= L):
        raise ShapeContractError(
            f"rows {index.tolist()[:8]} fall outside the L={L} query positions [0, {L - 1}]."
        )
    return index


def check_sinks(sinks: object, q: Tensor) -> Tensor:
    """`sinks=`: one finite float logit per query head, (H,), on q's device."""
    H = q.shape[1] if q.dim() == 4 else None
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        got = sinks.dtype if isinstance(sinks, Tensor) else type(sinks).__name__
        raise TypeError(
            f"sinks must be a float tensor of shape (H,), one logit per query head, got {got}."
        )
    if sinks.dim() != 1 or (H is not None and sinks.shape[0] != H):
        raise ShapeContractError(
            f"sinks has shape {tuple(sinks.shape)} but q has H={H} heads; give one logit "
            f"per query head, shape ({H},)."
        )
    _check_device("sinks", sinks, q.device)
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(sinks).all()):
        raise ValueError(
            f"sinks must be finite logits, got {sinks.tolist()[:8]}; for no sink on a head "
            "leave sinks=None (a -inf sink is no sink)."
        )
    return sinks


def unit_last_stride(t: Tensor) -> Tensor:
    """`t`, copied only if its last dim is not contiguous.

    PyTorch's CPU flash kernels read the last dim as if its stride were 1 and give wrong
    numbers otherwise (a transposed or `x[..., ::2]` view); every other stride, expanded
    ones included, they read correctly.
    """
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}.")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}.")
    return float(value)


def _fold_scale(q: Tensor, scale: float) -> tuple[Tensor, float]:
    """(q, scale) with scale > 0 and the same scores q·kᵀ·scale.

    Fused kernels mask with -inf before they scale, so a scale <= 0 turns hidden scores
    into NaN (0·-inf) or +inf; the sign folds into q exactly (negation rounds nothing)
    and a zero scale makes every score 0, which q·0 with scale 1 gives too.
    """
    if scale > 0:
        return q, scale
    return (-q, -scale) if scale < 0 else (q * 0.0, 1.0)


def normalize_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | Tensor | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    check_bias: bool = True,
    table: CostTable | None = None,
) -> AttentionCall:
    """Validate every argument of `attention(...)` and return the normalized call.

    Empty sizes are valid (B, H, L, S or Dv = 0): see `AttentionCall.is_empty`. A head
    dim D = 0 makes every score 0 (each query averages the values it may see, as torch's
    SDPA gives). Inputs of any strides are accepted; backends get them with a contiguous
    last dim. `check_bias`: a float mask's values are checked (`normalize_mask`);
    `table`: the cost table the call is priced with (`AttentionCall.table`).
    """
    q, k, v = _check_tensors(q, k, v)
    dims = _check_shapes(q.shape, k.shape, v.shape, minimum=0)
    visibility, bias = normalize_mask(mask, dims, q.device, check_bias=check_bias)
    scale = None if scale is None else _check_number("scale", scale)
    if dims.D == 0:  # every score is 0, whatever the scale
        scale, dims = 1.0, Dims(dims.B, dims.H, dims.Hkv, dims.L, dims.S, 1, dims.Dv)
    scale = 1.0 / math.sqrt(dims.D) if scale is None else scale
    if softcap is not None and not _check_number("softcap", softcap) > 0:
        raise ValueError(f"softcap must be > 0 (s = c·tanh(s/c)), got {softcap}.")
    dropout_p = _check_number("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}.")
    q, k, v, scale = normalize_inputs(q, k, v, scale)
    return AttentionCall(q, k, v, visibility, bias, scale, softcap, dropout_p, dims, table=table)


def _one_zero_feature(t: Tensor) -> Tensor:
    """q or k of head dim 0 as head dim 1 holding zeros: the same scores (all 0), one
    feature for the kernels; joined to the caller's tensor, whose gradient stays (…, 0)."""
    return torch.cat([t, t.new_zeros(*t.shape[:-1], 1)], dim=-1) if t.shape[-1] == 0 else t


def normalize_inputs(
    q: Tensor, k: Tensor, v: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor, float]:
    """q, k, v as backends take them (`unit_last_stride`; head dim 0 as one zero feature)
    and a scale > 0 (`_fold_scale`); each tensor comes back as itself where it needs no
    change."""
    q, k = _one_zero_feature(q), _one_zero_feature(k)
    q, scale = _fold_scale(q, scale)
    return unit_last_stride(q), unit_last_stride(k), unit_last_stride(v), scale
