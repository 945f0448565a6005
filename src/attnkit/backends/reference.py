"""Backend `reference`: materialize the mask and run the readable loop of `reference.py`."""

from __future__ import annotations

from torch import Tensor

from attnkit.backends.protocol import Backend, Probe
from attnkit.call import cost
from attnkit.contracts import AttentionCall
from attnkit.masks import causal
from attnkit.reference import attend

__all__ = ["ReferenceBackend"]


class ReferenceBackend(Backend):
    """Serves every call: any mask, bias, softcap, dropout, GQA, log-sum-exp, any device."""

    name = "reference"
    values_exact = True
    # per pair: the readable loop materializes (B, H, L, S) scores; `call` per call (the
    # mask made dense, a dozen operators and their Python: `attnkit calibrate` times it on
    # a tiny call); `backward`: autograd through its four steps, forward+backward over
    # forward (estimated, not timed)
    cost_factors = cost.Factors(
        {"pair": 6.0, "call": 200_000.0, "backward": 3.0}, {"amx": {"pair": 4.20}}
    )

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None:
        return None

    def cost(self, call: AttentionCall, *, need_lse: bool) -> float:
        d, factors = call.dims, self.factors(call.table)
        return factors["pair"] * d.B * d.H * d.L * d.S + factors["call"]

    def calibrate(self, probe: Probe) -> dict[str, float]:
        """Per call from a tiny causal call, net of its pairs; per pair from a small one,
        net of the call."""
        return self.timed_call_and_pair(probe, causal())

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int:
        d = call.dims
        return 3 * d.B * d.H * d.L * d.S * 4  # scores, their exp, the weights (float32)

    def intermediates(self, call: AttentionCall) -> dict[str, tuple[int, ...]]:
        d = call.dims
        return {"scores": (d.B, d.H, d.L, d.S)}

    def run(self, call: AttentionCall, *, need_lse: bool) -> tuple[Tensor, Tensor | None]:
        d = call.dims
        visible = None if call.mask is None else call.mask.dense(d.B, d.H, d.L, d.S, call.q.device)
        out, _, lse = attend(
            call.q,
            call.k,
            call.v,
            visible,
            call.bias,
            scale=call.scale,
            softcap=call.softcap,
            dropout_p=call.dropout_p,
        )
        return out, lse if need_lse else None
