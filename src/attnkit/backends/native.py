"""Backend `native`: attnkit's own C++ kernel (`attnkit.native`) for masks that are one
interval of keys per row.

Causal with any offset, windows, chunks, documents, padding, prefix-LM, their `&` and
`|` where they stay one interval, and bool tensors read as such (`Mask.key_spans`, exact)
become two (B, L) tensors `lo`, `hi`; the kernel walks each query tile's hull of
intervals in key blocks, full blocks with no mask work, and never reads a key outside it
(span_attention.cpp says how). A mask's one ALiBi (`& alibi(H)`) becomes each row's
slopes and aligned position, added in the kernel. Its cost is the pairs of those hulls
at its per-pair factor, plus a call. Its backward (span_backward.cpp: dq, dk, dv from the
output and log-sum-exp, deterministic, softcap's derivative included) serves a call
autograd records, the compiled op's backward and context-parallel pieces (ALiBi's slopes
taken as constants: slopes that require grad go to a composed backend). Where the
kernels are not built (no
compiler, a failed build, `ATTNKIT_NATIVE=off`) it refuses with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit._compat import cpu_features
from attnkit.backends.nativecost import FACTORS
from attnkit.backends.protocol import Backend, Block, Kernel, PagedDecode, Probe, Work
from attnkit.call import cost
from attnkit.call.precision import HALF, HalfKernels
from attnkit.call.steps import DECODE_ROWS, bucket, step_of
from attnkit.contracts import AttentionCall
from attnkit.masks import causal, sliding_window
from attnkit.masks.biases import alibi_rows
from attnkit.masks.spans import exact_spans
from attnkit.native.backward import span_backward
from attnkit.native.loader import Kernels
from attnkit.native.ops import (
    DTYPES,
    TILE_ROWS,
    AlibiTerms,
    RowIntervals,
    alibi_terms,
    blocking,
    records_grad,
    span_forward,
)
from attnkit.native.ops import paged_decode as paged_kernel

__all__ = ["NativeBackend"]

BIG = 2**62  # past any key index


@dataclass(frozen=True)
class Rows:
    """What the kernel reads of a call's mask: each row's key interval (`visible`; None:
    every key, a dense call) and the mask's ALiBi terms per row (None: no bias)."""

    visible: RowIntervals | None
    bias: AlibiTerms | None = None


@dataclass(frozen=True)
class Tiles:
    """The work of a call's blocking (`ops.blocking`): per batch row and tile of `rows`
    queries the hull of their intervals (start, width: (B, tiles)), what the cost model
    and `explain` read (a run needs only `Rows`)."""

    L: int
    rows: int
    keys: int
    group_rows: int
    starts: Tensor
    widths: Tensor
    pairs: int  # query-key pairs computed per head: every block's or group's rows by its keys
    pieces: int  # per K/V head: the whole blocks (a GEMM pair each) and the cut groups

    @property
    def hulls(self) -> tuple[tuple[int, int, int, int, int], ...]:
        """Each tile: (batch, first row, rows, hull start, hull width); width 0: no key."""
        B, tiles = self.widths.shape
        starts, widths = self.starts.tolist(), self.widths.tolist()
        return tuple(
            (b, t * self.rows, min(self.rows, self.L - t * self.rows), starts[b][t], widths[b][t])
            for b in range(B)
            for t in range(tiles)
        )


def _spans(call: AttentionCall) -> tuple[Tensor, Tensor] | None:
    """(B, L) int64 key intervals of the call's rows, or None where the mask has none."""
    d, mask = call.dims, call.mask
    if mask is None:
        zeros = torch.zeros(d.B, d.L, dtype=torch.long)
        return zeros, zeros + d.S
    spans = exact_spans(mask, d.B, d.L, d.S, "cpu")
    if spans is None:
        return None
    lo, hi = (t.to(torch.long).clamp(0, d.S).expand(d.B, d.L).contiguous() for t in spans)
    return lo, hi


def _alibi(call: AttentionCall) -> AlibiTerms | None:
    """The mask's one ALiBi as the kernel's per-row terms, or None (another bias)."""
    d = call.dims
    terms = alibi_rows(call.mask, d.B, d.H, d.L, d.S) if call.mask is not None else None
    return None if terms is None else alibi_terms(*terms, d.B, d.L, d.H, d.S)


