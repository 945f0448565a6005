"""Turn benchmark records into the markdown table and the PNG plot of the Benchmarks page."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PEER_NAMES = {"naive": "naive", "sdpa": "SDPA", "flex": "Flex (compiled)", "auto": "attnkit auto"}


def _cell(record: dict[str, Any] | None) -> str:
    if record is not None and "call-budget" in record.get("skipped", ""):
        return "skip"
    if record is None or "ms" not in record:
        return "–"
    return f"{record['ms']:.1f}"


def _compile(record: dict[str, Any] | None) -> str:
    if record is None or not record.get("compile_s"):
        return ""
    return f" (+{record['compile_s']:.0f} s compile)"


def _repeats(meta: dict[str, Any]) -> str:
    repeats = meta["repeats"]
    if isinstance(repeats, int):  # results written before repeats depended on S
        return f"median of {repeats} runs"
    text = "median of " + ", ".join(f"{n} runs at S={S}" for S, n in repeats.items())
    if "long_round_s" in meta:
        text += (
            f" (2 runs without warm-up where a round of the peers was predicted over "
            f"{meta['long_round_s']:.0f} s; peers predicted over {meta['call_budget_s']:.0f} s "
            "a call skipped: 'skip')"
        )
    return text


def _mib(record: dict[str, Any] | None) -> str:
    if record is None or record.get("peak_extra_bytes") is None:
        return "–"
    return f"{record['peak_extra_bytes'] / 2**20:.0f}"


def write_markdown(meta: dict[str, Any], records: list[dict[str, Any]], path: Path) -> str:
    """One row per (S, pattern, pass): auto against the best peer, median ms of each peer,
    auto's share of the roofline."""
    index = {(_dtype(r), r["S"], r["pattern"], r["pass"], r["peer"]): r for r in records}
    keys = sorted(
        {(_dtype(r), r["S"], r["pattern"], r["pass"]) for r in records},
        key=lambda k: (k[0] != "float32", k[0], k[1], [*PATTERN_ORDER].index(k[2]), k[3]),
    )
    rooflines = meta.get("rooflines", {"float32": meta["roofline_gflops"]})
    roofs = ", ".join(f"{name} {value:.1f}" for name, value in rooflines.items())
    cpu = meta.get("cpu")
    units = (
        f"CPU {cpu['model']} ("
        + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["features"].items())
        + "); "
        if cpu
        else ""
    )
    lines = [
        f"{units}matmul roofline (GFLOP/s) {roofs}; torch {meta['torch']}, "
        f"{meta['threads']} threads, {_repeats(meta)}, peers timed round-robin, H=8, D=64; "
        "times in ms; useful GFLOP/s count allowed pairs only; % roofline against the "
        "row's dtype (half: the better of its own and float32's, which half inputs can "
        "always take); per pair = auto's useful GFLOP/s over SDPA's without a mask at the "
        "same S and pass (half: the better of its dtype and float32; 1.0: a visible pair "
        "costs what a dense one does); "
        "memory = peak extra MiB of one call in a fresh process (float32).",
        "",
        "| dtype | S | pattern | pass | auto vs best peer | auto (backend) | naive | SDPA | "
        "Flex | per pair | auto GFLOP/s | % roofline | MiB SDPA | MiB auto |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype, S, pattern, pass_ in keys:
        row = {p: index.get((dtype, S, pattern, pass_, p)) for p in PEER_NAMES}
        auto = row["auto"]
        peers = [row[p]["ms"] for p in ("naive", "sdpa", "flex") if row[p] and "ms" in row[p]]
        speedup = f"{min(peers) / auto['ms']:.2f}×" if auto and "ms" in auto and peers else "–"
        flex = _cell(row["flex"]) + _compile(row["flex"])
        dense = [  # half rows: the better of SDPA in its own dtype and in float32
            d["gflops"]
            for dt in {dtype, "float32"}
            if (d := index.get((dt, S, "none", pass_, "sdpa"))) and d.get("gflops")
        ]
        per_pair = (
            f"{auto['gflops'] / max(dense):.2f}" if auto and "gflops" in auto and dense else "–"
        )
        lines.append(  # the row's verdict first: auto against the best peer, auto's time
            f"| {dtype} | {S} | {pattern} | {pass_} | {speedup} | "
            f"{_cell(auto)} ({auto.get('backend', '?') if auto else '?'})"
            f"{_compile(auto) if auto and auto.get('backend') == 'flex' else ''} | "
            f"{_cell(row['naive'])} | {_cell(row['sdpa'])} | {flex} | {per_pair} | "
            f"{auto['gflops']:.0f} | {auto['roofline_pct']:.0f}% | "
            f"{_mib(row['sdpa'])} | {_mib(auto)} |"
            if auto and "ms" in auto
            else f"| {dtype} | {S} | {pattern} | {pass_} |" + " – |" * 10
        )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


PATTERN_ORDER = ("none", "causal", "sliding", "documents", "padding", "prefix", "tensor")


def _dtype(record: dict[str, Any]) -> str:
    return str(record.get("dtype", "float32"))  # results written before the dtype axis


def _bar_label(record: dict[str, Any] | None) -> str:
    """What a bar without a time says in its place: skip (over the call budget) or n/a."""
    return "skip" if _cell(record) == "skip" else "n/a"


def draw_plot(meta: dict[str, Any], records: list[dict[str, Any]]) -> Figure:
    """Share of the roofline per pattern and peer, float32: one panel per (S, pass); a
    peer without a time gets a labelled empty bar ('skip' or 'n/a'), never a zero."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no window

    sizes = sorted({r["S"] for r in records})
    passes = ("fwd", "fwd+bwd")
    patterns = [p for p in PATTERN_ORDER if any(r["pattern"] == p for r in records)]
    index = {
        (r["S"], r["pattern"], r["pass"], r["peer"]): r for r in records if _dtype(r) == "float32"
    }
    fig = Figure(figsize=(10, 1.0 + 3.0 * len(sizes)))
    axes = fig.subplots(len(sizes), len(passes), squeeze=False, sharey=True)
    width = 0.2
    top = max([r.get("roofline_pct", 0.0) for r in index.values()] + [1.0])
    for row, S in enumerate(sizes):
        for col, pass_ in enumerate(passes):
            ax = axes[row][col]
            for n, peer in enumerate(PEER_NAMES):
                xs = [i + (n - 1.5) * width for i in range(len(patterns))]
                found = [index.get((S, pattern, pass_, peer)) for pattern in patterns]
                values = [r["roofline_pct"] if r and "ms" in r else 0.0 for r in found]
                ax.bar(xs, values, width, label=PEER_NAMES[peer], color=f"C{n}")
                for x, pattern, record in zip(xs, patterns, found, strict=True):
                    ran = any(index.get((S, pattern, pass_, p)) for p in PEER_NAMES)
                    if ran and (record is None or "ms" not in record):
                        ax.text(
                            x,
                            top * 0.02,
                            _bar_label(record),
                            rotation=90,
                            ha="center",
                            va="bottom",
                            fontsize=8,
                            color=f"C{n}",
                        )
            ax.set_title(f"{pass_}, S={S}", fontsize=12)
            ax.set_xticks(range(len(patterns)), patterns, rotation=30, fontsize=10)
            ax.tick_params(axis="y", labelsize=10)
            if col == 0:
                ax.set_ylabel("% of fp32 roofline", fontsize=10)
    axes[0][0].legend(fontsize=9, ncols=2)
    fig.suptitle(
        f"attention on CPU, float32: share of the {meta['roofline_gflops']:.0f} GFLOP/s "
        f"matmul roofline (useful FLOPs), torch {meta['torch']}",
        fontsize=12,
    )
    fig.text(
        0.5,
        0.005,
        "skip: a call predicted over the call budget, not run;  n/a: not run "
        "(Flex has no backward on CPU; naive: its S limits)",
        ha="center",
        va="bottom",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    return fig


def write_plot(meta: dict[str, Any], records: list[dict[str, Any]], path: Path) -> None:
    """`draw_plot` as a PNG at `path` (nothing without matplotlib)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    draw_plot(meta, records).savefig(path, dpi=110)


def main() -> None:
    """Redraw the table and the plot of a kept run: `python benchmarks/report.py
    benchmarks/results/bench.json` writes bench.md and bench.png beside it."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("results", type=Path, help="a bench.json that benchmarks/bench.py wrote")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG only")
    args = parser.parse_args()
    run = json.loads(args.results.read_text())
    if not args.plot_only:
        write_markdown(run["meta"], run["records"], args.results.with_suffix(".md"))
    write_plot(run["meta"], run["records"], args.results.with_suffix(".png"))


if __name__ == "__main__":
    main()
