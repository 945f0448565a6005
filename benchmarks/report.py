"""Turn benchmark records into the markdown table and the PNG plot of the Benchmarks page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    """One row per (S, pattern, pass): median ms of each peer, auto's share of the roofline."""
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
        "| dtype | S | pattern | pass | naive | SDPA | Flex | auto (backend) | auto GFLOP/s | "
        "% roofline | per pair | auto vs best peer | MiB SDPA | MiB auto |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype, S, pattern, pass_ in keys:
        row = {p: index.get((dtype, S, pattern, pass_, p)) for p in PEER_NAMES}
        auto = row["auto"]
        peers = [row[p]["ms"] for p in ("naive", "sdpa", "flex") if row[p] and "ms" in row[p]]
        speedup = f"{min(peers) / auto['ms']:.2f}×" if auto and "ms" in auto and peers else "–"
        flex = _cell(row["flex"]) + _compile(row["flex"])
        dense = [  # half rows: the better of SDPA in its own dtype and in float32
            d["gflops"] for dt in {dtype, "float32"}
            if (d := index.get((dt, S, "none", pass_, "sdpa"))) and d.get("gflops")
        ]  # fmt: skip
        per_pair = (
            f"{auto['gflops'] / max(dense):.2f}" if auto and "gflops" in auto and dense else "–"
        )
        lines.append(
            f"| {dtype} | {S} | {pattern} | {pass_} | {_cell(row['naive'])} | "
            f"{_cell(row['sdpa'])} | "
            f"{flex} | {_cell(auto)} ({auto.get('backend', '?') if auto else '?'})"
            f"{_compile(auto) if auto and auto.get('backend') == 'flex' else ''} | "
            f"{auto['gflops']:.0f} | {auto['roofline_pct']:.0f}% | {per_pair} | {speedup} | "
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


def write_plot(meta: dict[str, Any], records: list[dict[str, Any]], path: Path) -> None:
    """Share of the roofline per pattern and peer: one panel per (pass, S)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    sizes = sorted({r["S"] for r in records})
    passes = ("fwd", "fwd+bwd")
    fig, axes = plt.subplots(
        len(passes), len(sizes), figsize=(5 * len(sizes), 7), squeeze=False, sharey=True
    )
    width = 0.2
    for row, pass_ in enumerate(passes):
        for col, S in enumerate(sizes):
            ax = axes[row][col]
            for n, peer in enumerate(PEER_NAMES):
                values = []
                for pattern in PATTERN_ORDER:
                    match = [
                        r
                        for r in records
                        if (r["S"], r["pattern"], r["pass"], r["peer"]) == (S, pattern, pass_, peer)
                        and _dtype(r) == "float32"
                        and "ms" in r
                    ]
                    values.append(match[0]["roofline_pct"] if match else 0.0)
                ax.bar(
                    [i + (n - 1.5) * width for i in range(len(PATTERN_ORDER))],
                    values,
                    width,
                    label=PEER_NAMES[peer],
                )
            ax.set_title(f"{pass_}, S={S}")
            ax.set_xticks(range(len(PATTERN_ORDER)), PATTERN_ORDER, rotation=30)
            if col == 0:
                ax.set_ylabel("% of fp32 matmul roofline (useful FLOPs)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        f"attention on CPU: roofline {meta['roofline_gflops']:.0f} GFLOP/s, torch {meta['torch']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