def _hulls(lo: Tensor, hi: Tensor, R: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per batch row and group of R rows, the hull of the intervals of its rows that see
    a key: starts and widths (B, groups), 0 and 0 where none does; and each group's rows
    (groups,)."""
    B, L = lo.shape
    groups = -(-L // R)
    pad = (0, groups * R - L)
    seen = hi > lo  # (B, L)
    first = F.pad(torch.where(seen, lo, BIG), pad, value=BIG).view(B, groups, R).amin(2)
    last = F.pad(torch.where(seen, hi, 0), pad, value=0).view(B, groups, R).amax(2)
    width = (last - first).clamp(min=0)  # (B, groups)
    rows = (L - torch.arange(groups) * R).clamp(max=R)
    return torch.where(width > 0, first, 0), width, rows


def _dense_tiles(B: int, L: int, S: int, rows: int, keys: int, group_rows: int) -> Tiles:
    """`_tiles` of a call where every row sees every key, counted without a tensor
    reduction (a decoding step with a growing cache plans a new call every step)."""
    tiles, groups = -(-L // rows), -(-L // group_rows)
    starts = torch.zeros(B, tiles, dtype=torch.long)
    pieces = B * (tiles * -(-S // keys) + groups) if S else 0
    return Tiles(L, rows, keys, group_rows, starts, starts + S, B * L * S, pieces)


def _tiles(lo: Tensor, hi: Tensor, rows: int, keys: int, group_rows: int) -> Tiles:
    """The blocking's work: the pairs computed, and the pieces (each tile's blocks, plus
    one per group of `group_rows` rows for the cut blocks at its edges)."""
    starts, widths, _ = _hulls(lo, hi, rows)
    _, piece_widths, piece_counts = _hulls(lo, hi, group_rows)
    pairs = int((piece_widths * piece_counts).sum())
    pieces = int((-(-widths // keys)).sum() + (piece_widths > 0).sum())
    return Tiles(lo.shape[1], rows, keys, group_rows, starts, widths, pairs, pieces)


@dataclass(frozen=True)
class _DenseKernel:
    """The kernel over every key, whatever S: each row's interval is [0, S)."""

    scale: float
    softcap: float
    half: bool  # bfloat16 blocks on the half units (as planned)
    amx: bool  # whole blocks on AMX's tiles (as planned)

    @property
    def serves_any_length(self) -> bool:
        return True

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
        out, _ = span_forward(q, k, v, None, self.scale, self.softcap, half=self.half, amx=self.amx)
        return out


