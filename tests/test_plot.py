"""Pictures: the figures of `attnkit.plot` hold the exact numbers they claim to show, the
notebook reprs describe what they draw, and the tour notebook runs top to bottom."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from matplotlib.figure import Figure

import attnkit as ak
import attnkit.plot as akplot
from attnkit.masks import as_mask
from attnkit.masks.picture import LARGEST, PREVIEW, preview_size
from attnkit.masks.structure import count_allowed_pairs

ROOT = Path(__file__).resolve().parents[1]


def _image(fig: Figure, axis: int = 0) -> torch.Tensor:
    return torch.as_tensor(fig.axes[axis].images[0].get_array().data)


def test_mask_figure_shows_the_mask_and_names_it():
    m = ak.sliding_window(2) & ak.key_padding(torch.tensor([6, 4]))
    fig = akplot.mask(m, 7, batch=1)
    assert isinstance(fig, Figure)
    expected = m.materialize(2, 1, 7, 7)[1, 0].float()
    assert torch.equal(_image(fig).float(), expected)
    assert str(m) in fig.axes[0].get_title()


def test_mask_figure_names_the_batch_row_and_head_and_centres_cells_on_positions():
    m = ak.key_padding(torch.tensor([6, 4]))  # differs by batch row
    title = akplot.mask(m, 6, batch=1).axes[0].get_title()
    assert "batch row 1" in title and "head" not in title
    assert "head 2" in akplot.mask(ak.causal(), 6, head=2).axes[0].get_title()
    assert "batch row" not in akplot.mask(ak.causal(), 6).axes[0].get_title()
    ax = akplot.mask(ak.causal(), 7).axes[0]
    assert ax.images[0].get_extent() == [-0.5, 6.5, 6.5, -0.5]  # as attention's imshow
    shown = [t for t in ax.get_xticks() if -0.5 <= t <= 6.5]
    assert shown and all(float(t).is_integer() for t in shown)  # ticks on cell centres


def test_large_masks_are_drawn_in_cells_whose_mean_is_the_density():
    L = S = 1024
    m = ak.sliding_window(100) & ak.causal()
    image = akplot.density_image(m, L, S)
    assert image.shape == (akplot.CELLS, akplot.CELLS)
    assert abs(float(image.mean()) - count_allowed_pairs(m, 1, 1, L, S) / (L * S)) < 1e-6


@pytest.mark.parametrize("heads", [[1, 3], 2, None])
def test_attention_figure_holds_the_exact_weights_of_the_rows_and_heads_asked(heads):
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8)  # GQA: 4 query heads, 2 K/V
    m = ak.causal() & ak.key_padding(torch.tensor([9, 5]))  # depends on the batch row
    for mask, batch in ((ak.causal(), 0), (m, 1)):
        fig = akplot.attention(q, k, mask, rows=[0, 4, 8], heads=heads, batch=batch)
        chosen = [0, 1, 2, 3] if heads is None else [heads] if isinstance(heads, int) else heads
        full = ak.attention_probs(q, k, mask)[batch][:, [0, 4, 8]]  # (H, 3, S)
        shown = [_image(fig, 2 * n) for n in range(len(chosen))]  # each image has a colorbar
        for h, image in zip(chosen, shown, strict=True):
            torch.testing.assert_close(image.float(), full[h], atol=1e-6, rtol=1e-6)


def test_attention_figure_refuses_heads_and_batch_rows_out_of_range():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"heads=\[5\].*0\.\.1"):
        akplot.attention(q, q, heads=[5])
    with pytest.raises(ValueError, match=r"batch=1"):
        akplot.attention(q, q, batch=1)


@pytest.mark.parametrize(
    "mask",
    [
        None,
        ak.causal(),
        ak.sliding_window(100) & ak.causal(),
        ak.document(torch.arange(1024) * 5 // 1024) & ak.causal(),
        ak.key_padding(torch.tensor([700])),
    ],
    ids=["none", "causal", "sliding", "documents", "padding"],
)
@pytest.mark.parametrize("backend", ["auto", "tiled", "sdpa", "flex"])
def test_plan_regions_cover_every_visible_pair(mask, backend):
    q = torch.randn(1, 2, 1024, 16)
    try:
        chosen, regions = akplot.computed_regions(q, q, q, mask, backend=backend)
    except ValueError as err:  # the backend cannot serve this call here
        pytest.skip(str(err))
    covered = torch.zeros(1024, 1024, dtype=torch.bool)
    for r in regions:
        block = covered[r.row0 : r.row0 + r.rows, r.key0 : r.key0 + r.keys]
        block |= torch.ones_like(block).tril() if r.causal else True
    visible = (
        torch.ones(1024, 1024, dtype=torch.bool)
        if mask is None
        else mask.materialize(1, 1, 1024, 1024)[0, 0]
    )
    assert not (visible & ~covered).any(), "a visible pair lies in a skipped block"
    assert sum(r.pairs for r in regions) == int(covered.sum())
    if chosen == "tiled" and mask is not None:
        assert covered.float().mean() < 0.9  # it skips what the mask hides
    fig = akplot.plan(q, q, q, mask, backend=backend)
    assert f"backend '{chosen}'" in fig.axes[0].get_title()


def test_mask_html_draws_the_description_at_a_readable_size():
    html = ak.causal()._repr_html_()
    assert "<code>causal()</code>" in html and f"L={PREVIEW}, S={PREVIEW}" in html
    assert html.count("<rect") == PREVIEW + 1  # one run a row, and the background
    docs = ak.document(torch.tensor([0, 0, 0, 1, 1]))
    assert preview_size(docs) == (5, 5) and "L=5, S=5" in docs._repr_html_()
    big = as_mask(torch.ones(300, 200, dtype=torch.bool).tril())
    assert f"rows 0..{LARGEST - 1} of L=300" in big._repr_html_()
    assert "&lt;" in ak.Mask.from_mod(lambda b, h, i, j: j <= i, name="j<i")._repr_html_()


def test_plan_reads_like_print_and_shows_as_a_table():
    q = torch.randn(1, 2, 64, 8)
    plan = ak.explain(q, q, q, ak.causal())
    assert repr(plan) == str(plan)
    html = plan._repr_html_()
    assert html.count("<tr>") == 4 + len(plan.reasons) + len(plan.notes)
    assert f"<b>attnkit plan: backend &#x27;{plan.backend}&#x27;</b>" in html
    first_backend = html.split("<tr>")[5]
    assert plan.backend in first_backend and "chosen" in first_backend


def test_tour_notebook_executes_and_draws(tmp_path):
    import nbclient
    import nbformat

    kernels = tmp_path / "kernels" / "attnkit-test"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "attnkit test",
                "language": "python",
            }
        )
    )
    notebook = nbformat.read(ROOT / "examples" / "tour.ipynb", as_version=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JUPYTER_PATH", str(tmp_path))
        client = nbclient.NotebookClient(
            notebook,
            kernel_name="attnkit-test",
            timeout=300,
            resources={"metadata": {"path": str(tmp_path)}},
        )
        client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 3  # the figures
    assert any("<svg" in o.get("data", {}).get("text/html", "") for o in outputs)  # a mask
    assert any("attnkit plan" in o.get("data", {}).get("text/html", "") for o in outputs)
