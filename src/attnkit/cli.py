"""The `attnkit` command: a tour of the mechanism, mask pictures, plans, a benchmark, and
the cost model measured on this CPU."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence

import torch

import attnkit as ak
from attnkit.learn.console import prepare, quiet_on_closed_pipe

KINDS = ["causal", "sliding", "chunked", "prefix", "documents", "padding"]
# the options each kind reads besides -L and -S (any other one given is an error)
OWN: dict[str, tuple[str, ...]] = {
    "causal": ("align", "offset"),
    "sliding": ("align", "offset", "window", "right"),
    "chunked": ("align", "offset", "chunk"),
    "prefix": ("align", "offset", "prefix"),
    "documents": ("align", "offset", "documents"),
    "padding": ("length",),
}
# a kind's size options left out: scaled to the call, so any -L draws a readable mask
SIZED: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "window": ("a quarter of L", lambda L, S: max(L // 4, 1)),
    "right": ("0", lambda L, S: 0),
    "chunk": ("a third of L, rounded up", lambda L, S: -(-L // 3)),
    "prefix": ("a third of L, rounded up", lambda L, S: -(-L // 3)),
    "documents": ("2", lambda L, S: 2),
    "length": ("half of S, rounded up", lambda L, S: -(-S // 2)),
}
DRAWN = 64  # the most characters a side `attnkit mask` prints; larger masks draw blocks


class OptionError(ValueError):
    """An option the chosen kind does not read, or a value it cannot take."""


def _sized(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with S and the kind's size options filled in; an option given that the
    kind does not read, or more documents than keys, raise `OptionError`."""
    args.S = args.L if args.S is None else args.S
    stray = [
        n
        for n in ("align", "offset", *SIZED)
        if getattr(args, n) is not None and n not in OWN[args.kind]
    ]
    if stray:
        given = ", ".join(f"--{n}" for n in stray)
        reads = ", ".join(f"--{n}" for n in OWN[args.kind])
        raise OptionError(f"{args.kind} does not read {given}; it reads -L, -S, {reads}")
    for name, (_, default) in SIZED.items():
        if getattr(args, name) is None:
            setattr(args, name, default(args.L, args.S))
    if args.kind == "documents" and args.documents > args.S:
        raise OptionError(
            f"--documents {args.documents} is more than the S={args.S} keys: each document "
            "holds at least one key (give at most S documents, or a larger -S)"
        )
    return args


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
    from attnkit.learn.tour import run_tour

    return 1 if run_tour() else 0


def _cmd_mask(args: argparse.Namespace) -> int:
    mask = _mask_from_args(_sized(args))
    drawing = mask.draw(args.L, args.S, cells=DRAWN)  # before any output: an error comes alone
    legend = "■ may attend  · hidden"
    if max(args.L, args.S) > DRAWN:
        rows, keys = -(-args.L // DRAWN), -(-args.S // DRAWN)
        legend = f"one mark per {rows}×{keys} block of pairs: ■ all may attend  ▪ some  · none"
    print(f"{mask}   L={args.L}, S={args.S}   {legend}\n{drawing}")
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    _sized(args)
    # inputs of the call's shapes that hold one row of D numbers each (zero strides but the
    # last): planning reads sizes, strides and dtypes, never the values
    row = torch.empty(args.dim)
    q = row.expand(args.batch, args.heads, args.L, args.dim)
    kv = row.expand(args.batch, args.kv_heads or args.heads, args.S, args.dim)
    print(ak.explain(q, kv, kv, _mask_from_args(args), need_lse=args.lse, verbose=args.verbose))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from attnkit.learn.benchmark import run_bench, table

    dtype = getattr(torch, args.dtype)
    rows = run_bench(
        args.S,
        heads=args.heads,
        dim=args.dim,
        dtype=dtype,
        patterns=tuple(args.patterns),
        backward=args.backward,
        runs=args.runs,
        progress=sys.stderr,
    )
    print(table(rows, args.S, dtype, heads=args.heads, dim=args.dim))
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


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    parse.__name__ = "int"  # argparse names the type in its errors
    return parse


KIND_HELP = (
    "Kinds: causal (key j visible iff j <= i), sliding (a window of keys around the "
    "diagonal, --window left, --right right), chunked (causal inside chunks of --chunk "
    "positions), prefix (a prefix of --prefix keys every query sees, causal after it), "
    "documents (--documents packed documents, causal inside each), padding (the first "
    "--length keys are real). An option another kind reads is an error."
)


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
        p = sub.add_parser(name, help=helptext, description=KIND_HELP)
        p.add_argument("kind", choices=KINDS, help="the mask (its options below name it)")
        default_L = 8 if name == "mask" else 4096
        p.add_argument(
            "-L", type=_count(1), default=default_L, help=f"queries (default: {default_L})"
        )
        p.add_argument("-S", type=_count(1), default=None, help="keys (default: L)")
        p.add_argument(
            "--align",
            choices=["top_left", "bottom_right"],
            default=None,
            help="all but padding: where the diagonal sits when L != S",
        )
        p.add_argument(
            "--offset", type=int, default=None, help="all but padding: key j visible iff j <= i + N"
        )
        for option, kind, least, what in (
            ("window", "sliding", 0, "keys left of the diagonal"),
            ("right", "sliding", 0, "keys right of it"),
            ("chunk", "chunked", 1, "positions per chunk"),
            ("prefix", "prefix", 0, "prefix length every query sees"),
            ("documents", "documents", 1, "how many, of equal length"),
            ("length", "padding", 0, "real keys, the rest padding"),
        ):
            helptext = f"{kind}: {what} (default: {SIZED[option][0]})"
            p.add_argument(f"--{option}", type=_count(least), default=None, help=helptext)
        if name == "explain":
            p.add_argument("--batch", type=_count(1), default=1, help="B (default: 1)")
            p.add_argument("--heads", type=_count(1), default=8, help="query heads H (default: 8)")
            p.add_argument(
                "--kv-heads",
                type=_count(1),
                default=None,
                help="key/value heads Hkv, dividing H (default: H)",
            )
            p.add_argument(
                "--dim", type=_count(1), default=64, help="head size D = Dv (default: 64)"
            )
            p.add_argument("--lse", action="store_true", help="also return the log-sum-exp")
            p.add_argument(
                "--verbose", action="store_true", help="show the cost model's figures too"
            )
    p = sub.add_parser("bench", help="time attention() against PyTorch's SDPA on this machine")
    p.add_argument("-S", type=_count(1), default=2048, help="queries = keys (default: 2048)")
    p.add_argument("--heads", type=_count(1), default=8, help="heads H (default: 8)")
    p.add_argument("--dim", type=_count(1), default=64, help="head size D (default: 64)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="(default: float32)",
    )
    every = ["causal", "sliding", "documents", "padding"]
    patterns_help = f"masks to time (default: all: {' '.join(every)})"
    p.add_argument("--patterns", nargs="+", choices=every, default=every, help=patterns_help)
    p.add_argument("--backward", action="store_true", help="also time forward+backward")
    p.add_argument("--runs", type=_count(1), default=5, help="timed rounds, median (default: 5)")
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
        "tour": _cmd_tour,
        "mask": _cmd_mask,
        "explain": _cmd_explain,
        "bench": _cmd_bench,
        "calibrate": _cmd_calibrate,
    }
    try:
        return quiet_on_closed_pipe(lambda: commands[args.command](args))
    except (ak.ShapeContractError, ak.MaskError, OptionError) as err:
        print(f"attnkit {args.command}: {in_cli_terms(str(err))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