class NativeBackend(Backend):
    """attnkit's C++ kernels: one key interval per row, block-sparse, forward and backward."""

    name = "native"
    values_exact = True
    cost_factors = FACTORS  # nativecost.py: what they are and where they were measured

    def __init__(self, kernels: Kernels, half: HalfKernels) -> None:
        self.kernels = kernels  # the runtime's: loaded once, or being built
        self.half = half  # the runtime's: what half inputs compute in

    def half_units(self, call: AttentionCall) -> bool:
        """Whether the kernel multiplies this call's blocks on the CPU's bfloat16 units
        (ALiBi is the only bias the kernel takes, and it keeps the call in float32)."""
        return self.half.on_half_units(call.q, alibi=call.has_bias)

    def amx_tiles(self, call: AttentionCall) -> bool:
        """Whether the kernel is asked to multiply this call's whole blocks on AMX's tiles
        (`HalfKernels.asks_tiles`: the half mode `amx`, or `auto` on a CPU with AMX; the
        kernel checks the CPU has them)."""
        return self.half.on_amx_tiles(call.q, alibi=call.has_bias)

    @property
    def version(self) -> int:
        """1 once the kernels are loaded (a background build finishing re-plans calls)."""
        return self.kernels.version

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None:
        if (reason := self.kernels.unavailable()) is not None:
            return f"attnkit's native kernels are unavailable: {reason}"
        if call.q.device.type != "cpu":
            return f"the native kernels run on the CPU, not {call.q.device.type}"
        if call.q.dtype not in DTYPES:
            return f"the native kernels take float32, bfloat16 or float16 (got {call.q.dtype})"
        if call.bias_tensor is not None or call.dropout_p > 0:
            return "no additive bias tensor or dropout in the native kernel (ALiBi it adds)"
        if (rows := self._rows(call)) is None:
            if call.has_bias and _alibi(call) is None:
                return "the only bias the native kernel adds is one ALiBi (alibi(H) with `&`)"
            return "the mask is not one interval of keys per row (or differs between heads)"
        if call.requires_grad and rows.bias is not None and rows.bias.slopes.requires_grad:
            return "the native backward takes ALiBi's slopes as constants (these require grad)"
        return None

    def _rows(self, call: AttentionCall) -> Rows | None:
        """What the kernel reads of the call's mask, or None where it cannot serve it:
        made once per prepared call (a decoding step's: its intervals alone)."""

        def make() -> Rows | None:
            if call.is_dense:
                return Rows(None)
            intervals = _spans(call)
            bias = _alibi(call) if call.has_bias else None
            if intervals is None or (call.has_bias and bias is None):
                return None
            return Rows(RowIntervals(*intervals, call.dims.S), bias)  # `_spans` clamps them

        return call.plan_values.get("native.rows", make)

    def _tiles(self, call: AttentionCall) -> Tiles:
        """The work of the call's blocking (a call it can serve): made once per prepared
        call, for the cost model and `explain`."""

        def make() -> Tiles:
            d, rows = call.dims, self._rows(call)
            assert rows is not None
            if rows.visible is None:
                return _dense_tiles(d.B, d.L, d.S, *blocking(d.L, d.groups))
            return _tiles(rows.visible.lo, rows.visible.hi, *blocking(d.L, d.groups))

        return call.plan_values.get("native.tiles", make)

    def cost(self, call: AttentionCall, *, need_lse: bool) -> float:
        tiles, factors, d = self._tiles(call), self.factors(call.table), call.dims
        if d.L <= DECODE_ROWS:
            keys = factors["kv"] * d.Hkv + factors["head"] * d.H
            return keys * tiles.pairs + factors["step"]
        work = factors["pair"] * d.H * tiles.pairs + factors["piece"] * d.Hkv * tiles.pieces
        return work * self._dtype_factor(call) + factors["call"]

    def _dtype_factor(self, call: AttentionCall) -> float:
        """The kernel's work for the call's dtype over float32's: `bf16` on the half units."""
        return self.factors(call.table)["bf16"] if self.half_units(call) else 1.0

    def cost_floor(self, call: AttentionCall) -> float:
        return self.factors(call.table)["step" if call.dims.L <= DECODE_ROWS else "call"]

    def takes_step(self, call: AttentionCall) -> bool:
        """The decoding steps the kernel wins, by its CPU kind's decoding grid
        (`python benchmarks/native.py`): those whose B·G query heads sharing each key read
        times the key length's bucket reach the kind's threshold for the step's dtype, heads
        and padding (the `step_keys*` factors). On AVX2 and AVX512-BF16 every half step
        (SDPA converts the cache to float32, or computes bfloat16 slowly: 2-14× the
        kernel's time); float32 GQA steps from 8,192 on every kind (B = 4 from 512 keys,
        B = 1 from 1,025: 1.0-2.5× SDPA, where below SDPA takes 0.5-0.8× the kernel's
        time); float32 MHA and AMX's half steps only where they are large. A half step
        SDPA would compute in float32 (the runtime's half mode) runs on the kernel always."""
        q, d, kind = call.q, call.dims, step_of(call)
        if call.requires_grad or q.device.type != "cpu" or kind is None:
            return False
        if q.dtype not in DTYPES or self.kernels.unavailable() is not None:
            return False
        if q.dtype in HALF and self.half.kernel_dtype(q.dtype, q.device) not in HALF:
            return True  # SDPA converts the whole cache to float32 every step
        if q.dtype in HALF:
            threshold = "step_keys_half_padded" if kind == "padded" else "step_keys_half"
        else:
            threshold = "step_keys" if d.groups > 1 else "step_keys_mha"
        return d.B * d.groups * bucket(d.S) >= self.factors(call.table)[threshold]

    def beats_dense(self, call: AttentionCall) -> bool:
        """A call whose pairs the kernel prices below SDPA's (its per-pair factor, times
        `bf16` on the half units, below 1: AVX512-BF16), and every call autograd records
        (the kernel's backward may win where its forward loses: bfloat16 on AMX's tiles),
        is priced like any other; decoding steps are the ones `takes_step` takes."""
        if call.dims.L <= DECODE_ROWS or self.kernels.unavailable() is not None:
            return False
        per_pair = self.factors(call.table)["pair"] * self._dtype_factor(call)
        return call.requires_grad or per_pair < 1.0

    def prepare(self, call: AttentionCall, *, need_lse: bool) -> Kernel | None:
        """A dense call's kernel, which serves any key length (a growing cache's steps)."""
        if need_lse or not call.is_dense or call.has_bias or self._rows(call) is None:
            return None
        half, amx = self.half_units(call), self.amx_tiles(call)
        return _DenseKernel(call.scale, call.softcap or 0.0, half, amx)

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int:
        """Output (and the float32 one a half call autograd records keeps), log-sum-exp
        and the spans, plus each thread's scratch (float32)."""
        d = call.dims
        rows, keys, _ = blocking(d.L, d.groups)
        stacked = d.groups * rows
        scratch = stacked * (d.D + keys + d.Dv + 2) + keys * (d.D + d.Dv)
        kept = 4 if call.q.dtype in HALF and records_grad(call.q, call.k, call.v) else 0
        out = d.B * d.H * d.L * d.Dv * (call.q.element_size() + kept) + 4 * d.B * d.H * d.L
        return out + 16 * d.B * d.L + 4 * scratch * torch.get_num_threads()

    def run(self, call: AttentionCall, *, need_lse: bool) -> tuple[Tensor, Tensor | None]:
        rows, d = self._rows(call), call.dims
        assert rows is not None
        out, lse = span_forward(
            call.q,
            call.k,
            call.v,
            rows.visible,  # None: every key, no spans to read
            call.scale,
            call.softcap or 0.0,
            blocking(d.L, d.groups)[:2],
            rows.bias,
            half=self.half_units(call),
            amx=self.amx_tiles(call),
        )
        return out, lse if need_lse else None

    def paged_decode(self, step: PagedDecode) -> tuple[Tensor, Tensor] | None:
        """The paged kernel (`paged_decode.cpp`) where it is built, on the CPU, for q,
        keys and values of one dtype it takes."""
        dtypes = {step.q.dtype, step.keys.dtype, step.values.dtype}
        if self.kernels.unavailable() is not None or step.q.device.type != "cpu":
            return None
        if len(dtypes) != 1 or step.q.dtype not in DTYPES:
            return None
        return paged_kernel(
            step.q,
            step.keys,
            step.values,
            step.table.cpu(),
            step.starts.cpu(),
            step.lo.cpu(),
            step.hi.cpu(),
            step.page_size,
            step.scale,
            step.softcap,
        )

    def serves_backward(self, call: AttentionCall) -> bool:
        return self.can_use(call, need_lse=True) is None

    def backward(
        self, call: AttentionCall, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """dq, dk, dv from the rows' output and log-sum-exp, whichever backend computed them
        (a context-parallel piece's: the global ones): span_backward.cpp, deterministic."""
        rows = self._rows(call)
        assert rows is not None
        q, k, v = (t.detach() for t in (call.q, call.k, call.v))
        dtype = q.dtype
        return span_backward(
            q,
            k,
            v,
            out.detach().to(dtype),
            dout.to(dtype),
            lse.detach().float(),
            rows.visible,
            call.scale,
            None if dlse is None else dlse.float(),
            call.softcap or 0.0,
            rows.bias,
            half=self.half_units(call),
            amx=self.amx_tiles(call),
        )

    def notes(self, call: AttentionCall) -> list[str]:
        tiles, d = self._tiles(call), call.dims
        share = tiles.pairs / max(d.L * d.S, 1) / d.B
        notes = [
            f"native: tiles of {tiles.rows} query rows × {d.groups} head(s), key blocks of"
            f" {tiles.keys}, cut blocks in groups of {tiles.group_rows} rows;"
            f" {share:.1%} of the L×S pairs computed"
        ]
        return notes + ([f"native: {self._half_note(call)}"] if call.q.dtype in HALF else [])

    def _half_note(self, call: AttentionCall) -> str:
        """What the kernel multiplies a half call's blocks in."""
        if not self.half_units(call):
            return "half blocks converted to float32 (the runtime's half kernels, or a bias)"
        if not self.amx_tiles(call):
            return "bfloat16 products on the half units where the build has them"
        tiles = "" if cpu_features()["AMX"] else " (asked for; this CPU has none)"
        return (
            f"bfloat16 on the half units; blocks every row sees whole, of {TILE_ROWS} stacked"
            f" rows or more, on AMX's tiles{tiles}"
        )

    def work(self, call: AttentionCall) -> Work | None:
        if self._rows(call) is None:
            return None
        tiles = self._tiles(call)
        blocks = tuple(Block(b, r0, rows, k0, w) for b, r0, rows, k0, w in tiles.hulls if w)
        return Work(blocks, 1, tiles.rows)

    def calibrate(self, probe: Probe) -> dict[str, float]:
        """`call` from a tiny causal call; `pair` and `piece` scaled together by a causal
        256-key window on 4096 rows (net of the call); `bf16` from the same window in
        bfloat16 where it runs on the half units; nothing where the kernels are not built
        (the backend then serves no call: its built-in factors stand)."""
        if self.kernels.unavailable() is not None:
            return {}
        measured = {"call": probe.attention(probe.inputs(16), causal(), self.name, runs=20)}
        window, inputs = sliding_window(255) & causal(), probe.inputs(4096)
        _, predicted, spent = self.timed(probe, inputs, window)
        default = self.cost_factors.default
        predicted -= default["call"]
        spent -= measured["call"]
        for name in ("pair", "piece"):
            measured[name] = cost.rescaled(default[name], predicted, spent)
        q, k, v = inputs
        half = (q.bfloat16(), k.bfloat16(), v.bfloat16())
        if spent > 0 and self.half.on_half_units(half[0], alibi=False):
            in_half = probe.attention(half, window, self.name) - measured["call"]
            measured |= {"bf16": in_half / spent} if in_half > 0 else {}
        return measured
