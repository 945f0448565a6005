"""One rank's queries against one rank's keys: the piece every strategy computes.

A rank's rows are one or two chunks of the global sequence (`Layout`), so a piece is at
most four rectangles of the global global_call, each an ordinary `attnkit` call with the
global mask seen through a `window`. A rectangle no query of which sees a key (from the
mask's key spans) is skipped, and a pair of ranks with no such rectangle exchanges
nothing. Partial results merge exactly through their log-sum-exp (`RunningMerge`).

A window keeps the global (H, L, S) with shifted indices and shifted, clipped spans, so
`tiled` still skips, a rectangle that sees every key runs unmasked and one on a causal
diagonal runs SDPA's causal kernel. `needs[r][s]` (some query of r sees some key of s)
is computed alike on every rank from the mask's structure. The merge is in the compute
dtype and NaN-safe where both parts are empty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.call.dispatch import prepared_call
from attnkit.call.functional import attention_with_lse
from attnkit.call.gradients import fused_gradients, serves
from attnkit.call.precision import compute_dtype
from attnkit.contracts import normalize_call
from attnkit.distributed.layout import Layout, Span
from attnkit.masks import Mask
from attnkit.masks.structure import key_bounds
from attnkit.masks.window import window
from attnkit.softmax import merge_partials

__all__ = ["GlobalCall", "RunningMerge"]


@dataclass(frozen=True)
class GlobalCall:
    """The global call every rank shares: sizes, mask, layout and score options."""

    mask: Mask | None
    B: int
    H: int
    Hkv: int
    D: int
    Dv: int
    layout: Layout
    scale: float | None
    softcap: float | None

    @property
    def P(self) -> int:
        return self.layout.P

    @property
    def L(self) -> int:
        return self.layout.L

    def rectangles(self, r: int, s: int) -> list[tuple[Span, Span, Mask | None]]:
        """(local rows of r, local keys of s, mask) of each rectangle where some query of
        rank r may see some key of rank s."""
        rects = []
        for lq, gq in self.layout.local_chunks(r):
            for lk, gk in self.layout.local_chunks(s):
                part = self._window(gq, gk)
                if part is None or _sees_some(part, self.B, gq[1] - gq[0], gk[1] - gk[0]):
                    rects.append((lq, lk, part))
        return rects

    def _window(self, rows: Span, cols: Span) -> Mask | None:
        if self.mask is None:
            return None
        return window(self.mask, H=self.H, L=self.L, S=self.L, rows=rows, cols=cols)

    def needs(self) -> list[list[bool]]:
        """`needs[r][s]`: some query of rank r may see some key of rank s."""
        return [[bool(self.rectangles(r, s)) for s in range(self.P)] for r in range(self.P)]

    def pairs(self, r: int, s: int) -> int:
        """Query-key pairs (per batch row and head, the most of any batch row) rank r's
        queries may see among rank s's keys, from the key spans: the work of a piece."""
        total = 0
        for (q0, q1), (k0, k1), part in self.rectangles(r, s):
            if part is None:
                total += (q1 - q0) * (k1 - k0)
                continue
            index = torch.arange(q1 - q0)
            lo, hi = key_bounds(part, self.B, q1 - q0, k1 - k0, index, index)  # (B|1, n)
            total += int((hi - lo).clamp(min=0).sum(-1).max())
        return total

    def piece(self, r: int, s: int, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Rank r's queries `q` (B, H, n, D) against rank s's `k`, `v` (B, Hkv, n, D|Dv):
        out (B, H, n, Dv) in the compute dtype and lse (B, H, n), `-inf` where unseen."""
        outs, lses = [], []
        for lq, _ in self.layout.local_chunks(r):  # each chunk of rows merges its rectangles
            acc = RunningMerge(q.shape[0], self.H, lq[1] - lq[0], self.Dv, q)
            for (q0, q1), (k0, k1), part in self.rectangles(r, s):
                if (q0, q1) == lq:
                    acc.add(
                        *attention_with_lse(
                            q[:, :, q0:q1],
                            k[:, :, k0:k1],
                            v[:, :, k0:k1],
                            part,
                            scale=self.scale,
                            softcap=self.softcap,
                        )
                    )
            outs.append(acc.out)
            lses.append(acc.lse)
        return torch.cat(outs, 2), torch.cat(lses, 2)

    def fused_backward(self, q: Tensor) -> bool:
        """True if every piece's gradients can come from the rows' global output and
        log-sum-exp (`gradients.fused_gradients`), with no piece recomputed."""
        probe = normalize_call(
            q[:, :, :1],
            q.new_empty(q.shape[0], self.Hkv, 1, self.D),
            q.new_empty(q.shape[0], self.Hkv, 1, self.Dv),
            None,
            scale=self.scale,
            softcap=self.softcap,
            dropout_p=0.0,
        )
        return serves(probe, self.scale)

    def piece_grads(
        self,
        r: int,
        s: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        dout: Tensor,
        dlse: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """dq, dk, dv (compute dtype) of rank r's queries against rank s's keys, from the
        rows' global `out`, `lse` and their gradients: one fused backward per rectangle
        (dS = P ⊙ (dP − rowsum(dO ⊙ O)), P from the global lse); None where a rectangle
        cannot take it."""
        compute = compute_dtype(q.dtype)  # piece gradients sum across pieces in float32
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (q0, q1), (k0, k1), part in self.rectangles(r, s):
            qp, kp, vp = q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1]
            prepared = prepared_call(  # the forward's piece: its plan, seen rows and keys
                qp,
                kp,
                vp,
                part,
                scale=self.scale,
                softcap=self.softcap,
                dropout_p=0.0,
                backend="auto",
                need_lse=True,
            )
            call = prepared.call(qp, kp, vp, part)
            if not serves(call, self.scale):
                return None
            lse_grad = None if dlse is None else dlse[:, :, q0:q1]
            grads = fused_gradients(
                call, out[:, :, q0:q1], lse[:, :, q0:q1], dout[:, :, q0:q1], lse_grad
            )
            if grads is None:
                return None
            dq[:, :, q0:q1] += grads[0]
            dk[:, :, k0:k1] += grads[1]
            dv[:, :, k0:k1] += grads[2]
        return dq, dk, dv


def _sees_some(mask: Mask, B: int, L: int, S: int) -> bool:
    """Some row of the rectangle may see some key, from the key spans (loose: a span
    may hold only hidden keys, then the piece computes zeros)."""
    zero = torch.zeros(1, dtype=torch.long)
    lo, hi = key_bounds(mask, B, L, S, zero, zero + L - 1)  # (B|1, 1)
    return bool((hi > lo).any())


class RunningMerge:
    """Attention over disjoint key sets merged as they come: a running output and
    log-sum-exp in the compute dtype (float32 for half inputs), exact at every step."""

    def __init__(self, B: int, H: int, n: int, Dv: int, like: Tensor) -> None:
        self.shape, self.like = (B, H, n, Dv), like
        self._out: Tensor | None = None  # (B, H, n, Dv)
        self._lse: Tensor | None = None  # (B, H, n)

    @property
    def out(self) -> Tensor:
        if self._out is None:
            return self.like.new_zeros(self.shape, dtype=compute_dtype(self.like.dtype))
        return self._out

    @property
    def lse(self) -> Tensor:
        if self._lse is None:
            dtype = compute_dtype(self.like.dtype)
            return self.like.new_full(self.shape[:3], -math.inf, dtype=dtype)
        return self._lse

    def add(self, out: Tensor, lse: Tensor) -> None:
        """Merge attention over more keys: `out` (B, H, n, Dv), `lse` (B, H, n)."""
        dtype = compute_dtype(self.like.dtype)
        out, lse = out.to(dtype), lse.to(dtype)
        if self._out is None or self._lse is None:  # the first part is the result so far
            self._out, self._lse = out, lse
            return
        self._out, self._lse = merge_partials([self._out, out], [self._lse, lse])
