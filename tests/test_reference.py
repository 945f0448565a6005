"""The readable reference loop (`attnkit.reference`): what it computes in which dtype."""

from __future__ import annotations

import torch

from fuzz_cases import RandomDraw, draw_case
from fuzz_check import run_case


def test_gqa_key_gradients_of_half_inputs_sum_in_float32_on_the_reference():
    """The reference repeated K/V heads before casting up, so the G heads' key gradients
    were summed in bfloat16 (campaign seed 0, case 5985: dk 8 ulps off)."""
    case = draw_case(RandomDraw(0, 5985))
    assert case.dtype == torch.bfloat16 and case.H > case.Hkv
    failures = [o for o in run_case(case) if o.failed]
    assert not failures, failures
