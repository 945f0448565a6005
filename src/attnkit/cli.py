"""The `attnkit` command: a tour of the mechanism, mask pictures, plans."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

import attnkit as ak


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
    print(f"{mask}   L={args.L}, S={args.S}   ■ may attend  · hidden")
    print(mask.draw(args.L, args.S))
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    args.S = args.L if args.S is None else args.S
    q = torch.empty(args.batch, args.heads, args.L, args.dim)
    kv = torch.empty(args.batch, args.kv_heads or args.heads, args.S, args.dim)
    print(ak.explain(q, kv, kv, _mask_from_args(args), need_lse=args.lse))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("tour", help="walk the attention mechanism step by step, with live checks")
    for name, helptext in (("mask", "draw a mask"), ("explain", "show the plan for a call")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument(
            "kind", choices=["causal", "sliding", "chunked", "prefix", "documents", "padding"]
        )
        p.add_argument("-L", type=int, default=8 if name == "mask" else 4096, help="queries")
        p.add_argument("-S", type=int, default=None, help="keys (default: L)")
        p.add_argument("--align", choices=["top_left", "bottom_right"], default=None)
        p.add_argument("--offset", type=int, default=None, help="key j visible iff j <= i + n")
        p.add_argument("--window", type=int, default=2, help="sliding: keys left of the diagonal")
        p.add_argument("--right", type=int, default=0, help="sliding: keys right of it")
        p.add_argument("--chunk", type=int, default=3, help="chunked: positions per chunk")
        p.add_argument("--prefix", type=int, default=3, help="prefix: prefix length")
        p.add_argument("--documents", type=int, default=2, help="documents: how many")
        p.add_argument("--length", type=int, default=5, help="padding: real keys")
        if name == "explain":
            p.add_argument("--batch", type=int, default=1)
            p.add_argument("--heads", type=int, default=8)
            p.add_argument("--kv-heads", type=int, default=None)
            p.add_argument("--dim", type=int, default=64)
            p.add_argument("--lse", action="store_true", help="also return the log-sum-exp")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"tour": _cmd_tour, "mask": _cmd_mask, "explain": _cmd_explain}
    try:
        return commands[args.command](args)
    except (ak.ShapeContractError, ak.MaskError) as err:
        print(f"attnkit: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
