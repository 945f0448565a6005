"""The fuzz harness's check of DESIGN §2 for keys some rows see and others hide: a NaN in
such a key's K or V reaches exactly the rows that see the key, forward and backward.

A case with `leak` writes NaN into one entry of K or V at a key that some query rows of
batch row 0, K/V head 0 see and others hide. Every backend then answers the rows that
hide it as the float64 truth of the clean inputs does (the rule of `fuzz_check.compare`),
gives the rows that see it a non-finite output, and gradients that match the truth for
the rows that hide it and for the keys only such rows see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import attnkit as ak
from fuzz_cases import Built, Case

NAN = float("nan")


@dataclass
class Leak:
    """The case's inputs with the NaN written, and where it may show."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    rows: torch.Tensor  # (B, H, L) rows that see the key
    keys: torch.Tensor  # (B, Hkv, S) keys some of those rows see


def leak(case: Case, b: Built) -> Leak | None:
    """The leaked inputs, or None where the case has no such key (or stores the tensor
    expanded: one entry is every row's)."""
    if case.leak is None or b.visible.numel() == 0:
        return None
    target = 1 if case.leak == "k" else 2
    if case.layouts[target] == "expanded" or b.k.shape[-1] == 0 or b.v.shape[-1] == 0:
        return None
    G = case.H // case.Hkv
    seen = b.visible[0, :G]  # (G, L, S): the rows of K/V head 0 in batch row 0
    count = seen.sum((0, 1))  # (S,)
    partial = ((count > 0) & (count < seen.shape[0] * seen.shape[1])).nonzero().flatten()
    if partial.numel() == 0:
        return None
    j = int(partial[case.seed % partial.numel()])
    k, v = b.k.clone(), b.v.clone()
    (k if case.leak == "k" else v)[0, 0, j, 0] = NAN
    rows = torch.zeros(case.B, case.H, case.L, dtype=torch.bool)
    rows[0, :G] = seen[..., j]
    keys = torch.zeros(case.B, case.Hkv, case.S, dtype=torch.bool)
    keys[0, 0] = (seen & rows[0, :G, :, None]).any(1).any(0)
    return Leak(b.q, k, v, rows, keys)


def checked_outputs(
    backend: str,
    leaked: Leak,
    mask: object,
    kwargs: dict[str, float | None],
    truth_out: torch.Tensor,
) -> tuple[torch.Tensor, list[str]]:
    """The output with the rows that see the key set to the truth's, and what is wrong
    with those rows: each must show a non-finite value."""
    with torch.no_grad():
        out = ak.attention(leaked.q, leaked.k, leaked.v, mask, backend=backend, **kwargs)
    reached = leaked.rows
    problems = []
    if out.shape[-1] and not bool((~torch.isfinite(out[reached])).any(-1).all()):
        problems.append("leak: a row that sees the NaN key shows no non-finite value")
    return torch.where(reached[..., None], truth_out.to(out.dtype), out), problems


def checked_gradients(
    backend: str,
    leaked: Leak,
    mask: object,
    kwargs: dict[str, float | None],
    dout: torch.Tensor,
    truth_grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor | None, ...]:
    """dq, dk, dv with what the leaked key may reach set to the truth's: the rows that see
    it (dq) and the keys those rows see (dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (leaked.q, leaked.k, leaked.v))
    out = ak.attention(q, k, v, mask, backend=backend, **kwargs)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v), allow_unused=True)
    spots = (leaked.rows, leaked.keys, leaked.keys)
    return tuple(
        g if g is None else torch.where(spot[..., None], want.to(g.dtype), g)
        for g, want, spot in zip(grads, truth_grads, spots, strict=True)
    )
