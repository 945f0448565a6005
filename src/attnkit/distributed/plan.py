"""Which strategy serves a context-parallel call, what each would send, and why.

Estimates are per rank, forward pass, from sizes and the mask's key spans alone:
- `ring` sends this rank's K/V shard to each rank whose queries see some of its keys;
- `allgather` sends it to every other rank (and holds every shard: O(S) memory);
- `ulysses` sends (P-1)/P of its q, k, v, output and lse through two all-to-alls; it
  needs the K/V heads to split over the ranks.
`auto` (every rank must choose the same, so it reads the busiest rank's bytes) takes
`ulysses` where it can serve unless the ring sends less than half of its bytes: each
rank then runs one whole-sequence call per head shard, whose backward is the backend's
own, while the ring's pieces need the log-sum-exp gradient and recompute the remote
ones (measured: fwd+bwd 87 s against 133 s at S=65536, P=2, causal). Otherwise the
fewest bytes, ties to the ring (it overlaps transfers with compute and holds O(S/P)
memory), then allgather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnkit.distributed.pieces import GlobalCall
from attnkit.distributed.strategies import STRATEGIES

__all__ = ["ContextPlan", "plan_context"]

ULYSSES_UNLESS_RING_BELOW = 0.5  # the ring wins only if it sends less than this share


@dataclass
class ContextPlan:
    """What `attnkit.distributed.attention` would do on this rank, computed without
    running it: what `explain` returns. `print(plan)` shows it as a table.

    Args:
        strategy: the strategy chosen: "ring", "allgather" or "ulysses".
        rank: this rank, in the group.
        world_size: P, the group's size.
        layout: "zigzag" or "contiguous".
        bytes_sent: per strategy, the bytes this rank would send (None: cannot serve).
        reasons: per strategy, why it was not chosen (None: chosen).
        needs: P×P bools: `needs[r][s]` when rank r's queries see some of rank s's keys.
        pairs: per shard, the query-key pairs this rank computes against it, per batch
            row and head (default []: not computed).

    Examples:
        >>> import torch.distributed as dist, attnkit.distributed as akd
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> q = torch.randn(1, 2, 8, 4)  # (B, H, L/P, D)
        >>> plan = akd.explain(q, q, q, ak.sliding_window(2) & ak.causal())
        >>> plan.rank, plan.skipped, plan.peers  # no pair skipped, no peer in a world of 1
        (0, 0, [])
        >>> plan.pairs  # 1 + 2 + 3 · 6 pairs
        [21]
        >>> sorted(plan.bytes_sent)
        ['allgather', 'ring', 'ulysses']
        >>> dist.destroy_process_group()
    """

    strategy: str
    rank: int
    world_size: int
    layout: str
    bytes_sent: dict[str, int | None]  # per strategy; None where it cannot serve
    reasons: dict[str, str | None]  # per strategy: why not chosen (None: chosen)
    needs: list[list[bool]]  # needs[r][s]: rank r's queries see some of rank s's keys
    pairs: list[int] = field(default_factory=list)  # query-key pairs against each shard

    @property
    def skipped(self) -> int:
        """(rank, shard) pairs that exchange and compute nothing."""
        return sum(not n for row in self.needs for n in row)

    @property
    def peers(self) -> list[int]:
        """Ranks this rank's K/V shard goes to under the ring."""
        return [d for d in range(self.world_size) if d != self.rank and self.needs[d][self.rank]]

    def __str__(self) -> str:
        lines = [
            f"context parallel: strategy {self.strategy!r}, rank {self.rank} of "
            f"{self.world_size}, layout {self.layout!r}",
            f"  skipped (rank, shard) pairs: {self.skipped} of {self.world_size**2}; "
            f"this rank's K/V goes to ranks {self.peers or 'none'}",
            "  work against each shard (query-key pairs per batch row and head): "
            + ", ".join(f"{s}: {p}" for s, p in enumerate(self.pairs)),
        ]
        for name in STRATEGIES:
            sent = self.bytes_sent[name]
            amount = "cannot serve" if sent is None else f"{sent / 2**20:.2f} MiB sent"
            why = self.reasons[name]
            lines.append(
                f"  {'*' if why is None else ' '} {name:<9} {amount:<16} {why or 'chosen'}"
            )
        return "\n".join(lines)


def plan_context(
    global_call: GlobalCall,
    rank: int,
    strategy: str,
    kv_bytes: int,
    q_bytes: int,
    out_bytes: int,
    *,
    detail: bool = True,
) -> ContextPlan:
    """The plan for `strategy` ("auto" or a name): `kv_bytes` is one rank's packed K/V
    shard, `q_bytes` its queries, `out_bytes` its output and lse. `detail=False` leaves
    out the work per shard (a pass over every row's key span: for `explain` only)."""
    if strategy not in (*STRATEGIES, "auto"):
        raise ValueError(f"strategy must be 'auto' or one of {STRATEGIES}, got {strategy!r}.")
    P = global_call.P
    needs = global_call.needs()

    def ring_bytes(rank: int) -> int:
        return kv_bytes * sum(needs[d][rank] for d in range(P) if d != rank)

    sent: dict[str, int | None] = {
        "ring": ring_bytes(rank),
        "allgather": kv_bytes * (P - 1),
        "ulysses": (q_bytes + kv_bytes + out_bytes) * (P - 1) // P,
    }
    # every rank must choose alike (or they wait on each other forever): by the busiest
    # rank's bytes, which every rank computes the same
    busiest = {**sent, "ring": max(ring_bytes(s) for s in range(P))}
    refused: dict[str, str] = {}
    if global_call.Hkv % P:
        sent["ulysses"] = None
        refused["ulysses"] = (
            f"shards heads: Hkv={global_call.Hkv} K/V heads do not split over P={P} ranks "
            "(use ring or allgather, or a group whose size divides Hkv)"
        )
    if strategy != "auto" and strategy in refused:
        raise ValueError(f"strategy {strategy!r} cannot serve this call: it {refused[strategy]}.")
    chosen = strategy if strategy != "auto" else _auto(busiest, refused)
    reasons: dict[str, str | None] = {}
    for name in STRATEGIES:
        if name == chosen:
            reasons[name] = None
        elif name in refused:
            reasons[name] = refused[name]
        elif strategy != "auto":
            reasons[name] = f"strategy={strategy!r} was asked for"
        elif chosen == "ulysses":
            reasons[name] = (
                "sends at least half of ulysses' bytes (from the busiest rank), and its "
                "backward recomputes pieces through the log-sum-exp gradient"
            )
        else:
            reasons[name] = (
                f"sends more than {chosen} (from the busiest rank)"
                if busiest[name] != busiest[chosen]
                else f"sends as much as {chosen}, which comes first: ring, allgather, ulysses"
            )
    pairs = [global_call.pairs(rank, s) for s in range(P)] if detail else []
    return ContextPlan(chosen, rank, P, global_call.layout.name, sent, reasons, needs, pairs)


def _auto(busiest: dict[str, int | None], refused: dict[str, str]) -> str:
    ring, ulysses = busiest["ring"], busiest["ulysses"]
    assert ring is not None
    if (
        "ulysses" not in refused
        and ulysses is not None
        and ring >= ULYSSES_UNLESS_RING_BELOW * ulysses
    ):
        return "ulysses"
    servable = [n for n in STRATEGIES if n not in refused]
    return min(servable, key=lambda n: (busiest[n] or 0, STRATEGIES.index(n)))
