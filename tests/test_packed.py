"""Packed sequences: a sequence's outputs, lse and gradients are bitwise the same
whatever else is packed with it and in whatever order (`attnkit.dropins.packed`), for
`varlen_attn` and `flash_attn_varlen_func`, every dtype, windows, GQA, ALiBi."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.dropins import AuxRequest, varlen_attn
from attnkit.dropins.packed import window_mask
from attnkit.flash_attn import flash_attn_varlen_func
from fuzz_dropins import flash_formula

LENGTHS = [37, 120, 1, 64, 0, 5, 200]  # unaligned, a single row, an empty sequence
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
WINDOWS = [(-1, -1), (-1, 0), (3, 1), (2, -1)]


def _sequences(lengths, H, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(n, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv)]
        + [torch.randn(n, H, D, generator=g).to(dtype)]  # the output's gradient
        for n in lengths
    ]


def _run(call, sequences, order):
    """Pack `sequences` in `order`, run `call(q, k, v, cu)`, and give each sequence's
    out, lse and gradients back by its own index."""
    picked = [sequences[i] for i in order]
    inputs = [torch.cat([s[j] for s in picked]).requires_grad_() for j in range(3)]
    dout = torch.cat([s[3] for s in picked])
    lengths = torch.tensor([len(s[0]) for s in picked])
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    out, lse = call(*inputs, cu)  # (T, H, D), (T, H)
    grads = torch.autograd.grad(out, inputs, dout)
    found, at = {}, 0
    for i, n in zip(order, lengths.tolist(), strict=True):
        rows = slice(at, at + n)
        found[i] = [out[rows], lse[rows], *(g[rows] for g in grads)]
        at += n
    return found


def _same_bits(a, b):
    for i in b:
        for x, y in zip(a[i], b[i], strict=True):
            assert torch.equal(x, y), f"sequence {i}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_varlen_gives_each_sequence_the_same_bits_in_any_pack(dtype, window):
    sequences = _sequences(LENGTHS, 4, 2, 16, dtype)

    def call(q, k, v, cu):
        return varlen_attn(
            q,
            k,
            v,
            cu,
            cu,
            200,
            200,
            window_size=window,
            enable_gqa=True,
            return_aux=AuxRequest(lse=True),
        )

    first = _run(call, sequences, range(len(LENGTHS)))
    _same_bits(first, _run(call, sequences, [6, 2, 4, 0, 5, 3, 1]))
    _same_bits(first, _run(call, sequences[:3], [1, 0, 2]))  # fewer beside it
    alone = _run(call, sequences, [1])
    torch.testing.assert_close(alone[1][0], first[1][0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alibi", [None, "per_head", "per_sequence"])
def test_flash_varlen_gives_each_sequence_the_same_bits_in_any_pack(dtype, alibi):
    sequences = _sequences(LENGTHS, 4, 4, 16, dtype, seed=1)
    slopes = {
        None: None,
        "per_head": torch.tensor([0.5, 0.25, 0.125, 0.0625]),
        "per_sequence": torch.rand(len(LENGTHS), 4, generator=torch.Generator().manual_seed(2)),
    }[alibi]

    def call_in(order):
        def call(q, k, v, cu):
            by_order = slopes[list(order)] if alibi == "per_sequence" else slopes
            out, lse, _ = flash_attn_varlen_func(
                q,
                k,
                v,
                cu,
                cu,
                200,
                200,
                causal=True,
                softcap=5.0,
                alibi_slopes=by_order,
                return_attn_probs=True,
            )
            return out, lse.transpose(0, 1)

        return _run(call, sequences, order)

    order = [3, 6, 0, 5, 1, 4, 2]
    _same_bits(call_in(range(len(LENGTHS))), call_in(order))


@pytest.mark.parametrize("window", [*WINDOWS, (0, 0), (1, 2)])
@pytest.mark.parametrize(("L", "S"), [(4, 4), (3, 7), (7, 3), (1, 5), (5, 0)])
def test_window_mask_is_flash_attentions_window(window, L, S):
    mask = window_mask(window, L, S)
    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64) for n in (L, S, S))
    got = ak.attention(q, k, v, mask)[0].transpose(0, 1)  # (L, H, D)
    want, _ = flash_formula(
        q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), window=window
    )
    torch.testing.assert_close(got, want)


def test_bad_offsets_are_refused_naming_them():
    q = k = v = torch.randn(6, 2, 4)
    with pytest.raises(ValueError, match=r"cu_seq_k must rise within the 6 packed keys"):
        varlen_attn(q, k, v, torch.tensor([0, 3, 6]), torch.tensor([0, 3, 9]), 3, 3)
    with pytest.raises(ValueError, match=r"seqused_k must give each of the 2 sequences"):
        varlen_attn(
            q,
            k,
            v,
            torch.tensor([0, 3, 6]),
            torch.tensor([0, 3, 6]),
            3,
            3,
            seqused_k=torch.tensor([3, 4]),
        )
    with pytest.raises(ValueError, match=r"both hold N \+ 1 offsets"):
        varlen_attn(q, k, v, torch.tensor([0, 3, 6]), torch.tensor([0, 6]), 3, 3)


@pytest.mark.parametrize("D", [5, 6, 7])
def test_head_dims_off_the_vector_width_keep_the_bits_in_any_pack(D):
    """A sequence's rows start anywhere in the pack; the kernels round a view at another
    memory offset differently (found: AVX512, D = 5..7), so each sequence runs on its
    own copy."""
    lengths = [0, 3, 1, 7, 2]
    sequences = _sequences(lengths, 9, 3, D, torch.float32, seed=D)

    def packed(order):  # each sequence's output, by its index (forward only, no grad)
        q, k, v = (torch.cat([sequences[i][j] for i in order]) for j in range(3))
        cu = torch.tensor([0, *torch.tensor([lengths[i] for i in order]).cumsum(0)])
        with torch.no_grad():
            out = varlen_attn(
                q, k, v, cu.int(), cu.int(), 7, 7, window_size=(3, 2), enable_gqa=True
            )
        return dict(zip(order, torch.split(out, [lengths[i] for i in order]), strict=True))

    first = packed(range(5))
    for order in ([4, 3, 2, 1, 0], [3], [2, 3]):
        for i, out in packed(order).items():
            assert torch.equal(out, first[i]), f"sequence {i}"
