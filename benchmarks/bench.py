"""Side-by-side attention benchmark: attnkit `auto` against its peers, in one run.

Peers: the seed's naive path (`attnkit.scaled_dot_product_attention`, which builds the
(B, H, L, S) scores), `F.scaled_dot_product_attention` (`is_causal` where it applies,
else a dense bool mask), FlexAttention compiled (compile time reported apart; forward
only on CPU) and `attnkit.attention(backend="auto")`.

For each pattern, S and pass it reports the median time of repeated runs, useful
GFLOP/s (only allowed query-key pairs count: 4·B·H·pairs·D forward, 2.5× that more
for the backward, flash-attention's convention), the share of the fp32 matrix-multiply
roofline measured in the same run, and the peak extra memory of one call measured in
a fresh subprocess. Results go to JSON, a markdown table and a PNG plot.

    python benchmarks/bench.py           # S in 1024 4096 16384 (under two hours on 2 cores)
    python benchmarks/bench.py --sizes 1024 --repeats 3 --no-memory   # a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.learn.benchmark import round_robin

H, D = 8, 64
PATTERNS = ("none", "causal", "sliding", "documents", "padding", "prefix", "tensor")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PEERS = ("naive", "sdpa", "flex", "auto")
PASSES = ("fwd", "fwd+bwd")
NAIVE_BUDGET = 6 * 2**30  # bytes of (B, H, L, S) float32 scores the naive path may build
# the naive backward runs at S <= this only: 4-6× SDPA's there in every pattern, it is
# never the best peer, and at S=4096 its rounds alone took a quarter of the bench's time
NAIVE_GRAD_MAX_S = 1024
RESULTS = Path(__file__).parent / "results"


@dataclass
class Case:
    pattern: str
    S: int
    B: int
    mask: ak.Mask | torch.Tensor | None
    pairs: int  # allowed query-key pairs per head, summed over the batch
    doc_ids: torch.Tensor
    lengths: torch.Tensor
    dtype: torch.dtype = torch.float32


def peer_recompile_limit() -> None:
    """Let the Flex peer compile once per pattern and size, as attnkit's flex backend does.

    torch.compile stops recompiling a function after 8 variants and silently runs an
    unfused FlexAttention that builds the full score matrix; one run of this benchmark
    compiles more variants than that.
    """
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = 256


def make_case(pattern: str, S: int, dtype: torch.dtype = torch.float32) -> Case:
    """The mask of each pattern, as attnkit sees it. `tensor`: the causal padding mask as
    the dense (B, 1, S, S) bool tensor a framework passes (transformers does)."""
    B = 4 if pattern in ("padding", "tensor") else 1
    g = torch.Generator().manual_seed(S)
    cuts = torch.sort(torch.randperm(S - 1, generator=g)[:7] + 1).values
    doc_ids = (torch.arange(S)[:, None] >= cuts[None, :]).sum(-1)  # 8 documents, uneven
    lengths = torch.tensor([S, S // 2, S // 4, S // 8])
    masks = {
        "none": None,
        "causal": ak.causal(),
        "sliding": ak.sliding_window(255),
        "documents": ak.document(doc_ids) & ak.causal(),
        "padding": ak.causal() & ak.key_padding(lengths),
        "prefix": ak.prefix_lm(S // 4),
    }
    padding = masks["padding"]
    assert padding is not None
    dense = padding.dense(B, 1, S, S) if pattern == "tensor" else None  # (B, 1, S, S) bool
    mask: ak.Mask | torch.Tensor | None = dense if dense is not None else masks[pattern]
    pairs = ak.explain(*(torch.empty(B, H, S, D),) * 3, mask).flops // (2 * 2 * D * H)
    return Case(pattern, S, B, mask, pairs, doc_ids, lengths, dtype)


def flex_mask_mod(case: Case) -> Callable[..., torch.Tensor] | None:
    """The same patterns written as a FlexAttention user would write them."""
    S = case.S
    if case.pattern == "none":
        return None
    if case.pattern == "causal":
        return lambda b, h, i, j: j <= i
    if case.pattern == "sliding":
        return lambda b, h, i, j: (j <= i) & (j >= i - 255)
    if case.pattern == "documents":
        ids = case.doc_ids
        return lambda b, h, i, j: (ids[i] == ids[j]) & (j <= i)
    if case.pattern in ("padding", "tensor"):
        lengths = case.lengths
        return lambda b, h, i, j: (j <= i) & (j < lengths[b])
    return lambda b, h, i, j: (j < S // 4) | (j <= i)


def inputs(case: Case, grad: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(case.B, H, case.S, D, generator=g).to(case.dtype).requires_grad_(grad)
        for _ in range(3)
    )


class Peers:
    """One callable per peer for a case, or a reason it does not run."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.compile_s: float | None = None
        self._flex: Callable[..., torch.Tensor] | None = None

    def dense_mask(self) -> torch.Tensor | None:
        c = self.case
        if c.mask is None or isinstance(c.mask, torch.Tensor):
            return c.mask
        return c.mask.dense(c.B, 1, c.S, c.S)

    def call(self, peer: str, grad: bool) -> Callable[..., torch.Tensor] | str:
        c = self.case
        if peer == "naive":
            need = 3 * c.B * H * c.S * c.S * 4
            if need > NAIVE_BUDGET:
                return f"skipped: would build {need / 2**30:.0f} GiB of scores"
            if grad and c.S > NAIVE_GRAD_MAX_S:
                return f"skipped: naive forward+backward runs at S <= {NAIVE_GRAD_MAX_S} only"
            dense = self.dense_mask()
            return lambda q, k, v: ak.scaled_dot_product_attention(q, k, v, dense)[0]
        if peer == "sdpa":
            if c.pattern == "causal":
                return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
            dense = self.dense_mask()
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        if peer == "flex":
            return self._flex_call(grad)
        if not grad and isinstance(
            c.mask, ak.Mask
        ):  # like the Flex peer, compile apart: warm attnkit's
            start = time.perf_counter()
            ak.attention(*inputs(c, grad=False), c.mask, backend="flex")
            self.compile_s = time.perf_counter() - start
        return lambda q, k, v: ak.attention(q, k, v, c.mask)

    def _flex_call(self, grad: bool) -> Callable[..., torch.Tensor] | str:
        if grad:
            return "no backward on CPU (PyTorch 2.13)"
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        c = self.case
        mask_mod = flex_mask_mod(c)
        block = None
        if mask_mod is not None:
            block = create_block_mask(
                mask_mod,
                c.B if c.pattern in ("padding", "tensor") else None,
                None,
                c.S,
                c.S,
                device="cpu",
            )
        if self._flex is None:
            compiled = torch.compile(flex_attention, dynamic=False)
            q, k, v = inputs(c, grad=False)
            start = time.perf_counter()
            compiled(q, k, v, block_mask=block)
            self.compile_s = time.perf_counter() - start
            self._flex = compiled
        compiled = self._flex
        return lambda q, k, v: compiled(q, k, v, block_mask=block)


