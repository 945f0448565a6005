"""A backend of your own: one file, and one line to register it.

`Float64` runs attention's closed loop (scores, mask, softmax, weighted sum of V) in
float64 and gives the result in the inputs' dtype: a slow, exact yardstick. Once
registered, `attention(..., backend="float64")` runs it, `explain` lists it with its
reason or its price, `auto` prices it beside the others (at 20x dense SDPA's time per
pair it never wins), and the gradients flow through it (autograd through its loop).

    python examples/own_backend.py
"""

from __future__ import annotations

import torch
from torch import Tensor

import attnkit as ak
from attnkit.backends import Backend, register, unregister
from attnkit.call import cost
from attnkit.contracts import AttentionCall
from attnkit.reference import attend


class Float64(Backend):
    """The closed loop in float64 (`attnkit.reference.attend`), any mask, bias, softcap
    and GQA; no dropout (its random weights would differ from every other backend's)."""

    name = "float64"
    values_exact = True  # the readable loop keeps a masked key's value from every row
    # its price per visible pair, in units of dense SDPA's (what `cost` multiplies)
    cost_factors = cost.Factors({"pair": 20.0})

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None:
        """None where it serves the call, else the reason `explain` shows."""
        return "float64 runs no dropout" if call.dropout_p > 0 else None

    def cost(self, call: AttentionCall, *, need_lse: bool) -> float:
        """What `auto` compares: the pairs of the (B, H, L, S) scores it computes."""
        d = call.dims
        return self.factors(call.table)["pair"] * d.B * d.H * d.L * d.S

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int:
        """The extra memory `explain` reports: scores, their exponentials and weights."""
        d = call.dims
        return 3 * d.B * d.H * d.L * d.S * 8

    def run(self, call: AttentionCall, *, need_lse: bool) -> tuple[Tensor, Tensor | None]:
        """The output (B, H, L, Dv) in q's dtype and, where asked, the log-sum-exp."""
        d = call.dims
        visible = None  # (B|1, H|1, L, S) bool, True = may attend
        if call.mask is not None:
            visible = call.mask.dense(d.B, d.H, d.L, d.S, call.q.device)
        bias = None if call.bias is None else call.bias.double()
        out, _, lse = attend(
            call.q.double(),
            call.k.double(),
            call.v.double(),
            visible,
            bias,
            scale=call.scale,
            softcap=call.softcap,
        )
        return out.to(call.q.dtype), lse.float() if need_lse else None


def main() -> float:
    """Register the backend, run a call on it and on `auto`, and return their largest
    difference."""
    register(Float64())  # the one line: auto, explain and the gradients now know it
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 8, 256, 64, generator=g)  # (B, H, L, D)
        k = torch.randn(1, 2, 256, 64, generator=g)  # (B, Hkv, S, D)
        v = torch.randn(1, 2, 256, 64, generator=g)
        mask = ak.sliding_window(63) & ak.causal()
        exact = ak.attention(q, k, v, mask, backend="float64")
        fast = ak.attention(q, k, v, mask)
        print(ak.explain(q, k, v, mask))
        gap = (exact - fast).abs().max().item()
        print(f"auto against float64: largest difference {gap:.2e}")
        return gap
    finally:
        unregister("float64")


if __name__ == "__main__":
    main()
