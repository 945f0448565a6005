"""What each process of the context-parallel tests runs (spawned by cp_harness.spawn).

Every case computes the same global problem in one process (attnkit, or the float64
reference) and split over the group, then compares this rank's rows of the output, the
log-sum-exp and the gradients of q, k and v with the single-process ones.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

import attnkit as ak
import attnkit.distributed as akd
from attnkit.distributed import comm

B, H, L, D, DV = 2, 4, 48, 8, 6
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
AGAINST = {torch.float64: "reference", torch.float32: "auto"}


def inputs(Hkv: int, dtype: torch.dtype, seed: int = 0, Dv: int = DV) -> tuple[Tensor, ...]:
    """q, k, v, dout, dlse; Dv == D takes the fused backward (each piece's gradients from
    the rows' global out and lse), Dv != D the pieces' own autograd."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, L, D), (B, Hkv, L, D), (B, Hkv, L, Dv), (B, H, L, Dv), (B, H, L)]
    return tuple(torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes)


def masks(P: int) -> dict[str, ak.Mask | Tensor | None]:
    docs = torch.tensor([[0] * 10 + [1] * 20 + [2] * 18, [0] * 31 + [1] * 17])
    lengths = torch.tensor([48, 20])
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    rows_padded = (i < lengths[:, None, None, None]) & (j < lengths[:, None, None, None]) & (j <= i)
    g = torch.Generator().manual_seed(7)
    random = torch.rand(B, H, L, L, generator=g) < 0.3
    random[:, :, 5] = False  # an empty row
    return {
        "none": None,
        "causal": ak.causal(),
        "window_narrow": ak.sliding_window(3),
        "window_wide": ak.sliding_window(30, 2),
        "documents": ak.document(docs) & ak.causal(),
        "prefix_lm": ak.prefix_lm(torch.tensor([5, 30])),
        "key_padding": ak.causal() & ak.key_padding(lengths),
        "padded_rows": rows_padded,  # (B, 1, L, L): rank 1's rows of batch 1 see nothing
        "alibi": ak.alibi(H) & ak.causal(),
        # rows past each length see only padding: whole ranks' rows see nothing
        "rank_sees_nothing": ak.key_padding(torch.tensor([10, 5]))
        & ak.document((torch.arange(L) >= torch.tensor([10, 5])[:, None]).long()),
        "tensor_per_head": random,
    }


def check(
    rank: int,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    dlse: Tensor,
    mask: ak.Mask | Tensor | None,
    layout: str,
    strategy: str,
    *,
    softcap: float | None = None,
    clean: tuple[Tensor, Tensor] | None = None,
) -> None:
    """Sharded == single process in out, lse and the gradients of q, k, v. `clean`: the
    k, v the single-process run uses (the sharded one gets the poisoned q, k, v)."""
    tol, against = TOL[q.dtype], AGAINST[q.dtype]
    kw = dict(softcap=softcap)
    full = [t.clone().requires_grad_() for t in (q, *(clean or (k, v)))]
    out, lse = ak.attention_with_lse(*full, mask, backend=against, **kw)
    _loss(out, lse, dout, dlse).backward()
    local = [akd.shard(t, layout).detach().requires_grad_() for t in (q, k, v)]
    o, s = akd.attention_with_lse(*local, mask, layout=layout, strategy=strategy, **kw)
    _loss(o, s, akd.shard(dout, layout), akd.shard(dlse, layout)).backward()
    where = f"rank {rank}, layout {layout}, strategy {strategy}"
    pairs = [("out", out, o), ("lse", lse, s)]
    pairs += [(f"grad {n}", f.grad, x.grad) for n, f, x in zip("qkv", full, local, strict=True)]
    for name, want, got in pairs:
        want = akd.shard(want.detach(), layout)
        assert torch.isfinite(got).any() or not torch.isfinite(want).any(), f"{name}: {where}"
        if name != "lse":
            assert torch.isfinite(got).all(), f"{name} not finite: {where}"
        torch.testing.assert_close(
            got, want, atol=tol, rtol=tol, msg=lambda m, name=name: f"{name} ({where}): {m}"
        )


def _loss(out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor) -> Tensor:
    finite = torch.isfinite(lse)
    return (out * dout).sum() + (torch.where(finite, lse, 0) * dlse.to(lse.dtype)).sum()


def matrix(
    rank: int,
    P: int,
    dtype: torch.dtype,
    Hkv: int,
    strategies: tuple[str, ...],
    names: tuple[str, ...] | None = None,
    Dv: int = DV,
) -> None:
    """Every mask (or those `names`) × layout × strategy (ulysses where the heads split)."""
    q, k, v, dout, dlse = inputs(Hkv, dtype, Dv=Dv)
    for name, mask in masks(P).items():
        if names is not None and name not in names:
            continue
        for layout in akd.LAYOUTS:
            for strategy in strategies:
                if strategy == "ulysses" and Hkv % P:
                    continue
                try:
                    check(rank, q, k, v, dout, dlse, mask, layout, strategy)
                except AssertionError as err:
                    raise AssertionError(f"mask {name}: {err}") from None


def options(rank: int, P: int) -> None:
    """softcap and scale through every strategy; ulysses refuses heads that do not split."""
    q, k, v, dout, dlse = inputs(2, torch.float64)
    for strategy in ("ring", "allgather", "ulysses"):
        if strategy == "ulysses" and 2 % P:
            try:
                akd.attention(*(akd.shard(t) for t in (q, k, v)), ak.causal(), strategy="ulysses")
            except ValueError as err:
                assert "Hkv=2" in str(err) and f"P={P}" in str(err), err
            else:
                raise AssertionError("ulysses with Hkv % P != 0 was not refused")
            continue
        check(rank, q, k, v, dout, dlse, ak.causal(), "zigzag", strategy, softcap=2.0)


def poisoned(rank: int, P: int, Dv: int = DV) -> None:
    """NaN and Inf in keys and values no query sees never reach outputs or gradients."""
    q, k, v, dout, dlse = inputs(2, torch.float64, Dv=Dv)
    lengths = torch.tensor([40, 13])
    hidden = torch.arange(L)[None, :] >= lengths[:, None]  # (B, S)
    bad_k = k.masked_fill(hidden[:, None, :, None], float("nan"))
    bad_v = v.masked_fill(hidden[:, None, :, None], float("inf"))
    mask = ak.causal() & ak.key_padding(lengths)
    for strategy in ("ring", "allgather", "ulysses")[: 3 if 2 % P == 0 else 2]:
        for layout in akd.LAYOUTS:
            check(rank, q, bad_k, bad_v, dout, dlse, mask, layout, strategy, clean=(k, v))


def traffic(rank: int, P: int) -> None:
    """The ring sends a shard only where its keys are seen, as the plan says."""
    q, k, v, _, _ = inputs(2, torch.float32)
    n = L // P
    aligned = ak.document((torch.arange(L) // n)[None]) & ak.causal()  # documents = shards
    cases = {"window_narrow": ak.sliding_window(3), "aligned_documents": aligned}
    local = [akd.shard(t, "contiguous") for t in (q, k, v)]
    for name, mask in cases.items():
        plan = akd.explain(*local, mask, layout="contiguous", strategy="ring")
        sent = _count_sent(
            lambda mask=mask: akd.attention(*local, mask, layout="contiguous", strategy="ring")
        )
        assert sent == plan.bytes_sent["ring"], (name, sent, plan.bytes_sent)
        if name == "window_narrow":  # keys go to the next rank only (the window looks left)
            assert plan.peers == ([rank + 1] if rank + 1 < P else []), (name, plan.peers)
            assert plan.skipped == P * P - (2 * P - 1), plan
        else:
            assert plan.peers == [] and sent == 0 and plan.skipped == P * P - P, plan
        assert plan.bytes_sent["allgather"] == (P - 1) * _kv_bytes(local), plan
    auto = akd.explain(*local, cases["window_narrow"], layout="contiguous")
    assert auto.strategy == ("ulysses" if 2 % P == 0 else "ring"), auto  # Hkv=2
    aligned = akd.explain(*local, cases["aligned_documents"], layout="contiguous")
    assert aligned.strategy == "ring" and "* ring" in str(aligned), aligned  # sends nothing
    # auto chooses alike on every rank, though each rank's traffic differs (or they hang)
    q, k, v, _, _ = inputs(4 if P == 4 else 2, torch.float32)
    for layout in akd.LAYOUTS:
        local = [akd.shard(t, layout) for t in (q, k, v)]
        chosen = [akd.explain(*local, m, layout=layout).strategy for m in masks(P).values()]
        everyone: list[list[str]] = [[] for _ in range(P)]
        torch.distributed.all_gather_object(everyone, chosen)
        assert all(c == chosen for c in everyone), everyone


def _kv_bytes(local: list[Tensor]) -> int:
    _, k, v = local
    return k.numel() * k.element_size() + v.numel() * v.element_size()


def _count_sent(run) -> int:  # type: ignore[no-untyped-def]
    sent = [0]
    original = comm.Group.isend

    def counting(self, tensor, rank, tag):  # type: ignore[no-untyped-def]
        sent[0] += tensor.numel() * tensor.element_size()
        return original(self, tensor, rank, tag)

    comm.Group.isend = counting  # type: ignore[method-assign]
    try:
        run()
    finally:
        comm.Group.isend = original  # type: ignore[method-assign]
    return sent[0]


def module(rank: int, P: int) -> None:
    """MultiHeadAttention (GQA, RoPE by global positions) under parallelize equals one
    process: outputs, input gradients and (summed over ranks) parameter gradients."""
    import copy

    torch.manual_seed(0)
    single = ak.MultiHeadAttention(16, 4, num_kv_heads=2, rope=True).double()
    split = akd.parallelize(copy.deepcopy(single), akd.ContextParallel(layout="zigzag"))
    x = torch.randn(2, L, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = ak.sliding_window(5) & ak.document(torch.tensor([[0] * 20 + [1] * 28] * 2))
    full_x, local_x = x.clone().requires_grad_(), akd.shard(x, dim=1).requires_grad_()
    out = single(full_x, mask=mask)
    local = split(local_x, mask=mask)
    torch.testing.assert_close(local, akd.shard(out, dim=1), atol=1e-12, rtol=1e-12)
    weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(2))
    (out * weights).sum().backward()
    (local * akd.shard(weights, dim=1)).sum().backward()
    torch.testing.assert_close(local_x.grad, akd.shard(full_x.grad, dim=1), atol=1e-12, rtol=0)
    for (name, a), b in zip(single.named_parameters(), split.parameters(), strict=True):
        torch.distributed.all_reduce(b.grad)
        torch.testing.assert_close(b.grad, a.grad, atol=1e-11, rtol=1e-11, msg=name)
    try:
        split(local_x, local_x)
    except ValueError as err:
        assert "self-attention" in str(err), err
    else:
        raise AssertionError("a key for a context-parallel module was accepted")


def agreement(rank: int, P: int) -> None:
    """Ranks that pass different problems, or one rank's invalid inputs, raise the same
    typed error on every rank before any traffic; the group stays usable."""
    q, k, v, _, _ = inputs(2, torch.float32)
    local = [akd.shard(t) for t in (q, k, v)]
    last = P - 1
    docs = torch.arange(L)[None] // 12
    wrong_docs = docs.clone()
    wrong_docs[0, 3] += rank == last
    cases = [
        (
            "mask",
            ak.causal() if rank == 0 else ak.sliding_window(3),
            local,
            {},
            ak.RanksDisagreeError,
            r"mask differs \(ranks \[0\]: causal",
        ),
        (
            "mask tensors",
            ak.document(wrong_docs),
            local,
            {},
            ak.RanksDisagreeError,
            rf"mask differs .*ranks \[{last}\]",
        ),
        (
            "strategy",
            ak.causal(),
            local,
            {"strategy": "ring" if rank else "allgather"},
            ak.RanksDisagreeError,
            "strategy differs",
        ),
        (
            "q one row short",
            ak.causal(),
            [local[0][:, :, 1:] if rank == last else local[0], *local[1:]],
            {},
            ak.ShapeContractError,
            rf"rank {last} of {P} refused",
        ),
        (
            "k float64",
            ak.causal(),
            [local[0], local[1].double() if rank == last else local[1], local[2]],
            {},
            TypeError,
            rf"rank {last} of {P} refused",
        ),
    ]
    for name, mask, tensors, kw, error, words in cases:
        try:
            akd.attention(*tensors, mask, **kw)
        except error as err:
            assert re.search(words, str(err)), (name, str(err))
        else:
            raise AssertionError(f"{name}: no error on rank {rank}")
    out = akd.attention(*local, ak.causal())  # the group still works
    assert out.shape == (B, H, L // P, DV)


def layouts(rank: int, P: int) -> None:
    """shard/unshard round trips; a length that does not divide names the padding."""
    x = torch.randn(2, 3, 8 * P, 5, generator=torch.Generator().manual_seed(0))
    for layout in akd.LAYOUTS:
        local = akd.shard(x, layout)
        assert local.shape == (2, 3, 8, 5)
        assert torch.equal(akd.unshard(local, layout), x)
    try:
        akd.shard(torch.randn(1, 1, 2 * P * 4 + 1, 2), "zigzag")
    except ak.ShapeContractError as err:
        assert f"pad it by {2 * P - 1}" in str(err), err
    else:
        raise AssertionError("a length that does not divide was accepted")


def suite(rank: int, P: int, full: bool) -> None:
    """One process group for many checks (starting processes costs seconds): `full` runs
    every strategy on every mask in float64 and float32; otherwise the ring and allgather
    over every mask in float64 (all strategies at P=2) and the rest on a few."""
    every = ("ring", "allgather", "ulysses", "auto")
    few = ("causal", "window_narrow", "documents", "padded_rows", "alibi")
    if full or P == 2:
        matrix(rank, P, torch.float64, 2, every)
    else:
        matrix(rank, P, torch.float64, 2, ("ring", "allgather"))
    for Hkv in (1, 4) if full else (1 if P == 2 else 4,):
        matrix(
            rank,
            P,
            torch.float32,
            Hkv,
            every if full else ("ring", "ulysses"),
            None if full else few,
        )
    fused = ("ring", "allgather")  # D == Dv: the fused backward from the global out, lse
    if full or P == 2:
        matrix(rank, P, torch.float64, 2, fused, Dv=D)
        matrix(rank, P, torch.float32, 1, fused, few, Dv=D)
    else:
        matrix(rank, P, torch.float64, 2, fused, few, Dv=D)
    options(rank, P)
    module(rank, P)
    poisoned(rank, P)
    poisoned(rank, P, Dv=D)
    traffic(rank, P)
    agreement(rank, P)
    layouts(rank, P)