def run_once(
    fn: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...], grad: bool
) -> None:
    out = fn(*tensors)
    if grad:
        out.backward(torch.ones_like(out))
        for t in tensors:
            t.grad = None


def time_peers(
    fns: dict[str, Callable[..., torch.Tensor]],
    case: Case,
    grad: bool,
    repeats: int,
    warmup: bool = True,
) -> dict[str, float]:
    """Median seconds of each peer on the same inputs, timed round-robin
    (`attnkit.learn.benchmark.round_robin`)."""
    tensors = inputs(case, grad)
    calls = {peer: (lambda fn=fn: run_once(fn, tensors, grad)) for peer, fn in fns.items()}
    return round_robin(calls, repeats, warmup=warmup)


LONG_ROUND = 20.0  # seconds: a round of the peers predicted longer is run twice, unwarmed
MEMORY_CALL_MAX = 25.0  # seconds: a call this long is not run again to probe its memory


class Budget:
    """Predicts a peer's call from its time at the last smaller S (same dtype, pattern and
    pass), scaled by S²: an upper bound for sparse patterns, exact for dense ones. Keeps
    `make bench` to about two hours on a CPU whose bfloat16 products are 100× slower than
    float32's, where SDPA's bfloat16 backward at S=16384 takes minutes a call."""

    def __init__(self, call_limit: float) -> None:
        self.call_limit = call_limit
        self.seen: dict[tuple[str, str, str, str], tuple[int, float]] = {}

    @staticmethod
    def _key(case: Case, pass_: str, peer: str) -> tuple[str, str, str, str]:
        return (str(case.dtype), case.pattern, pass_, peer)

    def record(self, case: Case, pass_: str, peer: str, seconds: float) -> None:
        self.seen[self._key(case, pass_, peer)] = (case.S, seconds)

    def predict(self, case: Case, pass_: str, peer: str) -> float | None:
        last = self.seen.get(self._key(case, pass_, peer))
        return None if last is None else last[1] * (case.S / last[0]) ** 2

    def refusal(self, case: Case, pass_: str, peer: str) -> str | None:
        """Why `peer` is not run at this cell, or None (auto always runs)."""
        guess = self.predict(case, pass_, peer)
        if peer == "auto" or guess is None or guess <= self.call_limit:
            return None
        S0 = self.seen[self._key(case, pass_, peer)][0]
        return (
            f"skipped: about {guess:.0f} s a call (S² from S={S0}), "
            f"over --call-budget {self.call_limit:.0f} s"
        )


