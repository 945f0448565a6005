"""The context-parallel surface of the differential harness: `attnkit.distributed` in
P = 2..4 gloo processes against the float64 oracle of the whole problem.

A case is a core case (`fuzz_cases`: random masks from the whole algebra, GQA, softcap,
scale, NaN or Inf in keys no query sees) over a sequence that splits into P shards,
with a layout and a strategy; one in ten has rows past each batch row's length see only
padding, so whole ranks see nothing. Every rank checks its rows of the output, the
log-sum-exp and the gradients of its shards by `fuzz_check.compare` (the same bound as
the core surface; every strategy runs fused kernels on its pieces and merges them, so
it takes the reordering slack). Cases run in one process group per P; rank 0 writes
their outcomes for the campaign.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

import attnkit as ak
import attnkit.distributed as akd
from attnkit.call.precision import compute_dtype
from cp_harness import spawn
from fuzz_cases import Case, Draw, MaskSpec, RandomDraw, build, draw_case, draw_mask
from fuzz_check import Outcome, _call, _outcome, _rounding, compare, oracle

STRATEGIES = ("ring", "allgather", "ulysses", "auto")
SECONDS_PER_CASE = 4.0  # the group's deadline grows with its cases


def draw(d: Draw) -> tuple[Case, int, str, str]:
    """(case, P, layout, strategy): a self-attention case whose L splits into 2P chunks."""
    P = d.int(2, 4)
    L = 2 * P * d.int(1, 6)
    base = draw_case(d)
    Hkv = d.choice((1, 2, 4))
    B, H = d.int(1, 2), Hkv * d.choice((1, 2))
    mask = _nothing_past_lengths(d, B, L) if d.int(0, 9) == 0 else draw_mask(d, B, H, L, L)
    case = replace(
        base,
        B=B,
        H=H,
        Hkv=Hkv,
        L=L,
        S=L,
        D=d.choice((2, 8, 16)),
        dtype=d.choice((torch.float64, torch.float32)),
        layouts=("contiguous",) * 3,
        mask=mask,
        magnitude=d.choice((1.0, 1.0, 10.0, 1e3)),
        rows=(),
        flex=False,
    )
    case = replace(case, Dv=case.D if d.int(0, 1) else d.choice((2, 8)))
    return case, P, d.choice(akd.LAYOUTS), d.choice(STRATEGIES)


def _nothing_past_lengths(d: Draw, B: int, L: int) -> MaskSpec:
    lengths = [d.int(0, L // 2) for _ in range(B)]

    def make(c: Case, g: torch.Generator) -> ak.Mask:
        n = torch.tensor(lengths)
        padded = torch.arange(L)[None] >= n[:, None]  # (B, L)
        return ak.key_padding(n) & ak.document(padded.long())

    return MaskSpec(f"key_padding({lengths}) & document(padding)", make)


def check(rank: int, case: Case, layout: str, strategy: str) -> list[Outcome]:
    """This rank's outcomes of one case (forward with lse, then backward)."""
    b = build(case)
    truth, ref = oracle(case, b, torch.float64), oracle(case, b, compute_dtype(case.dtype))

    def mine(t: torch.Tensor) -> torch.Tensor:
        return akd.shard(t, layout) if isinstance(t, torch.Tensor) and t.dim() >= 3 else t

    slack = _rounding(case, truth, "auto")
    kw = dict(layout=layout, strategy=strategy, scale=case.scale, softcap=case.softcap)
    local = [mine(t) for t in (b.q, b.k, b.v)]

    def forward() -> Outcome:
        with torch.no_grad():
            out, lse = akd.attention_with_lse(*local, b.mask, **kw)
        return _outcome(
            "forward+lse",
            [
                compare(
                    "out",
                    out,
                    mine(truth.out),
                    mine(ref.out),
                    case.dtype,
                    slack * mine(truth.sensitivity_out),
                    truth.max_logit,
                ),
                compare(
                    "lse",
                    lse,
                    mine(truth.lse),
                    mine(ref.lse),
                    compute_dtype(case.dtype),
                    0.0,
                    truth.max_logit,
                ),
            ],
        )

    def backward() -> Outcome:
        leaves = [t.detach().requires_grad_() for t in local]
        out, lse = akd.attention_with_lse(*leaves, b.mask, **kw)
        finite = torch.isfinite(lse)
        loss = (out * mine(b.dout)).sum() + (torch.where(finite, lse, 0) * mine(b.dlse)).sum()
        got = torch.autograd.grad(loss, leaves, allow_unused=True)
        return _outcome(
            "backward+lse",
            [
                compare(n, g, mine(t), mine(r), case.dtype, slack * mine(x), truth.max_logit)
                for n, g, t, r, x in zip(
                    ["dq", "dk", "dv"],
                    got,
                    truth.grads_lse,
                    ref.grads_lse,
                    truth.sensitivity_lse,
                    strict=True,
                )
            ],
        )

    outcomes = []
    for what, fn in (("forward", forward), ("backward", backward)):
        result = _call(fn)
        result.backend, result.what = strategy, result.what or what
        if result.status == "refused" and strategy != "ulysses" and not _bias_tensor(case):
            result.status, result.detail = "wrong", f"refused a valid call: {result.detail}"
        outcomes.append(result)
    return outcomes


