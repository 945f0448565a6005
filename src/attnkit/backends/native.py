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

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import cost
from attnkit.backends.protocol import Backend, Block, Kernel, Probe, Work
from attnkit.contracts import AttentionCall
from attnkit.masks import causal, sliding_window
from attnkit.masks.biases import alibi_rows
from attnkit.masks.spans import exact_spans
from attnkit.native import unavailable
from attnkit.native.backward import span_backward
from attnkit.native.loader import version as kernels_version
from attnkit.native.ops import DTYPES, ALiBi, Spans, alibi, blocking, span_forward, spans
from attnkit.precision import HALF

__all__ = ["NativeBackend"]

BIG = 2**62  # past any key index
DECODE_ROWS = 16  # a call of at most this many queries is priced as a decoding step
SHARED_READS = 16  # a float32 decoding step's B·G from which the kernel takes it unpriced


@dataclass(frozen=True)
class Tiles:
    """A call's spans (B, L), its blocking (`ops.blocking`), and per batch row and tile of
    `rows` queries the hull of their intervals (start, width: (B, tiles))."""

    visible: Spans
    rows: int
    keys: int
    group_rows: int
    starts: Tensor
    widths: Tensor
    pairs: int  # query-key pairs computed per head: every block's or group's rows by its keys
    pieces: int  # per K/V head: the whole blocks (a GEMM pair each) and the cut groups
    bias: ALiBi | None = None  # the mask's ALiBi, per row

    @property
    def hulls(self) -> tuple[tuple[int, int, int, int, int], ...]:
        """Each tile: (batch, first row, rows, hull start, hull width); width 0: no key."""
        B, tiles = self.widths.shape
        L = self.visible.lo.shape[1]
        starts, widths = self.starts.tolist(), self.widths.tolist()
        return tuple(
            (b, t * self.rows, min(self.rows, L - t * self.rows), starts[b][t], widths[b][t])
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
    return tuple(t.to(torch.long).clamp(0, d.S).expand(d.B, d.L).contiguous() for t in spans)  # type: ignore[return-value]


def _alibi(call: AttentionCall) -> ALiBi | None:
    """The mask's one ALiBi as the kernel's per-row terms, or None (another bias)."""
    d = call.dims
    terms = alibi_rows(call.mask, d.B, d.H, d.L, d.S) if call.mask is not None else None
    return None if terms is None else alibi(*terms, d.B, d.L, d.H, d.S)


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
    zeros = torch.zeros(1, L, dtype=torch.long)
    tiles, groups = -(-L // rows), -(-L // group_rows)
    starts = torch.zeros(B, tiles, dtype=torch.long)
    pieces = B * (tiles * -(-S // keys) + groups) if S else 0
    visible = spans(zeros, zeros + S, B, L, S)
    return Tiles(visible, rows, keys, group_rows, starts, starts + S, B * L * S, pieces)


def _tiles(lo: Tensor, hi: Tensor, S: int, rows: int, keys: int, group_rows: int) -> Tiles:
    """The blocking's work: the pairs computed, and the pieces (each tile's blocks, plus
    one per group of `group_rows` rows for the cut blocks at its edges)."""
    starts, widths, _ = _hulls(lo, hi, rows)
    _, piece_widths, piece_counts = _hulls(lo, hi, group_rows)
    pairs = int((piece_widths * piece_counts).sum())
    pieces = int((-(-widths // keys)).sum() + (piece_widths > 0).sum())
    B, L = lo.shape
    return Tiles(spans(lo, hi, B, L, S), rows, keys, group_rows, starts, widths, pairs, pieces)


@dataclass(frozen=True)
class _DenseKernel:
    """The kernel over every key, whatever S: each row's interval is [0, S)."""

    scale: float
    softcap: float

    @property
    def serves_any_length(self) -> bool:
        return True

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
        return span_forward(q, k, v, None, self.scale, self.softcap)[0]


class NativeBackend(Backend):
    """attnkit's C++ kernels: one key interval per row, block-sparse, forward and backward."""

    name = "native"
    values_exact = True
    # against dense SDPA's per pair: `pair` per pair computed (every block's or group's
    # rows by its keys, masked corners included), `piece` per whole block or cut group,
    # `call` per call (the spans' checks, the threads' start, the op's dispatch). Fitted
    # on a 2-core AVX2 CPU by `python benchmarks/native_fit.py` (windows, causal, chunks,
    # prefix-LM and no mask at L = 256..4096, all within ±10%); `attnkit calibrate` times
    # them on this machine
    cost_factors = cost.Factors(
        {"pair": 1.05, "piece": 300.0, "call": 68_000.0, "kv": 0.36, "head": 0.57,
         "step": 5_000.0, "backward": 3.6, "backward_half": 4.5}
    )  # fmt: skip
    # A decoding call (at most DECODE_ROWS queries) reads keys, not multiplies: `kv` per
    # key of each K/V head (read once for its G query heads), `head` per key of each query
    # head, `step` per call, in units of SDPA's decoding pair (its cost counts B·H·L·S);
    # fitted by hand on the same CPU to float32 steps of B = 1..32, S = 512..8192, GQA
    # (`python benchmarks/native.py`'s decoding grid) and MHA alike (SDPA then is the
    # faster at B·H·S <= 4,096, native from about 16,384 keys up with GQA, 131,072 without).
    # `backward`, `backward_half`: forward+backward over forward (`training_factor`), the
    # medians over every pattern at S = 1024 and 4096 on a 2-core AVX512-BF16 CPU (float32
    # 2.2-4.8, half 2.4-6.2: half inputs convert in the backward's every block)

    @property
    def version(self) -> int:
        """1 once the kernels are loaded (a background build finishing re-plans calls)."""
        return kernels_version()

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None:
        if (reason := unavailable()) is not None:
            return f"attnkit's native kernels are unavailable: {reason}"
        if call.q.device.type != "cpu":
            return f"the native kernels run on the CPU, not {call.q.device.type}"
        if call.q.dtype not in DTYPES:
            return f"the native kernels take float32, bfloat16 or float16 (got {call.q.dtype})"
        if call.bias_tensor is not None or call.dropout_p > 0:
            return "no additive bias tensor or dropout in the native kernel (ALiBi it adds)"
        if (tiles := self._tiles(call)) is None:
            if call.has_bias and _alibi(call) is None:
                return "the only bias the native kernel adds is one ALiBi (alibi(H) with `&`)"
            return "the mask is not one interval of keys per row (or differs between heads)"
        if call.requires_grad and tiles.bias is not None and tiles.bias.slopes.requires_grad:
            return "the native backward takes ALiBi's slopes as constants (these require grad)"
        return None

    def _tiles(self, call: AttentionCall) -> Tiles | None:
        """The call's spans and tiles: made once per prepared call."""

        def make() -> Tiles | None:
            d = call.dims
            if call.is_dense:
                return _dense_tiles(d.B, d.L, d.S, *blocking(d.L, d.groups))
            intervals = _spans(call)
            bias = _alibi(call) if call.has_bias else None
            if intervals is None or (call.has_bias and bias is None):
                return None
            tiles = _tiles(*intervals, call.dims.S, *blocking(call.dims.L, call.dims.groups))
            return dataclasses.replace(tiles, bias=bias)

        return call.derived.get("native.tiles", make)

    def cost(self, call: AttentionCall, *, need_lse: bool) -> float:
        tiles, factors, d = self._tiles(call), self.factors(), call.dims
        assert tiles is not None
        if d.L <= DECODE_ROWS:
            keys = factors["kv"] * d.Hkv + factors["head"] * d.H
            return keys * tiles.pairs + factors["step"]
        work = factors["pair"] * d.H * tiles.pairs + factors["piece"] * d.Hkv * tiles.pieces
        return work + factors["call"]

    def cost_floor(self, call: AttentionCall) -> float:
        return self.factors()["step" if call.dims.L <= DECODE_ROWS else "call"]

    def takes_dense(self, call: AttentionCall) -> bool:
        """A decoding step the kernel wins at every key length measured (`python
        benchmarks/native.py`'s decoding grid): half inputs (SDPA's step takes 2-14× the
        kernel's time on AVX2, converting the whole cache to float32 each step, and
        1.9-8.5× on AVX512-BF16, where it computes bfloat16 as it is), and float32 GQA
        steps whose B·G query heads share each key read (G = H / Hkv > 1) at least
        SHARED_READS times (8:2 from B = 4 up: 1.2-1.9× SDPA; a single sequence's step
        stays with SDPA, 0.7× at S = 512; MHA too, where the two run about even)."""
        q, d = call.q, call.dims
        if d.L > DECODE_ROWS or call.requires_grad or q.device.type != "cpu":
            return False
        if q.dtype not in DTYPES or unavailable() is not None:
            return False
        shared = d.groups > 1 and d.B * d.groups >= SHARED_READS
        return q.dtype in HALF or (q.dtype == torch.float32 and shared)

    def prepare(self, call: AttentionCall, *, need_lse: bool) -> Kernel | None:
        """A dense call's kernel, which serves any key length (a growing cache's steps)."""
        if need_lse or not call.is_dense or call.has_bias or self._tiles(call) is None:
            return None
        return _DenseKernel(call.scale, call.softcap or 0.0)

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int:
        """Output, log-sum-exp and the spans, plus each thread's scratch (float32)."""
        d = call.dims
        rows, keys, _ = blocking(d.L, d.groups)
        stacked = d.groups * rows
        scratch = stacked * (d.D + keys + d.Dv + 2) + keys * (d.D + d.Dv)
        out = d.B * d.H * d.L * d.Dv * call.q.element_size() + 4 * d.B * d.H * d.L
        return out + 16 * d.B * d.L + 4 * scratch * torch.get_num_threads()

    def run(self, call: AttentionCall, *, need_lse: bool) -> tuple[Tensor, Tensor | None]:
        tiles = self._tiles(call)
        assert tiles is not None
        out, lse = span_forward(
            call.q,
            call.k,
            call.v,
            None if call.is_dense else tiles.visible,  # None: every key, no spans to read
            call.scale,
            call.softcap or 0.0,
            (tiles.rows, tiles.keys),
            tiles.bias,
        )
        return out, lse if need_lse else None

    def serves_backward(self, call: AttentionCall) -> bool:
        return self.can_use(call, need_lse=True) is None

    def backward(
        self, call: AttentionCall, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """dq, dk, dv from the rows' output and log-sum-exp, whichever backend computed them
        (a context-parallel piece's: the global ones): span_backward.cpp, deterministic."""
        tiles = self._tiles(call)
        assert tiles is not None
        q, k, v = (t.detach() for t in (call.q, call.k, call.v))
        dtype = q.dtype
        return span_backward(
            q, k, v, out.detach().to(dtype), dout.to(dtype), lse.detach().float(),
            None if call.is_dense else tiles.visible, call.scale,
            None if dlse is None else dlse.float(), call.softcap or 0.0, tiles.bias,
        )  # fmt: skip

    def notes(self, call: AttentionCall) -> list[str]:
        tiles, d = self._tiles(call), call.dims
        assert tiles is not None
        share = tiles.pairs / max(d.L * d.S, 1) / d.B
        return [
            f"native: tiles of {tiles.rows} query rows × {d.groups} head(s), key blocks of"
            f" {tiles.keys}, cut blocks in groups of {tiles.group_rows} rows;"
            f" {share:.1%} of the L×S pairs computed"
        ]

    def work(self, call: AttentionCall) -> Work | None:
        tiles = self._tiles(call)
        if tiles is None:
            return None
        blocks = tuple(Block(b, r0, rows, k0, w) for b, r0, rows, k0, w in tiles.hulls if w)
        return Work(blocks, 1, tiles.rows)

    def calibrate(self, probe: Probe) -> dict[str, float]:
        """`call` from a tiny causal call; `pair` and `piece` scaled together by a causal
        256-key window on 4096 rows (net of the call); nothing where the kernels are not
        built (the backend then serves no call: its built-in factors stand)."""
        if unavailable() is not None:
            return {}
        measured = {"call": probe.attention(probe.inputs(16), causal(), self.name, runs=20)}
        window = sliding_window(255) & causal()
        _, predicted, spent = self.timed(probe, probe.inputs(4096), window)
        default = self.cost_factors.default
        predicted -= default["call"]
        spent -= measured["call"]
        for name in ("pair", "piece"):
            measured[name] = cost.rescaled(default[name], predicted, spent)
        return measured