def repeats_for(S: int, repeats: int) -> int:
    """More runs where calls are short (and noisier), fewer where one call takes seconds."""
    if S <= 1024:
        return 3 * repeats
    return max(3, repeats // 2) if S >= 16384 else repeats


def roofline_gflops(repeats: int, dtype: torch.dtype = torch.float32) -> float:
    """Measured matrix-multiply throughput in `dtype`: the best of repeated n³ products,
    n = 4096, or less where one product is slow (bfloat16 on a CPU without bf16 units
    runs orders of magnitude below float32)."""
    n = 512
    while True:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        start = time.perf_counter()
        a @ b
        if n >= 4096 or time.perf_counter() - start > 0.05:
            break
        n *= 2
    times = []
    for _ in range(2 * repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / min(times) / 1e9


def cpu_description() -> dict[str, object]:
    """The CPU's model and the units that set half precision's speed."""
    from attnkit._compat import cpu_features

    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"model": model, "features": cpu_features()}


DECODE_B = (1, 8, 32)
DECODE_S = (512, 2048, 8192)


def decode_table(repeats: int) -> list[dict[str, object]]:
    """One decoding step (L = 1, GQA 8:2, D = 64, float32) over a B × S grid: plain SDPA
    against attnkit with `causal(align="bottom_right")`, timed round-robin."""
    rows = []
    mask = ak.causal(align="bottom_right")
    for B in DECODE_B:
        for S in DECODE_S:
            g = torch.Generator().manual_seed(S)
            q = torch.randn(B, H, 1, D, generator=g)
            k, v = (torch.randn(B, 2, S, D, generator=g) for _ in range(2))
            fns = {
                "sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                    q, k, v, enable_gqa=True
                ),
                "auto": lambda q=q, k=k, v=v: ak.attention(q, k, v, mask),
            }
            medians = round_robin(fns, 20 * repeats)
            sdpa, auto = medians["sdpa"] * 1e6, medians["auto"] * 1e6
            rows.append({"B": B, "S": S, "sdpa_us": sdpa, "auto_us": auto, "ratio": sdpa / auto})
            print(
                f"decode B={B} S={S}: SDPA {sdpa:.0f} µs, attnkit {auto:.0f} µs "
                f"({sdpa / auto:.2f}×)",
                file=sys.stderr,
                flush=True,
            )
    return rows


