"""Masked softmax and the log-sum-exp math (`attnkit.softmax`)."""

from __future__ import annotations

import torch

import attnkit as ak
from attnkit.softmax import merge_partials
from helpers import small_qkv


def test_merge_partials_of_rows_no_part_saw_has_zero_gradients():
    """logsumexp of all -inf had a NaN gradient; it reached every part's lse (and q, k
    behind them) even when only the output was used."""
    g = torch.Generator().manual_seed(0)
    outs = [torch.randn(1, 2, 3, 4, generator=g, requires_grad=True) for _ in range(2)]
    lses = [torch.randn(1, 2, 3, generator=g) for _ in range(2)]
    for lse in lses:
        lse[0, 1, 2] = -torch.inf  # head 1, row 2: empty in every part
    lses[0][0, 0, 0] = -torch.inf  # head 0, row 0: empty in one part only
    lses = [lse.requires_grad_() for lse in lses]
    out, lse = merge_partials(outs, lses)
    assert lse[0, 1, 2] == -torch.inf and (out[0, 1, 2] == 0).all()
    finite = torch.where(torch.isfinite(lse), lse, 0.0)
    grads = torch.autograd.grad(out.sum() + finite.sum(), [*outs, *lses])
    assert all(torch.isfinite(grad).all() for grad in grads)
    assert all(grad[0, 1, 2].abs().sum() == 0 for grad in grads)
    assert grads[2][0, 0, 0] == 0 and grads[3][0, 0, 0] != 0  # the seen part carries it


def test_merge_partials_of_disjoint_key_sets_is_exact():
    q, k, v = small_qkv(B=2, H=4, Hkv=2, L=7, S=7)
    left = ak.key_padding(torch.tensor([3, 3]))
    out_a, lse_a = ak.attention_with_lse(q, k, v, left & ak.causal())
    out_b, lse_b = ak.attention_with_lse(q, k, v, ~left & ak.causal())
    out, lse = merge_partials([out_a, out_b], [lse_a, lse_b])
    full, full_lse = ak.attention_with_lse(q, k, v, ak.causal())
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, full_lse)
