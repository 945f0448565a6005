"""`python -m attnkit.native build|status|background`: build the kernels ahead (waiting,
with progress), say where they are (building nothing), or build them as a process's
background child does (a failure remembered is not retried)."""

from __future__ import annotations

import argparse
import sys
import time

from attnkit.native.build import build, home


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnkit.native", description=__doc__)
    parser.add_argument("command", choices=("build", "status", "background"))
    args = parser.parse_args(argv)
    start = time.monotonic()
    if args.command == "status":
        where, reason = home()
        path, reason = (None, reason) if where is None else where.state()
        if path is None and reason is None:
            reason = "not built yet: python -m attnkit.native build builds them"
    else:
        path, reason = build(retry=args.command == "build")
    if path is None:
        print(f"attnkit native kernels: unavailable ({reason}); the composed backends serve.")
        return 1 if args.command != "status" and "ATTNKIT_NATIVE=off" not in str(reason) else 0
    print(f"attnkit native kernels: {path} ({time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
