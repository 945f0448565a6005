"""attnkit.distributed: 2, 3 and 4 gloo processes (odd sizes catch ring bugs) against one
process, in float64 (against the reference, 1e-10) and float32 (against attnkit, 1e-5).

Each test starts one process group and runs many checks in it (tests/cp_cases.py: every
mask and layout, the strategies, softcap, GQA/MQA, NaN in unseen keys, the traffic, the
layouts, the agreement); the slow variant runs every strategy on every mask in both
dtypes. The modules' own parts in one process: test_distributed_layout, _plan, _agree.
"""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
import attnkit.distributed as akd
import cp_cases
from cp_harness import spawn

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_context_parallel_equals_one_process(P):
    spawn(cp_cases.suite, P, False)


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 3, 4])
def test_context_parallel_full_matrix(P):
    spawn(cp_cases.suite, P, True)


def test_without_a_process_group_the_error_says_how_to_start_one():
    if torch.distributed.is_initialized():
        pytest.skip("a process group exists in this process")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        akd.attention(q, q, q, ak.causal())
