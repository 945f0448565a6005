"""`python -m attnkit.native build|status`: build the kernels ahead, or say where they are."""

from __future__ import annotations

import argparse
import sys
import time

from attnkit.native.build import build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnkit.native", description=__doc__)
    parser.add_argument("command", choices=("build", "status"))
    args = parser.parse_args(argv)
    start = time.monotonic()
    path, reason = build(quiet=args.command == "status", retry=args.command == "build")
    if path is None:
        print(f"attnkit native kernels: unavailable ({reason}); the composed backends serve.")
        return 1 if args.command == "build" and "ATTNKIT_NATIVE=off" not in str(reason) else 0
    print(f"attnkit native kernels: {path} ({time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
