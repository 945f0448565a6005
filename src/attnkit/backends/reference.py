"""Backend `reference`: materialize the mask and run the readable loop of `reference.py`."""

from __future__ import annotations

from torch import Tensor

from attnkit import cost
from attnkit.backends.protocol import Backend
from attnkit.contracts import AttentionCall
from attnkit.reference import attend

__all__ = ["ReferenceBackend"]


class ReferenceBackend(Backend):
    """Serves every call: any mask, bias, softcap, dropout, GQA, log-sum-exp, any device."""

    name = "reference"

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None:
        return None

    def cost(self, call: AttentionCall, *, need_lse: bool) -> float:
        d = call.dims
        return cost.table().reference * d.B * d.H * d.L * d.S

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int:
        d = call.dims
        return 3 * d.B * d.H * d.L * d.S * 4  # scores, their exp, the weights (float32)

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
