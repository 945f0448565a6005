"""Backend `sdpa`: PyTorch's fused `F.scaled_dot_product_attention`.

SDPA alone gets three things wrong for us, which this file fixes around it: masked keys
holding NaN leak through `0 * NaN`, it returns no log-sum-exp, and a row that sees
nothing has no defined output. Top-left causal masks run as `is_causal=True`, with no
mask tensor at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import cost
from attnkit._compat import cpu_flash_attention
from attnkit.contracts import AttentionCall
from attnkit.heads import repeat_kv
from attnkit.reference import effective_visibility, hide_unseen
from attnkit.softmax import compute_dtype

__all__ = ["SdpaBackend"]


def _attn_mask(
    visible: Tensor | None, bias: Tensor | None, dtype: torch.dtype, as_float: bool
) -> Tensor | None:
    """SDPA's `attn_mask`: bool (True = attend) or an additive float of q's dtype."""
    if bias is None and (visible is None or not as_float):
        return visible
    if bias is not None:
        additive = bias.to(dtype)
    else:
        assert visible is not None
        additive = torch.zeros((), dtype=dtype, device=visible.device)
    return additive if visible is None else torch.where(visible, additive, -torch.inf)


class SdpaBackend:
    """Fused kernels from PyTorch; no softcap; log-sum-exp on CPU through the flash op."""

    name = "sdpa"

    def can_use(self, call: AttentionCall, *, need_lse: bool) -> str | None:
        if call.softcap is not None:
            return "F.scaled_dot_product_attention has no softcap"
        if need_lse:
            if call.q.device.type != "cpu" or cpu_flash_attention() is None:
                return f"SDPA returns no log-sum-exp on {call.q.device.type} in this torch"
            if call.dropout_p > 0:
                return "the CPU flash kernel that returns the log-sum-exp has no dropout"
            if call.dims.D != call.dims.Dv:
                return "the CPU flash kernel that returns the log-sum-exp needs D == Dv"
            if call.requires_grad:
                return "the log-sum-exp of the CPU flash kernel carries no gradient"
        return None

    def cost(self, call: AttentionCall, *, need_lse: bool) -> float:
        d = call.dims
        pairs = d.B * d.H * d.L * d.S
        if self._is_causal(call):
            return cost.SDPA_CAUSAL * pairs / 2
        masked = call.mask is not None or call.has_bias
        return (cost.SDPA_MASKED if masked else cost.SDPA_DENSE) * pairs

    @staticmethod
    def _is_causal(call: AttentionCall) -> bool:
        d = call.dims
        return call.mask is not None and not call.has_bias and call.mask.is_sdpa_causal(d.L, d.S)

    def peak_bytes(self, call: AttentionCall, *, need_lse: bool) -> int:
        d = call.dims
        if self._is_causal(call):
            return 0
        batch = d.B if call.mask is not None and call.mask.batch_size else 1
        if call.has_bias or need_lse:  # an additive mask in q's dtype
            return batch * d.H * d.L * d.S * call.q.element_size()
        return batch * d.L * d.S  # a bool mask, broadcast over heads

    def run(self, call: AttentionCall, *, need_lse: bool) -> tuple[Tensor, Tensor | None]:
        d = call.dims
        q, k, v, rows, attn_mask = call.q, call.k, call.v, None, None
        if q.device.type == "cpu":
            # PyTorch's CPU kernels sum GQA key/value gradients in half precision; computing
            # in float32 keeps DESIGN.md's numerics at O(B·H·L·D) cost for the casts.
            work = compute_dtype(q.dtype)
            q, k, v = q.to(work), k.to(work), v.to(work)
        is_causal = self._is_causal(call)
        if (call.mask is not None and not is_causal) or call.has_bias:
            visible = (
                None if call.mask is None else call.mask.dense(d.B, d.H, d.L, d.S, q.device)
            )  # (B|1, H|1, L, S)
            q, k, v, rows = hide_unseen(q, k, v, effective_visibility(visible, call.bias))
            attn_mask = _attn_mask(visible, call.bias, q.dtype, as_float=need_lse)
        lse = None
        if need_lse:
            flash = cpu_flash_attention()
            assert flash is not None  # can_use refused the call otherwise
            k, v = repeat_kv(k, d.groups), repeat_kv(v, d.groups)  # the op has no GQA
            out, lse = flash(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=call.scale)
        else:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=call.dropout_p,
                is_causal=is_causal,
                scale=call.scale,
                enable_gqa=d.groups > 1,
            )  # (B, H, L, Dv)
        if rows is not None:
            out = torch.where(rows.unsqueeze(-1), out, 0.0)
            lse = None if lse is None else torch.where(rows, lse, -torch.inf)
        return out.to(call.q.dtype), lse
