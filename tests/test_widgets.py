"""The explorers of `attnkit.widgets` draw what the library computes: set a control, and
the picture's data equals the mask built directly, its density and `explain`'s choice,
or the library's own error; the attention panels hold `attention_probs`' weights and
their hover text names the tokens and the weight. Headless: no browser, no kernel."""

from __future__ import annotations

import html
import subprocess
import sys

import pytest
import torch

import attnkit as ak

pytest.importorskip(
    "ipywidgets", reason="attnkit.widgets needs ipywidgets: pip install 'attnkit[widgets]'"
)

from attnkit.widgets import attention_explorer, mask_explorer
from attnkit.widgets.mask_explorer import SIDE


def test_importing_attnkit_imports_neither_ipywidgets_nor_matplotlib():
    code = (
        "import sys, attnkit, attnkit.widgets\n"
        "print(sorted({'ipywidgets', 'matplotlib'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_without_ipywidgets_an_explorer_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'ipywidgets>=8'"):
        mask_explorer()


MASKS = {
    "causal": ({"L": 8}, {}, ak.causal()),
    "window": ({"L": 8}, {"left": 3, "right": 1}, ak.sliding_window(3, 1)),
    "window_bottom_right": (
        {"L": 5, "S": 9},
        {"left": 2, "align": "bottom_right"},
        ak.sliding_window(2, align="bottom_right"),
    ),
    "chunked_causal": ({"L": 9}, {"chunk": 3, "and_causal": True}, ak.chunked(3) & ak.causal()),
    "prefix_offset": (
        {"L": 4, "S": 8},
        {"prefix": 3, "align": "offset", "offset": 2},
        ak.prefix_lm(3, offset=2),
    ),
    "documents_causal": (
        {"L": 10},
        {"documents": "2, 3", "and_causal": True},
        ak.document(torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3, 3])) & ak.causal(),
    ),
    "padding": ({"L": 6, "S": 8}, {"valid": 5}, ak.key_padding(torch.tensor([5]))),
}
KIND = {
    "causal": "causal",
    "window": "sliding_window",
    "window_bottom_right": "sliding_window",
    "chunked_causal": "chunked",
    "prefix_offset": "prefix_lm",
    "documents_causal": "document",
    "padding": "key_padding",
}


@pytest.mark.parametrize("case", list(MASKS))
def test_the_drawn_grid_is_the_mask_built_directly(case):
    sizes, settings, expected = MASKS[case]
    explorer = mask_explorer(KIND[case], **sizes)
    for name, value in settings.items():
        getattr(explorer, name).value = value
    view = explorer.view
    L, S = sizes["L"], sizes.get("S", sizes["L"])
    assert view.error is None
    assert torch.equal(view.grid, expected.materialize(1, 1, L, S)[0, 0])
    assert view.description == str(expected)
    assert view.density == pytest.approx(expected.materialize(1, 1, L, S).float().mean().item())
    assert html.escape(str(expected)) in explorer.info.value
    assert explorer.picture.value.count("<rect") == L * S  # one cell a pair


def test_density_and_the_explain_line_follow_the_controls():
    explorer = mask_explorer("sliding_window", L=32)
    q = torch.zeros(1, 1, 32, 64)
    for left in (0, 5, 31):
        explorer.left.value = left
        mask = ak.sliding_window(left)
        plan = ak.explain(q, q, q, mask)
        view = explorer.view
        assert view.density == pytest.approx(plan.density)
        assert view.backend == plan.backend and view.reasons == plan.reasons
        assert view.explain_lines[0] == f"explain: backend '{plan.backend}'"
        assert html.escape(view.explain_lines[0]) in explorer.info.value
        assert f"{view.density:.1%}" in explorer.info.value
    assert explorer.view.density == 1.0 - (31 * 32 / 2) / 32**2  # the full lower triangle


def test_an_invalid_combination_shows_the_librarys_error_instead_of_raising():
    explorer = mask_explorer("causal", L=4)
    explorer.S.value = 6  # L != S and no alignment: attnkit never guesses
    with pytest.raises(ak.ShapeContractError) as raised:
        ak.causal().materialize(1, 1, 4, 6)
    view = explorer.view
    assert view.grid is None and view.density is None and view.backend is None
    assert view.error == f"ShapeContractError: {raised.value}"
    assert html.escape(str(raised.value)) in explorer.picture.value
    explorer.align.value = "bottom_right"  # the fix the message names
    assert explorer.view.error is None
    assert torch.equal(explorer.view.grid, ak.causal("bottom_right").materialize(1, 1, 4, 6)[0, 0])


def test_unreadable_document_lengths_show_what_to_write():
    explorer = mask_explorer("document", L=8)
    explorer.documents.value = "4, zero"
    assert "write positive integers" in explorer.view.error
    explorer.documents.value = "3"
    assert str(explorer.view.description) == "document(B=1)"