def decode_markdown(rows: list[dict[str, object]]) -> str:
    lines = [
        "Decoding (L = 1, H = 8, Hkv = 2, D = 64, float32): median µs per call; ratio = "
        "SDPA time / attnkit time (1.0 = no overhead).",
        "",
        "| B | S | SDPA µs | attnkit µs | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['B']} | {r['S']} | {r['sdpa_us']:.0f} | {r['auto_us']:.0f} | {r['ratio']:.2f}× |"
        )
    return "\n".join(lines) + "\n"


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def memory_probe(pattern: str, S: int, peer: str, grad: bool) -> None:
    """Child process: peak extra resident memory of one call, printed as JSON."""
    case = make_case(pattern, S)
    peers = Peers(case)
    fn = peers.call(peer, grad)
    if isinstance(fn, str):
        print(json.dumps({"skipped": fn}))
        return
    small = make_case(pattern, 256)
    warm = Peers(small).call(peer, grad)
    if not isinstance(warm, str):  # thread pools and allocator warm-up, outside the probe
        run_once(warm, inputs(small, grad), grad)
    tensors = inputs(case, grad)
    gc.collect()
    before = _vm("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
    run_once(fn, tensors, grad)
    print(json.dumps({"peak_extra_bytes": max(0, _vm("VmHWM") - before)}))


def measure_memory(pattern: str, S: int, peer: str, grad: bool) -> int | None:
    cmd = [sys.executable, __file__, "--memory-probe", pattern, str(S), peer, str(int(grad))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return None
    return result.get("peak_extra_bytes")


def measure_cell(
    case: Case, pass_: str, args: argparse.Namespace, roof: float, progress: str
) -> list[dict[str, object]]:
    """One record per peer for a pattern, S and pass: times, useful GFLOP/s, memory."""
    grad = pass_ == "fwd+bwd"
    flops = 4 * H * case.pairs * D * (3.5 if grad else 1.0)
    dtype_name = str(case.dtype).removeprefix("torch.")
    label = f"{progress} {dtype_name} S={case.S} {case.pattern} {pass_}"
    print(f"{label}: compiling and warming up …", file=sys.stderr, flush=True)
    peers = Peers(case)
    fns, records = {}, {}
    budget: Budget = args.budget
    for peer in args.peers:
        peers.compile_s = None
        fn = budget.refusal(case, pass_, peer) or peers.call(peer, grad)
        records[peer] = {
            "S": case.S,
            "B": case.B,
            "H": H,
            "D": D,
            "pattern": case.pattern,
            "dtype": dtype_name,
            "pass": pass_,
            "peer": peer,
            "useful_gflop": flops / 1e9,
        }
        if isinstance(fn, str):
            records[peer]["skipped"] = fn
            continue
        fns[peer] = fn
        if peer in ("flex", "auto"):
            records[peer]["compile_s"] = peers.compile_s
    repeats, warmup = repeats_for(case.S, args.repeats), True
    if sum(budget.predict(case, pass_, peer) or 0.0 for peer in fns) > LONG_ROUND:
        repeats, warmup = 2, False
    print(
        f"{label}: timing {', '.join(fns)} round-robin, {repeats} runs"
        f"{'' if warmup else ' (no warm-up: long calls)'} …",
        file=sys.stderr,
        flush=True,
    )
    for peer, seconds in time_peers(fns, case, grad, repeats, warmup).items():
        budget.record(case, pass_, peer, seconds)
        gflops = flops / seconds / 1e9
        records[peer].update(
            ms=seconds * 1e3, gflops=gflops, roofline_pct=100 * gflops / roof, repeats=repeats
        )
    records["auto"]["backend"] = ak.explain(*inputs(case, grad), case.mask).backend
    for peer in [] if args.no_memory or case.dtype != torch.float32 else fns:  # float32 only
        if records[peer]["ms"] <= 1e3 * MEMORY_CALL_MAX:  # type: ignore[operator]
            records[peer]["peak_extra_bytes"] = measure_memory(case.pattern, case.S, peer, grad)
    summary = "  ".join(f"{p} {r['ms']:.1f} ms" for p, r in records.items() if "ms" in r)
    print(f"{label}: {summary}", file=sys.stderr, flush=True)
    return list(records.values())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per cell (median)")
    parser.add_argument(
        "--peers", nargs="+", default=list(PEERS), choices=PEERS, help="auto is always run"
    )
    parser.add_argument("--no-decode", action="store_true", help="skip the decode table")
    parser.add_argument(
        "--no-compiled", action="store_true", help="skip the compiled tiny_gpt training step"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    parser.add_argument(
        "--call-budget",
        type=float,
        default=60.0,
        help="seconds: skip a peer whose call, predicted from the smaller S, takes longer",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--memory-probe", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.peers = [p for p in PEERS if p in args.peers or p == "auto"]
    args.budget = Budget(args.call_budget)
    if args.memory_probe:
        pattern, S, peer, grad = args.memory_probe
        memory_probe(pattern, int(S), peer, bool(int(grad)))
        return
    torch.manual_seed(0)
    peer_recompile_limit()
    cpu = cpu_description()
    units = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["features"].items())  # type: ignore[attr-defined]
    print(f"CPU: {cpu['model']}; {units}", file=sys.stderr)
    measured = {name: roofline_gflops(args.repeats, DTYPES[name]) for name in args.dtypes}
    for name, value in measured.items():
        print(
            f"{name} matmul roofline: {value:.1f} GFLOP/s ({torch.get_num_threads()} threads)",
            file=sys.stderr,
        )
    # half inputs can always be multiplied as float32: a half row's roofline is the better
    fp32 = measured["float32"] if "float32" in measured else roofline_gflops(args.repeats)
    rooflines = {name: max(value, fp32) for name, value in measured.items()}
    cells = [
        (dt, S, p, ps)
        for dt in args.dtypes
        for S in args.sizes
        for p in args.patterns
        for ps in PASSES
    ]
    records = []
    for n, (dt, S, pattern, pass_) in enumerate(cells, 1):
        records += measure_cell(
            case=make_case(pattern, S, DTYPES[dt]),
            pass_=pass_,
            args=args,
            roof=rooflines[dt],
            progress=f"[{n}/{len(cells)}]",
        )
    decode = [] if args.no_decode else decode_table(args.repeats)
    from compiled import compiled_markdown, training_steps  # beside this file

    steps = [] if args.no_compiled else training_steps(args.repeats)
    meta = {
        "roofline_gflops": rooflines.get("float32", next(iter(rooflines.values()))),
        "rooflines": rooflines,
        "matmul_gflops": measured,
        "cpu": cpu,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "repeats": {S: repeats_for(S, args.repeats) for S in args.sizes},
        "long_round_s": LONG_ROUND,
        "call_budget_s": args.call_budget,
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(
        json.dumps(
            {"meta": meta, "records": records, "decode": decode, "training_step": steps},
            indent=1,
        )
    )
    from report import write_markdown, write_plot  # the table and plot live beside this file

    table = write_markdown(meta, records, args.out / "bench.md")
    write_plot(meta, records, args.out / "bench.png")
    print(table)
    if decode:
        (args.out / "bench_decode.md").write_text(decode_markdown(decode))
        print(decode_markdown(decode))
    if steps:
        (args.out / "bench_compiled.md").write_text(compiled_markdown(steps))
        print(compiled_markdown(steps))


if __name__ == "__main__":
    main()
