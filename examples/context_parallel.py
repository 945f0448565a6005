"""Train tiny_gpt's model with its sequence split across processes (context parallelism).

Each of `--world` processes (gloo on 127.0.0.1, one thread each) holds its rows of every
training sequence (`attnkit.distributed.shard`, zigzag layout); every
MultiHeadAttention attends over the whole sequence through
`attnkit.distributed.attention` and rotates by global positions. The script first trains
the same model in one process on the same batches, then checks that the losses of the
first steps agree.

    python examples/context_parallel.py                       # 2 processes, float64
    python examples/context_parallel.py --world 3 --dtype float32 --layout contiguous
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_gpt import TinyGPT, encode, python_docs

import attnkit as ak
import attnkit.distributed as akd

DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}


def batches(args: argparse.Namespace) -> tuple[list[tuple[Tensor, Tensor]], int]:
    """The training batches every run sees: (tokens, targets), each (batch, block)."""
    data, chars = encode(python_docs())
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.steps):
        starts = torch.randint(0, len(data) - args.block - 1, (args.batch,), generator=g)
        window = torch.stack([data[s : s + args.block + 1] for s in starts])
        out.append((window[:, :-1], window[:, 1:]))
    return out, len(chars)


def build(vocab: int, dtype: torch.dtype) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(vocab, dim=64, layers=2).to(dtype)
    for module in model.modules():  # dropout would draw different masks per process
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def train_one_process(args: argparse.Namespace, data: list, vocab: int) -> list[float]:
    model, optimizer = build(vocab, DTYPES[args.dtype])
    losses = []
    for x, y in data:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def worker(
    rank: int, args: argparse.Namespace, data: list, vocab: int, port: int, out: dict
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world
    )
    model, optimizer = build(vocab, DTYPES[args.dtype])
    context = akd.ContextParallel(layout=args.layout, strategy=args.strategy)
    akd.parallelize(model, context)
    losses = []
    start = time.perf_counter()
    for x, y in data:
        x_local, y_local = (akd.shard(t, args.layout, dim=1) for t in (x, y))
        logits = model(x_local)  # (batch, block / world, vocab): this rank's rows
        loss = F.cross_entropy(logits.flatten(0, 1), y_local.flatten(), reduction="sum") / y.numel()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():  # each rank's loss is its rows' share of the global one
            if p.grad is not None:
                dist.all_reduce(p.grad)
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    elapsed = time.perf_counter() - start
    if rank == 0:  # what each attention call did: q (batch, 4 heads, rows, 16), k/v 2 heads
        q = torch.zeros(args.batch, 4, args.block // args.world, 16, dtype=DTYPES[args.dtype])
        kv = q[:, :2]
        plan = akd.explain(q, kv, kv, ak.causal(), layout=args.layout, strategy=args.strategy)
        out.update(losses=losses, seconds=elapsed, plan=str(plan))
    dist.barrier()  # both ranks finish before either tears gloo down (else one may abort)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2, help="processes")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--block", type=int, default=128, help="sequence length")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layout", choices=akd.LAYOUTS, default="zigzag")
    parser.add_argument("--strategy", choices=(*akd.STRATEGIES, "auto"), default="auto")
    parser.add_argument("--dtype", choices=DTYPES, default="float64")
    args = parser.parse_args(argv)

    data, vocab = batches(args)
    start = time.perf_counter()
    single = train_one_process(args, data, vocab)
    single_s = time.perf_counter() - start
    print(
        f"tiny_gpt (2 layers, dim 64, GQA 4:2, RoPE), {args.steps} steps of {args.batch} × "
        f"{args.block} tokens, {args.dtype}: one process {single_s:.1f} s"
    )
    with mp.Manager() as manager:
        shared = manager.dict()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(args, data, vocab, port, shared), nprocs=args.world)
        result = dict(shared)
    print(
        f"{args.world} processes ({args.layout} layout, {args.strategy} strategy): "
        f"{result['seconds']:.1f} s"
    )
    print(result["plan"])
    print(f"{'step':>4}  {'one process':>14}  {'context parallel':>16}  {'difference':>10}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(single, result["losses"], strict=True), 1):
        worst = max(worst, abs(a - b))
        print(f"{step:>4}  {a:>14.10f}  {b:>16.10f}  {abs(a - b):>10.1e}")
    ok = worst <= TOLERANCE[args.dtype]
    verdict = "match" if ok else "DIFFER"
    print(
        f"losses {verdict}: largest difference {worst:.1e} (tolerance {TOLERANCE[args.dtype]:.0e})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