def test_only_the_kinds_controls_are_shown():
    explorer = mask_explorer("chunked")
    shown = {
        n
        for n in ("left", "chunk", "prefix", "valid", "documents", "offset")
        if getattr(explorer, n).layout.display != "none"
    }
    assert shown == {"chunk"}
    explorer.align.value = "offset"
    assert explorer.offset.layout.display != "none"


def test_large_masks_are_drawn_in_blocks_whose_mean_is_the_density():
    explorer = mask_explorer("sliding_window", L=200, S=130, max_len=256)
    explorer.align.value = "bottom_right"
    explorer.left.value = 20
    expected = ak.sliding_window(20, align="bottom_right").materialize(1, 1, 200, 130)[0, 0]
    assert torch.equal(explorer.view.grid, expected)
    picture = explorer.picture.value
    assert picture.count("<rect") <= SIDE * SIDE
    assert "may attend</title>" in picture and "queries 0–3, keys 0–2" in picture


def test_the_attention_panels_hold_attention_probs_of_the_chosen_head_and_row():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8)  # GQA: 2 query heads a key head
    mask = ak.key_padding(torch.tensor([6, 4])) & ak.causal("bottom_right")
    tokens = ["<s>", "I", "like", "green", "tea"]
    keys = ["[past]", *tokens]
    explorer = attention_explorer(q, k, mask, tokens=tokens, key_tokens=keys)
    assert explorer.layer.layout.display == "none"  # one layer: no selector
    explorer.batch.value = 1
    explorer.heads.value = (3,)
    expected = ak.attention_probs(q, k, mask)[1, 3]  # (L, S)
    torch.testing.assert_close(explorer.view.weights[0], expected, rtol=0, atol=0)
    reference = ak.attention_weights(q, k.repeat_interleave(2, dim=1), mask.materialize(2, 4, 5, 6))
    torch.testing.assert_close(explorer.view.weights[0], reference[1, 3])
    text = explorer.hover(3, 2)
    assert text == f"head 3: query 3 'green' → key 2 'I': weight {expected[3, 2].item():.4f}"
    assert html.escape(text, quote=True) in explorer.picture.value
    assert "weight 0.0000" in explorer.hover(0, 5)  # padding: key 5 of row 1 is hidden


def test_a_models_attentions_get_a_layer_selector():
    torch.manual_seed(0)
    attentions = tuple(torch.randn(2, 3, 4, 4).softmax(-1) for _ in range(2))  # per layer
    tokens = [["a", "b", "c", "d"], ["w", "x", "y", "z"]]  # one list a batch row
    explorer = attention_explorer(attentions=attentions, tokens=tokens)
    assert explorer.layer.layout.display != "none"
    explorer.layer.value, explorer.batch.value, explorer.heads.value = 1, 1, (0, 2)
    view = explorer.view
    assert torch.equal(view.weights, attentions[1][1, [0, 2]])
    assert view.query_tokens == view.key_tokens == tokens[1]
    assert explorer.picture.value.count("<table") == 2  # one panel a head
    assert explorer.hover(0, 3, head=2).startswith("head 2: query 0 'w' → key 3 'z': weight ")
    explorer.heads.value = ()
    assert "at least one head" in explorer.picture.value


def test_labels_and_inputs_that_do_not_fit_are_refused_with_the_fix():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="one label a position"):
        attention_explorer(q, q, tokens=["only", "two"])
    with pytest.raises(ValueError, match="not both"):
        attention_explorer(q, q, attentions=torch.rand(1, 1, 3, 3))
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        attention_explorer(attentions=(None,))


def test_a_notebook_shows_the_explorers_widgets():
    for explorer in (mask_explorer(), attention_explorer(attentions=torch.rand(1, 1, 2, 2))):
        bundle = explorer._repr_mimebundle_()
        assert "application/vnd.jupyter.widget-view+json" in bundle


def test_the_explorers_parts_are_attributes_too():
    explorer = mask_explorer("prefix_lm", L=6)
    explorer.prefix.value = 2
    assert torch.equal(explorer.grid, ak.prefix_lm(2).materialize(1, 1, 6, 6)[0, 0])
    assert explorer.density == explorer.view.density
    assert explorer.plan is not None and explorer.plan.mask == "prefix_lm(2)"
    assert explorer.error is None
    explorer.S.value = 7
    assert explorer.plan is None and explorer.error.startswith("ShapeContractError")
    q = torch.randn(1, 2, 3, 4)
    attention = attention_explorer(q, q)
    attention.heads.value = (1,)
    assert torch.equal(attention.weights, ak.attention_probs(q, q)[0, 1])


def test_the_explorer_names_the_masks_as_the_command_line_does():
    from attnkit import cli
    from attnkit.widgets.mask_explorer import KINDS

    assert list(KINDS) == cli.KINDS
