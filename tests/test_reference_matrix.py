"""Every backend against a float64 run of the reference, outputs and gradients.

The flash-attention rule: a backend's error against float64 is at most 2x the error of
the naive computation in the same dtype (plus a small floor): attnkit's reference for
float32; for half, `naive_same_dtype` (each op rounded to half, as a half PyTorch program
computes). Inputs are drawn in the test dtype; the float64 truth is computed from those
same (rounded) inputs. Half runs on the fused kernels natively and in float32 (both
paths exist; the hardware picks one, `attnkit.call.precision.HalfKernels`).
"""

from __future__ import annotations

import functools
import zlib

import pytest
import torch

import attnkit as ak
from helpers import assert_rule, half_kernels, naive_same_dtype

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}
SIZES = [(1, 1), (97, 97), (1025, 1025), (1, 97), (97, 1025), (1025, 97)]  # (L, S)
B = 2


def _align(L: int, S: int) -> str | None:
    return None if L == S else "bottom_right"


def _ids(n: int, pieces: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randint(0, n, (pieces - 1,), generator=g)
    return (torch.arange(n)[:, None] >= cuts[None, :]).sum(-1)  # (n,) sorted ids


def make_mask(kind: str, H: int, L: int, S: int) -> ak.Mask | torch.Tensor | None:
    """One mask of each kind; several give empty rows (query sees nothing)."""
    g = torch.Generator().manual_seed(L * 131 + S)
    align = _align(L, S)
    lengths = torch.tensor([S - S // 3, 0])  # batch row 1 sees no key at all
    left_pad = torch.arange(S)[None, :] >= torch.tensor([[0], [S // 2]])  # (B, S)
    kv_ids = _ids(S, 4, L + S)
    q_ids = kv_ids[S - L :] if L <= S else torch.cat([kv_ids.new_zeros(L - S), kv_ids])
    masks = {
        "none": lambda: None,
        "causal": lambda: ak.causal(align=align),
        "causal_top_left": lambda: ak.causal(align="top_left"),
        "padding": lambda: ak.key_padding(lengths),
        "causal_left_padding": lambda: ak.causal(align=align) & ak.key_padding(left_pad),
        "sliding": lambda: ak.sliding_window(16, align=align),
        "sliding_two_sided": lambda: ak.sliding_window(8, 4, align=align),
        "documents_causal": lambda: ak.document(q_ids, kv_ids) & ak.causal(align=align),
        "prefix_lm": lambda: ak.prefix_lm(max(1, S // 4), align=align),
        "from_mod_per_head": lambda: ak.Mask.from_mod(
            lambda b, h, i, j: (j <= i + S - L + h) & ((i + 2 * j + b) % 3 != 0)
        ),
        "chunked_causal_offset": lambda: (
            ak.chunked(16, offset=S - L + 3) & ak.causal(offset=S - L + 3)
        ),
        "window_or_prefix_padded": lambda: (
            (ak.sliding_window(4, align=align) | ak.prefix_lm(3, align=align))
            & ak.key_padding(lengths)
        ),
        "documents_alibi": lambda: (
            ak.document(q_ids, kv_ids) & ak.causal(align=align) & ak.alibi(H, align=align)
        ),
        "bool_tensor": lambda: torch.rand(B, 1, L, S, generator=g) > 0.3,
        "float_bias": lambda: torch.randn(1, H, L, S, generator=g).masked_fill(
            torch.rand(1, H, L, S, generator=g) < 0.2, -torch.inf
        ),
    }
    return masks[kind]()


MASKS = [
    "none",
    "causal",
    "causal_top_left",
    "padding",
    "causal_left_padding",
    "sliding",
    "sliding_two_sided",
    "documents_causal",
    "prefix_lm",
    "chunked_causal_offset",
    "from_mod_per_head",
    "window_or_prefix_padded",
    "documents_alibi",
    "bool_tensor",
    "float_bias",
]
FAST_LARGE = {"causal", "causal_left_padding", "documents_causal", "float_bias"}


@functools.lru_cache(maxsize=8)
def truth_and_reference(dtype, heads, mask_kind, size, D):
    """Inputs, the float64 truth and the same-dtype reference: outputs and gradients."""
    H, Hkv = HEADS[heads]
    L, S = size
    g = torch.Generator().manual_seed(zlib.crc32(f"{heads}{mask_kind}{size}{D}".encode()))
    q = torch.randn(B, H, L, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    dout = torch.randn(B, H, L, D, generator=g).to(dtype)
    mask = make_mask(mask_kind, H, L, S)
    truth = run(
        q.double(), k.double(), v.double(), _cast(mask, torch.float64), dout.double(), "reference"
    )
    if dtype in (torch.float16, torch.bfloat16):
        ref = naive_same_dtype(q, k, v, mask, dout, dtype)
    else:
        ref = run(q, k, v, mask, dout, "reference")
    return (q, k, v, mask, dout), truth, ref


def _cast(mask, dtype):
    return mask.to(dtype) if isinstance(mask, torch.Tensor) and mask.is_floating_point() else mask


def run(q, k, v, mask, dout, backend):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = ak.attention(q, k, v, mask, backend=backend)
    (out * dout).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _cases():
    for dtype in DTYPES:
        for heads in HEADS:
            for mask_kind in MASKS:
                for size in SIZES:
                    big = max(size) > 1000
                    slow = big and mask_kind not in FAST_LARGE
                    marks = [pytest.mark.slow] if slow else []
                    yield pytest.param(
                        dtype,
                        heads,
                        mask_kind,
                        size,
                        64,
                        marks=marks,
                        id=f"{str(dtype)[6:]}-{heads}-{mask_kind}-L{size[0]}-S{size[1]}-D64",
                    )
    for dtype in DTYPES:
        for heads in HEADS:
            for D in (40, 72):
                for mask_kind in ("causal", "padding", "documents_causal"):
                    for size in SIZES:
                        slow = max(size) > 1000 and heads != "GQA"
                        yield pytest.param(
                            dtype,
                            heads,
                            mask_kind,
                            size,
                            D,
                            marks=[pytest.mark.slow] if slow else [],
                            id=f"{str(dtype)[6:]}-{heads}-{mask_kind}-L{size[0]}-S{size[1]}-D{D}",
                        )


def _backend_cases():
    """Every backend on every case. In `make test`, sizes over 1000 skip `blockwise` (the
    reference's math, as slow) and `reference` in half precision (its half path is the
    same code at every size; the small sizes check it); `make test-slow` runs them all."""
    for backend in ("reference", "sdpa", "tiled", "blockwise"):
        for case in _cases():
            size, half = case.values[3], case.values[0] in (torch.float16, torch.bfloat16)
            slow = max(size) > 1000 and (
                backend == "blockwise" or (backend == "reference" and half)
            )
            marks = [*case.marks, pytest.mark.slow] if slow else list(case.marks)
            yield pytest.param(backend, *case.values, marks=marks, id=f"{case.id}-{backend}")


@pytest.mark.parametrize(
    ("backend", "dtype", "heads", "mask_kind", "size", "D"), list(_backend_cases())
)
def test_backend_matches_float64_reference(backend, dtype, heads, mask_kind, size, D):
    (q, k, v, mask, dout), truth, ref = truth_and_reference(dtype, heads, mask_kind, size, D)
    if backend == "tiled" and mask_kind == "float_bias":
        with pytest.raises(ValueError, match="additive float bias tensor has no structure"):
            run(q, k, v, mask, dout, backend)
        return
    if backend == "tiled" and mask_kind == "from_mod_per_head":
        with pytest.raises(ValueError, match="the mask differs between heads"):
            run(q, k, v, mask, dout, backend)
        return
    # half: both kernel paths, whichever this machine's hardware would pick
    modes = ["native", "float32"] if dtype in (torch.float16, torch.bfloat16) else ["auto"]
    for mode in modes:
        with pytest.MonkeyPatch.context() as patch:
            half_kernels(patch, mode)
            got = run(q, k, v, mask, dout, backend)
        for name, g, r, t in zip(("out", "dq", "dk", "dv"), got, ref, truth, strict=True):
            assert g.dtype == dtype and g.shape == t.shape
            assert_rule(f"{backend} ({mode} kernels) {name}", g, r, t)
