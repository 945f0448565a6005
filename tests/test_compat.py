"""The feature probes of `attnkit._compat`."""

from __future__ import annotations

import torch


def test_the_empty_row_probe_answers_the_same_under_no_grad_and_inside_an_op():
    from attnkit._compat import probe_empty_rows as probe  # asked anew each time

    want = probe()
    with torch.no_grad():
        assert probe() == want
    with torch.inference_mode():
        assert probe() == want
    assert want == (torch.__version__ >= "2.5")
