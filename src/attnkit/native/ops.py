"""The native ops as Python calls: every input checked here before it reaches C++.

`span_forward(q, k, v, row_intervals(lo, hi, B, L, S), scale, softcap, tiles)` is
`torch.ops.attnkit_native.span_forward` (span_attention.cpp): attention where row i of
batch row b sees keys `[lo[b, i], hi[b, i])` (checked once by `row_intervals`, kept by a
prepared call; `None` for every key), GQA by head groups, in tiles of `rows`
query rows (of every head of a K/V head) and blocks of `keys` keys (`blocking` picks
them), output in q's dtype and the log-sum-exp in float32 (0 and -inf on a row that sees
nothing); bfloat16 products on the CPU's half units (AVX512-BF16) where the caller
asks (`half=True`: the native backend asks where `precision.HalfKernels.on_half_units`
says), in float32 otherwise. The checks make the
C++ side's assumptions true (one dtype, CPU, unit last strides, spans within the keys,
sizes within its int32 GEMMs) or raise `ValueError` naming the argument; the fake
implementation gives shapes to `torch.compile` and `opcheck`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "DTYPES",
    "AlibiTerms",
    "RowIntervals",
    "alibi_terms",
    "blocking",
    "paged_decode",
    "records_grad",
    "register_fakes",
    "row_intervals",
    "span_forward",
    "stage_times",
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT32 = 2**31 - 1
# Blocking, measured on a 2-core AVX2 CPU (D = 64, fp32, per visible pair against dense
# SDPA; benchmarks/native.py): 128 query rows × 512 keys reach 0.95-1.0 dense and causal,
# within a few percent of the best of 16-256 rows × 256-512 keys on windows of 127 to
# 4096 keys; GQA stacks its G heads' rows, so an item's rows are capped at STACKED_ROWS
# (R from 16 to 128). A partly seen block runs in groups of GROUP_ROWS stacked rows, the
# kernel's register tile (micro.h's kMicroRows; the op `block_sizes` says it, a test compares).
# A block every row sees whole takes AMX's tiles (where asked) from TILE_ROWS stacked rows.
STACKED_ROWS = 256
KEY_BLOCK = 512
GROUP_ROWS = 6
TILE_ROWS = 16


def blocking(L: int, groups: int) -> tuple[int, int, int]:
    """(rows, keys, group rows): query rows of one tile, keys of one block, and query rows
    of one group of a partly seen block (at least 1: a group of GQA's stacked rows may
    hold part of a query row's heads), for L queries of `groups` heads per K/V head."""
    rows = min(max(L, 1), min(max(STACKED_ROWS // groups, 16), 128))
    return rows, KEY_BLOCK, min(rows, max(1, GROUP_ROWS // groups))


def _unit_last(x: Tensor) -> Tensor:
    """x as the span kernels read a (..., rows, n) tensor: unit last stride, and rows at
    least n apart (their GEMMs take the row stride as the leading dimension, which BLAS
    wants at least n). A size-1 dimension's stride is free in torch, so a transposed
    (..., n, 1) view has rows 1 apart though it is "contiguous": it is laid out anew."""
    if (x.stride(-1) == 1 or x.shape[-1] <= 1) and x.stride(-2) >= x.shape[-1]:
        return x
    return x.clone(memory_format=torch.contiguous_format)  # standard strides, size-1 dims too


def _check_kind(names: str, *tensors: Tensor) -> None:
    """One dtype the kernels take, on the CPU: what both ops ask of their tensors."""
    dtype = tensors[0].dtype
    if dtype not in DTYPES or any(t.dtype != dtype for t in tensors):
        dtypes = ", ".join(str(t.dtype) for t in tensors)
        raise ValueError(f"{names} must share one of {DTYPES} (got {dtypes}).")
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"the native kernels run on the CPU: move {names} there.")


def _check_scalars(scale: float, softcap: float) -> None:
    if not math.isfinite(scale) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"scale must be finite, softcap finite and >= 0 (got {scale}, {softcap}).")


def _check(q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (B, H, L, D), (B, Hkv, S, D), (B, Hkv, S, Dv).")
    _check_kind("q, k, v", q, k, v)
    _check_scalars(scale, softcap)
    B, H, L, D = q.shape
    ks, vs = k.shape, v.shape
    if ks[0] != B or vs[0] != B or ks[3] != D or ks[:3] != vs[:3]:
        raise ValueError(f"k, v {tuple(ks)}, {tuple(vs)} do not fit q {tuple(q.shape)}.")
    if ks[1] == 0 or H % ks[1]:
        raise ValueError(f"H={H} query heads must be a multiple of Hkv={ks[1]}.")
    big = max(*q.stride(), *k.stride(), *v.stride())
    if big > INT32 or L * H * D > INT32 or vs[3] > INT32:
        raise ValueError("a stride or size past 2**31 elements: the kernel's GEMMs are int32.")


@dataclass(frozen=True)
class RowIntervals:
    """Each query row's key interval, checked for the kernel: lo and hi (B, L) int64,
    contiguous, within [0, S] (`row_intervals` makes them; a prepared call keeps them)."""

    lo: Tensor
    hi: Tensor
    S: int


def row_intervals(lo: Tensor, hi: Tensor, B: int, L: int, S: int) -> RowIntervals:
    """(B|1, L) integer intervals [lo, hi) -> `RowIntervals`, clamped to [0, S]."""
    for name, t in (("lo", lo), ("hi", hi)):
        if t.dim() != 2 or t.shape[1] != L or t.shape[0] not in (1, B):
            raise ValueError(
                f"{name} must be (B, L) or (1, L) = ({B}, {L}) (got {tuple(t.shape)})."
            )
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.device.type != "cpu":
            raise ValueError(f"{name} must be an integer CPU tensor (got {t.dtype} on {t.device}).")
    lo, hi = (t.to(torch.long).clamp(0, S).expand(B, L).contiguous() for t in (lo, hi))
    return RowIntervals(lo, hi, S)


@dataclass(frozen=True)
class AlibiTerms:
    """ALiBi's terms per query row, checked for the kernel: slopes (B, L, H) float32 and
    aligned key positions (B, L) int64, contiguous (`alibi_terms` makes them)."""

    slopes: Tensor
    positions: Tensor


EXACT_DISTANCE = 2**24  # float32 holds every distance |position - j| below this exactly


def alibi_terms(slopes: Tensor, positions: Tensor, B: int, L: int, H: int, S: int) -> AlibiTerms:
    """(B, L, H) slopes and (B, L) positions -> `AlibiTerms`: the kernel adds
    `-slopes[b, i, h] · |positions[b, i] - j|` to row i's score of key j."""
    if slopes.shape != (B, L, H) or not slopes.dtype.is_floating_point:
        raise ValueError(f"ALiBi slopes must be float ({B}, {L}, {H}) (got {tuple(slopes.shape)}).")
    if positions.shape != (B, L) or positions.dtype.is_floating_point:
        raise ValueError(
            f"ALiBi positions must be integer ({B}, {L}) (got {tuple(positions.shape)})."
        )
    if slopes.device.type != "cpu" or positions.device.type != "cpu":
        raise ValueError("ALiBi's slopes and positions must be CPU tensors.")
    slopes = slopes.to(torch.float32).contiguous()
    if not bool(torch.isfinite(slopes).all()):
        raise ValueError("ALiBi slopes must be finite.")
    positions = positions.to(torch.long).contiguous()
    if positions.numel() and int(positions.abs().max()) + S >= EXACT_DISTANCE:
        raise ValueError(f"ALiBi positions and keys must lie within 2**24 (S={S}).")
    return AlibiTerms(slopes, positions)


def span_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    visible: RowIntervals | None,
    scale: float,
    softcap: float = 0.0,
    tiles: tuple[int, int] | None = None,
    bias: AlibiTerms | None = None,
    *,
    half: bool = False,
    amx: bool = False,
) -> tuple[Tensor, Tensor]:
    """out (B, H, L, Dv) in q's dtype and lse (B, H, L) float32 of the span call (the
    library must be loaded: `attnkit.native.library()`); row i of batch row b sees
    keys [visible.lo[b, i], visible.hi[b, i]), every key where `visible` is None; softcap
    0 = none; `tiles` (rows, keys) as `blocking` picks them unless given; `bias` ALiBi's
    terms (`alibi_terms`) or None; `half`: bfloat16 blocks multiplied on the half units (where
    built; float32 otherwise, and for other dtypes), as autograd's backward does too; `amx`
    (with `half`): blocks every row sees whole, for at least `TILE_ROWS` stacked rows, on
    AMX's tiles where the CPU has them (the forward only)."""
    _check(q, k, v, float(scale), float(softcap))
    B, H, L, _ = q.shape
    if visible is not None and (
        not isinstance(visible, RowIntervals)
        or visible.lo.shape != (B, L)
        or visible.S != k.shape[2]
    ):
        S = k.shape[2]
        raise ValueError(f"visible must be ops.row_intervals(lo, hi, B={B}, L={L}, S={S}) or None.")
    if bias is not None and (
        not isinstance(bias, AlibiTerms)
        or bias.slopes.shape != (B, L, H)
        or bias.positions.shape != (B, L)
    ):
        raise ValueError(
            f"bias must be ops.alibi_terms(slopes, positions, B={B}, L={L}, H={H}, S)."
        )
    rows, keys = tiles or blocking(L, H // k.shape[1])[:2]
    if not (0 < rows <= 4096 and 0 < keys <= 8192):
        raise ValueError(f"tiles must be 1..4096 rows and 1..8192 keys (got {rows}, {keys}).")
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    lo, hi = (None, None) if visible is None else (visible.lo, visible.hi)
    slopes, positions = (None, None) if bias is None else (bias.slopes, bias.positions)
    half = half and q.dtype == torch.bfloat16
    # a half call autograd records keeps its output in float32 for the backward's Δ = dO·O
    # (rounded to the dtype, dO·O would move dP − Δ; the backward would sum Σ P·dP instead)
    float_out = q.dtype != torch.float32 and records_grad(q, k, v)
    out, lse, _ = torch.ops.attnkit_native.span_forward(  # _: lse's rest, for autograd
        q,
        k,
        v,
        lo,
        hi,
        slopes,
        positions,
        float(scale),
        float(softcap),
        rows,
        keys,
        half,
        half and amx,
        float_out,
    )
    return (out.to(q.dtype) if float_out else out), lse


def stage_times(*, reset: bool = False) -> dict[str, int]:
    """Each stage's thread-nanoseconds in the span forward since the last reset, by name
    (`csrc/stages.h`: "call", "threads", "item", then the stages), where the kernels were
    built with stage timers (`ATTNKIT_NATIVE=stages`); else {}. `reset` zeroes them."""
    return dict(torch.ops.attnkit_native.stage_times(reset))


def records_grad(*tensors: Tensor) -> bool:
    """Whether autograd records a call on `tensors` (a half one then keeps its output in
    float32 for the backward)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _check_tables(
    blocks: Tensor, table_at: Tensor, lo: Tensor, hi: Tensor, block_size: int, num_blocks: int
) -> None:
    """Every block a sequence's positions [lo, hi) use lies within its table and the pool."""
    if bool(((lo < 0) | (hi < lo)).any()):
        raise ValueError("each sequence's positions must satisfy 0 <= lo <= hi.")
    used = hi > lo
    first = table_at + lo // block_size
    last = table_at + (hi - 1).clamp(min=0) // block_size
    if bool((used & ((table_at < 0) | (last >= blocks.numel()))).any()):
        raise ValueError("a sequence's positions run past its block table.")
    counts = torch.where(used, last - first + 1, 0)
    index = torch.repeat_interleave(first, counts)
    index += torch.arange(index.numel()) - torch.repeat_interleave(
        counts.cumsum(0) - counts, counts
    )
    ids = blocks[index]
    if bool(((ids < 0) | (ids >= num_blocks)).any()):
        raise ValueError("a block table names a block outside the pool (or a released one).")


def paged_decode(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    blocks: Tensor,
    table_at: Tensor,
    lo: Tensor,
    hi: Tensor,
    block_size: int,
    scale: float,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """One query token per sequence (N, H, D) against the keys at positions [lo, hi) of
    its block table in a layer's keys (slots, Hkv, D) and values (slots, Hkv, Dv) (a paged
    cache's pool side by side, or flash-attention's pages; slot = blocks[table_at + p //
    block_size] · block_size + p % block_size): out (N, H, Dv) in q's dtype and lse (N, H)
    float32 (`paged_decode.cpp`)."""
    if q.dim() != 3 or keys.dim() != 3 or values.dim() != 3:
        raise ValueError(
            "q must be (N, H, D), keys (slots, Hkv, D) and values (slots, Hkv, Dv) "
            f"(got {tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)})."
        )
    _check_kind("q, keys and values", q, keys, values)
    N, H, D = q.shape
    slots, Hkv = keys.shape[:2]
    if Hkv == 0 or H % Hkv or keys.shape[2] != D or values.shape[:2] != keys.shape[:2]:
        raise ValueError(
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)} do not fit q "
            f"{tuple(q.shape)}: H must be a multiple of Hkv, keys' last size D."
        )
    if block_size <= 0 or slots % block_size:
        raise ValueError(f"the {slots} slots are not whole blocks of {block_size}.")
    _check_scalars(scale, softcap)
    tables = []
    for name, t in (("blocks", blocks), ("table_at", table_at), ("lo", lo), ("hi", hi)):
        if (
            t.dim() != 1
            or t.dtype.is_floating_point
            or t.dtype == torch.bool
            or t.device.type != "cpu"
        ):
            raise ValueError(
                f"{name} must be a 1-D integer CPU tensor (got {tuple(t.shape)} {t.dtype})."
            )
        if name != "blocks" and t.shape[0] != N:
            raise ValueError(f"{name} must hold one entry per sequence ({N}), got {t.shape[0]}.")
        tables.append(t.to(torch.long).contiguous())
    blocks, table_at, lo, hi = tables
    _check_tables(blocks, table_at, lo, hi, block_size, slots // block_size)
    out: tuple[Tensor, Tensor] = torch.ops.attnkit_native.paged_decode(
        _unit_last(q),
        _unit_last(keys),
        _unit_last(values),
        blocks,
        table_at,
        lo,
        hi,
        block_size,
        float(scale),
        float(softcap),
    )
    return out


def _paged_decode_fake(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    blocks: Tensor,
    table_at: Tensor,
    lo: Tensor,
    hi: Tensor,
    block_size: int,
    scale: float,
    softcap: float,
) -> tuple[Tensor, Tensor]:
    N, H, _ = q.shape
    return q.new_empty(N, H, values.shape[2]), q.new_empty(N, H, dtype=torch.float32)


def _span_forward_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lo: Tensor | None,
    hi: Tensor | None,
    slopes: Tensor | None,
    positions: Tensor | None,
    scale: float,
    softcap: float,
    rows: int,
    keys: int,
    half: bool = False,
    amx: bool = False,
    float_out: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    B, H, L, _ = q.shape
    out = q.new_empty(B, H, L, v.shape[3], dtype=torch.float32 if float_out else q.dtype)
    lse = q.new_empty(B, H, L, dtype=torch.float32)
    return out, lse, torch.empty_like(lse)


def register_fakes() -> None:
    """The ops' shapes for tracing (once, after the library is loaded)."""
    torch.library.register_fake("attnkit_native::span_forward", _span_forward_fake)
    torch.library.register_fake("attnkit_native::paged_decode", _paged_decode_fake)