def _bias_tensor(case: Case) -> bool:
    return case.mask is not None and case.mask.tensor_bias  # not in this API: a refusal


def _group(rank: int, P: int, seed: int, indices: list[int], path: str) -> None:
    """Every case of `indices` in this group; rank 0 writes one JSON line per case."""
    out = Path(path).open("w") if rank == 0 else None  # noqa: SIM115 (rank 0 alone)
    for done, index in enumerate(indices, 1):
        case, _, layout, strategy = draw(RandomDraw(seed, index))
        local = check(rank, case, layout, strategy)
        everyone: list[list[Outcome] | None] = [None] * P
        torch.distributed.all_gather_object(everyone, local)
        if out is not None:
            merged = [_worst([ranks[i] for ranks in everyone if ranks]) for i in range(len(local))]
            text = f"P={P} {layout} {strategy} {case}"
            out.write(json.dumps([index, text, [vars(o) for o in merged]]) + "\n")
            out.flush()
            if done % 50 == 0:
                print(f"    P={P}: {done}/{len(indices)} cases", flush=True)
    if out is not None:
        out.close()


def _worst(per_rank: list[Outcome]) -> Outcome:
    order = ("ok", "refused", "wrong", "crash")
    worst = max(per_rank, key=lambda o: order.index(o.status))
    if worst.failed:
        rank = per_rank.index(worst)
        return Outcome(worst.backend, worst.what, worst.status, f"rank {rank}: {worst.detail}")
    return worst


def run(seed: int, indices: list[int], workdir: Path) -> Iterator[tuple[int, str, list[Outcome]]]:
    """(index, description, outcomes) of each case, grouped by P (one group each)."""
    by_P: dict[int, list[int]] = {}
    for index in indices:
        by_P.setdefault(draw(RandomDraw(seed, index))[1], []).append(index)
    for P, group in sorted(by_P.items()):
        path = workdir / f"distributed-P{P}.jsonl"
        deadline = 60 + SECONDS_PER_CASE * len(group)
        try:
            spawn(_group, P, seed, group, str(path), timeout=deadline)
        except BaseException as err:  # a crash or hang of the group: its cases failed
            found = _read(path)
            for index in group:
                if index not in found:
                    outcome = Outcome(
                        "group",
                        "run",
                        "crash",
                        f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:200]}",
                    )
                    found[index] = (f"P={P}", [outcome])
            yield from ((i, *found[i]) for i in group)
            continue
        found = _read(path)
        yield from ((i, *found[i]) for i in group)


def _read(path: Path) -> dict[int, tuple[str, list[Outcome]]]:
    found: dict[int, tuple[str, list[Outcome]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            index, text, outcomes = json.loads(line)
            found[index] = (text, [Outcome(**o) for o in outcomes])
    return found
