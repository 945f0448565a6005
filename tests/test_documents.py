"""`attention` with packed documents: each document gives the bits it gets alone,
whatever is packed beside it and in whatever order (`attnkit.call.documents`), and the same
result as the reference."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.call.documents import documents

LENGTHS = [37, 120, 1, 64, 5, 200]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
POSITIONAL = {
    "alone": None,
    "causal": ak.causal(),
    "window": ak.sliding_window(7),
    "causal_window": ak.causal() & ak.sliding_window(3, 2),
}


def _docs(lengths, dtype, H=4, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(1, h, n, D, generator=g).to(dtype) for h in (H, Hkv, Hkv, H)] for n in lengths
    ]


def _run(docs, order, positional):
    """Pack the documents of `order` in one row; each one's out, lse and grads by index."""
    inputs = [torch.cat([docs[i][j] for i in order], dim=2).requires_grad_() for j in range(3)]
    dout = torch.cat([docs[i][3] for i in order], dim=2)
    ids = torch.cat([torch.full((docs[i][0].shape[2],), n) for n, i in enumerate(order)])
    mask = ak.document(ids) if positional is None else ak.document(ids) & positional
    out, lse = ak.attention_with_lse(*inputs, mask)
    grads = torch.autograd.grad(out, inputs, dout)
    found, at = {}, 0
    for i in order:
        rows = slice(at, at + docs[i][0].shape[2])
        found[i] = [out[:, :, rows], lse[:, :, rows], *(g[:, :, rows] for g in grads)]
        at = rows.stop
    return found, (inputs, mask, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("positional", POSITIONAL.values(), ids=POSITIONAL.keys())
def test_a_document_gets_the_same_bits_in_any_pack(dtype, positional):
    docs = _docs(LENGTHS, dtype)
    first, (inputs, mask, out) = _run(docs, range(len(LENGTHS)), positional)
    for order in ([5, 2, 4, 0, 3, 1], [1, 3], [3]):
        again, _ = _run(docs, order, positional)
        for i in order:
            for a, b in zip(first[i], again[i], strict=True):
                assert torch.equal(a, b), f"document {i}"
    want = ak.attention(*(t.double() for t in inputs), mask, backend="reference")
    torch.testing.assert_close(out.double(), want, **_tolerance(dtype))


def _tolerance(dtype):
    return {
        torch.float64: {},
        torch.float32: {"atol": 1e-5, "rtol": 1e-4},
        torch.float16: {"atol": 4e-3, "rtol": 4e-3},
        torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    }[dtype]


def test_batch_rows_each_cut_by_their_own_documents():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 10, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ids = torch.tensor([[0] * 3 + [1] * 7, [0] * 6 + [1] * 4])
    mask = ak.document(ids) & ak.causal()
    torch.testing.assert_close(
        ak.attention(q, k, v, mask), ak.attention(q, k, v, mask, backend="reference")
    )
    assert documents(mask, q, k).lengths == [[3, 7], [6, 4]]


@pytest.mark.parametrize(
    "mask",
    [
        ak.document(torch.tensor([0, 1, 0, 1])),  # a document in two runs: one call
        ak.document(torch.tensor([0, 0, 1, 1])) & ak.chunked(2),  # absolute positions
        ak.document(torch.tensor([0, 0, 1, 1])) & ak.prefix_lm(1),
        ak.document(torch.tensor([0, 0, 1, 1])) | ak.causal(),
        ak.causal(),
    ],
)
def test_other_masks_keep_the_one_call(mask):
    q = k = torch.randn(1, 1, 4, 8)
    assert documents(mask, q, k) is None


@pytest.mark.parametrize("D", [5, 6, 7])
def test_head_dims_off_the_vector_width_keep_a_documents_bits(D):
    """Each document runs on its own copy (`documents.aligned_copy`): a view at another
    memory offset is rounded differently by the kernels (found: AVX512, D = 5..7)."""
    docs = _docs([3, 7, 1, 5], torch.float32, H=9, Hkv=3, D=D, seed=D)

    def packed(order):  # each document's output, by its index (forward only, no grad)
        q, k, v = (torch.cat([docs[i][j] for i in order], dim=2) for j in range(3))
        ids = torch.cat([torch.full((docs[i][0].shape[2],), n) for n, i in enumerate(order)])
        with torch.no_grad():
            out = ak.attention(q, k, v, ak.document(ids) & ak.sliding_window(3, 2))
        sizes = [docs[i][0].shape[2] for i in order]
        return dict(zip(order, torch.split(out, sizes, dim=2), strict=True))

    first = packed(range(4))
    for order in ([3, 2, 1, 0], [1], [2, 1]):
        for i, out in packed(order).items():
            assert torch.equal(out, first[i]), f"document {i}"


def test_explain_names_the_backend_each_document_runs_on():
    """Packed documents run one call per document: the plan is headed by the backend those
    calls run on (a document alone's), the note counts them, sizes and work the row's."""
    n, docs = 96, 4
    q = torch.randn(1, 2, n * docs, 16)
    ids = torch.arange(n * docs) // n
    plan = ak.explain(q, q, q, ak.document(ids) & ak.causal())
    alone = ak.explain(q[:, :, :n], q[:, :, :n], q[:, :, :n], ak.causal())
    assert plan.backend == alone.backend and plan.reasons == alone.reasons
    assert f"documents per backend: {alone.backend} {docs}" in plan.notes[0]
    assert plan.shapes["q"] == (1, 2, n * docs, 16)
    assert plan.flops == docs * alone.flops
