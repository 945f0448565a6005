"""Gradients of an attention call from its output and log-sum-exp, with no second forward.

With the row's output O and log-sum-exp of the whole softmax, the weights of any subset
of its keys are P = exp(s - lse), and the score gradients dS = P ⊙ (dP − rowsum(dO ⊙ O))
(plus P·dlse for a gradient of the log-sum-exp): what the CPU flash backward computes,
given O and lse. So a call's gradients, or those of any rectangle of a larger problem
(a context-parallel piece: the rows' global O and lse, a shard of keys), come from one
fused backward: one call for the whole batch where no mask is needed (`sdpa`), block by
block over the mask's spans otherwise (`tiled`, `native`). Each backend says whether its
`backward` takes a call (`Backend.serves_backward`); the backend that ran the forward
runs it where it does, else the first in the registry that does.
"""

from __future__ import annotations

from torch import Tensor

from attnkit import runtime
from attnkit.backends import Backend
from attnkit.contracts import AttentionCall

__all__ = ["fused_gradients", "serves"]


def serves(call: AttentionCall, scale: float | None) -> bool:
    """True if `fused_gradients` can take `call` (`scale` as the caller gave it: a sign
    folded into q would need the chain rule outside) and a backend's fused backward
    takes it (`serves_backward`: sdpa, native or tiled, each saying which calls)."""
    if call.is_empty or (scale is not None and scale <= 0):
        return False
    return any(b.serves_backward(call) for b in runtime.current().backends)


def fused_gradients(
    call: AttentionCall,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
    first: Backend | None = None,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """dq, dk, dv of `call` (as `normalize_call` made it) from the output and
    log-sum-exp of its rows (the call's own, or a larger problem's), in the inputs'
    dtypes; None where no backend's fused backward takes the call. `first`: the backend
    that ran the forward, asked before the others (its backward is the one `auto`
    priced the call with)."""
    others = [b for b in runtime.current().backends if b is not first]
    for backend in ([first] if first is not None else []) + others:  # then sdpa, tiled
        if backend.serves_backward(call):
            grads = backend.backward(call, out, lse, dout, dlse)
            if grads is not None:
                return grads
    return None
