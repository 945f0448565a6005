"""`window`: a rectangle of a global mask equals that slice of the global mask, with
spans (and the shortcuts they allow) that agree with it."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.call import dispatch
from attnkit.masks import as_mask
from attnkit.masks.spans import exact_spans
from attnkit.masks.structure import dense_bias, is_sdpa_causal, key_bounds
from attnkit.masks.window import window

B, H, L, S = 2, 3, 20, 20
DOCS = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4, [0] * 12 + [1] * 8])
MASKS = {
    "causal": ak.causal(),
    "causal_offset": ak.causal(offset=-3),
    "window": ak.sliding_window(4, 1),
    "chunked": ak.chunked(6) & ak.causal(),
    "documents": ak.document(DOCS) & ak.causal(),
    "prefix": ak.prefix_lm(torch.tensor([3, 9])),
    "padding": ak.key_padding(torch.tensor([20, 11])) | ak.causal(),
    "alibi": ak.alibi(H) & ak.sliding_window(5),
    "tensor": torch.rand(B, H, L, S, generator=torch.Generator().manual_seed(0)) < 0.4,
}
RECTANGLES = [
    ((0, 20), (0, 20), (0, 3)),
    ((5, 15), (0, 10), (0, 3)),
    ((10, 20), (3, 8), (1, 2)),
    ((0, 4), (12, 20), (0, 3)),
    ((7, 8), (0, 20), (2, 3)),
]


@pytest.mark.parametrize("name", MASKS)
@pytest.mark.parametrize(("rows", "cols", "heads"), RECTANGLES)
def test_a_window_is_the_slice_of_the_global_mask(name, rows, cols, heads):
    mask = as_mask(MASKS[name])
    part = window(mask, H=H, L=L, S=S, rows=rows, cols=cols, heads=heads)
    n, m, h = rows[1] - rows[0], cols[1] - cols[0], heads[1] - heads[0]
    full = mask.materialize(B, H, L, S)[
        :, heads[0] : heads[1], rows[0] : rows[1], cols[0] : cols[1]
    ]
    assert torch.equal(part.materialize(B, h, n, m), full)
    if mask.has_bias:
        got = dense_bias(part, B, h, n, m).expand(B, h, n, m)
        want = dense_bias(mask, B, H, L, S).expand(B, H, L, S)
        assert torch.equal(got, want[:, heads[0] : heads[1], rows[0] : rows[1], cols[0] : cols[1]])
    index = torch.arange(n)
    lo, hi = (t.expand(B, n) for t in key_bounds(part, B, n, m, index, index))  # (B, n)
    j = torch.arange(m)
    inside = (j >= lo[..., None]) & (j < hi[..., None])  # (B, n, m)
    assert not (full.any(1) & ~inside).any(), "a visible key outside its span"
    if exact_spans(part, B, n, m) is not None:
        assert torch.equal(full[:, 0], inside), "exact spans are not exact"
    if part.sees_all(n, m):
        assert full.all()
    if is_sdpa_causal(part, n, m):
        assert torch.equal(full[0, 0], torch.ones(n, m, dtype=torch.bool).tril())


def test_causal_windows_off_and_on_the_diagonal_take_the_unmasked_and_causal_kernels():
    below = window(ak.causal(), H=1, L=L, S=S, rows=(10, 20), cols=(0, 10))
    diagonal = window(ak.causal(), H=1, L=L, S=S, rows=(10, 20), cols=(10, 20))
    assert below.sees_all(10, 10) and not diagonal.sees_all(10, 10)
    assert is_sdpa_causal(diagonal, 10, 10) and not is_sdpa_causal(below, 10, 10)
    assert "rows 10:20, keys 0:10" in below.describe()


def test_the_same_window_finds_its_prepared_call_until_the_mask_changes():
    """A window is built anew for each call of a piece: an equal one finds the call
    prepared for the first (its plans), and an in-place change of the mask does not."""
    ids = DOCS.clone()
    mask = ak.document(ids)
    q = torch.randn(2, 1, 5, 8)

    def prepared():
        part = window(mask, H=1, L=L, S=S, rows=(0, 5), cols=(0, 5))
        return dispatch.prepared_call(
            q,
            q,
            q,
            part,
            scale=None,
            softcap=None,
            dropout_p=0.0,
            backend="auto",
            need_lse=False,
        )

    first = prepared()
    assert prepared() is first
    ids[0, 0] = 5
    assert prepared() is not first


def test_a_window_outside_the_mask_or_called_with_other_sizes_is_refused():
    with pytest.raises(ak.ShapeContractError, match="rows 0:30 is outside 0:20"):
        window(ak.causal(), H=1, L=L, S=S, rows=(0, 30), cols=(0, 5))
    part = window(ak.causal(), H=1, L=L, S=S, rows=(0, 5), cols=(0, 5))
    with pytest.raises(ak.ShapeContractError, match="serves H=1, L=5, S=5"):
        part.materialize(1, 1, 6, 5)
