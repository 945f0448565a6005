"""attnkit.flash_attn's packed forms (`flash_attn_qkvpacked_func`, `flash_attn_kvpacked_func`,
`flash_attn_varlen_qkvpacked_func`, `flash_attn_varlen_kvpacked_func`): each is its unpacked
call on views of the packed tensor, bitwise, forward and backward (the gradients land in
the packed tensor), and agrees with the float64 formula of flash-attention's conventions."""

from __future__ import annotations

import pytest
import torch

from attnkit import ShapeContractError
from attnkit.flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from fuzz_dropins import cumulative
from fuzz_dropins import flash_formula as formula

PACKED = ["qkvpacked", "kvpacked", "varlen qkvpacked", "varlen kvpacked"]
PACKED_OPTIONS = {"softmax_scale": 0.4, "causal": True, "window_size": (3, -1), "softcap": 1.5}
LEN_Q, LEN_K = [3, 5, 0], [6, 2, 4]  # varlen; qkvpacked packs LEN_Q for queries and keys


def _packed_leaves(form, g):
    """The tensors a packed call takes: [qkv] or [q, kv], and the packed dim."""
    H, Hkv, D = 4, 2, 8
    if form == "qkvpacked":
        return [torch.randn(2, 5, 3, H, D, generator=g)], 2  # (B, L, 3, H, D)
    if form == "kvpacked":
        return [torch.randn(2, 5, H, D, generator=g), torch.randn(2, 7, 2, Hkv, D, generator=g)], 2
    if form == "varlen qkvpacked":
        return [torch.randn(sum(LEN_Q), 3, H, D, generator=g)], 1  # (T, 3, H, D)
    return [
        torch.randn(sum(LEN_Q), H, D, generator=g),
        torch.randn(sum(LEN_K), 2, Hkv, D, generator=g),
    ], 1


def _split(leaves, dim):
    """q, k, v as views of the packed leaves."""
    return (*leaves[:-1], *leaves[-1].unbind(dim))


def _lengths_of(form):
    return LEN_Q, LEN_Q if form == "varlen qkvpacked" else LEN_K


def _call_packed(form, leaves):
    (len_q, len_k), opts = _lengths_of(form), {**PACKED_OPTIONS, "return_attn_probs": True}
    cu_q, cu_k = cumulative(len_q), cumulative(len_k)
    if form == "qkvpacked":
        return flash_attn_qkvpacked_func(*leaves, **opts)
    if form == "kvpacked":
        return flash_attn_kvpacked_func(*leaves, **opts)
    if form == "varlen qkvpacked":
        return flash_attn_varlen_qkvpacked_func(*leaves, cu_q, max(len_q), **opts)
    return flash_attn_varlen_kvpacked_func(*leaves, cu_q, cu_k, max(len_q), max(len_k), **opts)


def _call_unpacked(form, q, k, v):
    (len_q, len_k), opts = _lengths_of(form), {**PACKED_OPTIONS, "return_attn_probs": True}
    if not form.startswith("varlen"):
        return flash_attn_func(q, k, v, **opts)
    return flash_attn_varlen_func(
        q, k, v, cumulative(len_q), cumulative(len_k), max(len_q), max(len_k), **opts
    )


def _truth(form, q, k, v):
    """The float64 formula: per batch row, or per packed sequence."""
    opts = {"scale": 0.4, "causal": True, "window": (3, -1), "softcap": 1.5}
    if not form.startswith("varlen"):
        rows = [formula(q[b], k[b], v[b], **opts) for b in range(q.shape[0])]
        return torch.stack([o for o, _ in rows]), torch.stack([m for _, m in rows])
    (len_q, len_k) = _lengths_of(form)
    cu_q, cu_k = cumulative(len_q), cumulative(len_k)
    rows = [
        formula(
            q[cu_q[n] : cu_q[n + 1]], k[cu_k[n] : cu_k[n + 1]], v[cu_k[n] : cu_k[n + 1]], **opts
        )
        for n in range(len(len_q))
    ]
    return torch.cat([o for o, _ in rows]), torch.cat([m for _, m in rows], dim=1)


@pytest.mark.parametrize("form", PACKED)
def test_packed_forms_are_the_unpacked_call_bitwise_and_match_the_formula(form):
    g = torch.Generator().manual_seed(12)
    leaves, dim = _packed_leaves(form, g)
    leaves = [t.requires_grad_() for t in leaves]
    out, lse, none = _call_packed(form, leaves)
    parts = [t.detach().clone().requires_grad_() for t in _split(leaves, dim)]  # own leaves
    want_out, want_lse, _ = _call_unpacked(form, *parts)
    assert none is None and torch.equal(out, want_out) and torch.equal(lse, want_lse)
    dout = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, leaves, dout)  # into the packed tensor
    apart = torch.autograd.grad(want_out, parts, dout)
    assert torch.equal(grads[-1], torch.stack(apart[len(leaves) - 1 :], dim))
    assert len(leaves) == 1 or torch.equal(grads[0], apart[0])
    wide = [t.detach().double().requires_grad_() for t in leaves]
    truth, truth_lse = _truth(form, *_split(wide, dim))
    torch.testing.assert_close(out, truth.float())
    torch.testing.assert_close(lse, truth_lse.float())
    expected = torch.autograd.grad(truth, wide, dout.double())
    for got, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, e.float())


def test_packed_forms_name_the_layout_they_expected():
    kv = torch.randn(2, 5, 2, 4, 8)  # (B, S, 2, Hkv, D): a kv given where qkv is expected
    with pytest.raises(ShapeContractError, match=r"qkv must be \(B, L, 3, H, D\)"):
        flash_attn_qkvpacked_func(kv)
    q, qkv = torch.randn(5, 4, 8), torch.randn(5, 3, 4, 8)  # a qkv where kv is expected
    with pytest.raises(ShapeContractError, match=r"kv must be \(T_k, 2, Hkv, D\)"):
        flash_attn_varlen_kvpacked_func(q, qkv, cumulative([5]), cumulative([5]), 5, 5)
    with pytest.raises(ShapeContractError, match=r"got \(5, 4, 8\)"):  # unpacked
        flash_attn_varlen_qkvpacked_func(q, cumulative([5]), 5)
