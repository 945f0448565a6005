"""The `attnkit` command: a tour of the mechanism, mask pictures, plans, a benchmark, and
the cost model measured on this CPU."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

import torch

import attnkit as ak
from attnkit.console import prepare, quiet_on_closed_pipe

KINDS = ["causal", "sliding", "chunked", "prefix", "documents", "padding"]


def _mask_from_args(args: argparse.Namespace) -> ak.Mask:
    align, offset = args.align, args.offset
    kinds = {
        "causal": lambda: ak.causal(align, offset=offset),
        "sliding": lambda: ak.sliding_window(args.window, args.right, align, offset=offset),
        "chunked": lambda: (
            ak.chunked(args.chunk, align, offset=offset) & ak.causal(align, offset=offset)
        ),
        "prefix": lambda: ak.prefix_lm(args.prefix, align, offset=offset),
        "documents": lambda: (
            ak.document(torch.arange(args.S) * args.documents // args.S)
            & ak.causal(align, offset=offset)
        ),
        "padding": lambda: ak.key_padding(torch.tensor([args.length])),
    }
    return kinds[args.kind]()


def _cmd_tour(args: argparse.Namespace) -> int:
    from attnkit.tour import run_tour

    return 1 if run_tour() else 0


def _cmd_mask(args: argparse.Namespace) -> int:
    args.S = args.L if args.S is None else args.S
    mask = _mask_from_args(args)
    drawing = mask.draw(args.L, args.S)  # before any output: an error comes alone
    print(f"{mask}   L={args.L}, S={args.S}   ■ may attend  · hidden\n{drawing}")
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    args.S = args.L if args.S is None else args.S
    q = torch.empty(args.batch, args.heads, args.L, args.dim)
    kv = torch.empty(args.batch, args.kv_heads or args.heads, args.S, args.dim)
    print(ak.explain(q, kv, kv, _mask_from_args(args), need_lse=args.lse))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from attnkit.benchmark import run_bench, table

    dtype = getattr(torch, args.dtype)
    rows = run_bench(
        args.S, heads=args.heads, dim=args.dim, dtype=dtype, patterns=tuple(args.patterns),
        backward=args.backward, runs=args.runs,
    )  # fmt: skip
    print(table(rows, args.S, dtype))
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    return ak.calibrate.main()


def in_cli_terms(message: str) -> str:
    """A library message with its Python fixes spelled as this command's options.

    `causal(align='top_left')` becomes `--align top_left`, `causal(offset=n)` becomes
    `--offset N` and `window=-1` becomes `--window -1`.
    """
    message = re.sub(r"\w+\(align='(\w+)'\)", r"--align \1", message)
    message = re.sub(r"\w+\(offset=n\)", "--offset N", message)
    message = re.sub(r"\balign='(\w+)'", r"--align \1", message)
    return re.sub(r"\b(offset|window|right|chunk|prefix|length)=", r"--\1 ", message)


def _count(minimum: int) -> type[int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    parse.__name__ = "int"  # argparse names the type in its errors
    return parse  # type: ignore[return-value]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnkit", description=__doc__)
    parser.add_argument(
        "--version",
        action="version",
        version=f"attnkit {ak.__version__} (torch {torch.__version__})",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("tour", help="walk the attention mechanism step by step, with live checks")
    for name, helptext in (("mask", "draw a mask"), ("explain", "show the plan for a call")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("kind", choices=KINDS)
        p.add_argument("-L", type=_count(1), default=8 if name == "mask" else 4096, help="queries")
        p.add_argument("-S", type=_count(1), default=None, help="keys (default: L)")
        p.add_argument("--align", choices=["top_left", "bottom_right"], default=None)
        p.add_argument("--offset", type=int, default=None, help="key j visible iff j <= i + N")
        p.add_argument(
            "--window", type=_count(0), default=2, help="sliding: keys left of the diagonal"
        )
        p.add_argument("--right", type=_count(0), default=0, help="sliding: keys right of it")
        p.add_argument("--chunk", type=_count(1), default=3, help="chunked: positions per chunk")
        p.add_argument("--prefix", type=_count(0), default=3, help="prefix: prefix length")
        p.add_argument("--documents", type=_count(1), default=2, help="documents: how many")
        p.add_argument("--length", type=_count(0), default=5, help="padding: real keys")
        if name == "explain":
            p.add_argument("--batch", type=_count(1), default=1)
            p.add_argument("--heads", type=_count(1), default=8)
            p.add_argument("--kv-heads", type=_count(1), default=None)
            p.add_argument("--dim", type=_count(1), default=64)
            p.add_argument("--lse", action="store_true", help="also return the log-sum-exp")
    p = sub.add_parser("bench", help="time attention() against PyTorch's SDPA on this machine")
    p.add_argument("-S", type=_count(1), default=2048, help="queries = keys (default: 2048)")
    p.add_argument("--heads", type=_count(1), default=8)
    p.add_argument("--dim", type=_count(1), default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--patterns", nargs="+", choices=["causal", "sliding", "documents", "padding"],
                   default=["causal", "sliding", "documents", "padding"])  # fmt: skip
    p.add_argument("--backward", action="store_true", help="also time forward+backward")
    p.add_argument("--runs", type=_count(1), default=5, help="timed rounds (median)")
    sub.add_parser(
        "calibrate",
        help="measure auto's cost model on this CPU (seconds; on a quiet machine) and keep it",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    prepare(sys.stdout)
    prepare(sys.stderr)
    args = _parser().parse_args(argv)
    commands = {
        "tour": _cmd_tour, "mask": _cmd_mask, "explain": _cmd_explain, "bench": _cmd_bench,
        "calibrate": _cmd_calibrate,
    }  # fmt: skip
    try:
        return quiet_on_closed_pipe(lambda: commands[args.command](args))
    except (ak.ShapeContractError, ak.MaskError) as err:
        print(f"attnkit {args.command}: {in_cli_terms(str(err))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
