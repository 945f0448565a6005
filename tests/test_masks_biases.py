"""ALiBi as a mask with a bias (`masks.biases`)."""

from __future__ import annotations

import attnkit as ak


def test_draw_of_a_mask_with_alibi_shows_its_visibility():
    assert (ak.alibi(4) & ak.causal()).draw(2) == "■ ·\n■ ■"
