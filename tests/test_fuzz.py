"""The differential fuzz harness in the suite: random calls on every backend against a
float64 oracle (tests/fuzz_cases.py draws them, tests/fuzz_check.py judges them).

`make test` runs a fixed set of examples (derandomized: CI sees the same ones) in about a
minute; `make fuzz` runs the long campaign (tests/fuzz.py).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuzz
from fuzz_cases import HypothesisDraw, RandomDraw, draw_case
from fuzz_check import run_case

BUDGET = settings(
    max_examples=700,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@BUDGET
@given(st.data())
def test_every_backend_keeps_the_rule_or_refuses_with_a_reason(data):
    case = draw_case(HypothesisDraw(data))
    failures = [o for o in run_case(case) if o.failed]
    assert not failures, f"{case}\n" + "\n".join(
        f"  {o.backend} {o.what} {o.status}: {o.detail}" for o in failures
    )


def test_cases_are_reproducible_from_seed_and_index():
    first, again = (str(draw_case(RandomDraw(7, 42))) for _ in range(2))
    assert first == again
    assert str(draw_case(RandomDraw(7, 43))) != first


def test_campaign_prints_a_summary_table(capsys):
    assert fuzz.main(["--cases", "6", "--seed", "5", "--flex", "0", "--every", "3"]) == 0
    printed = capsys.readouterr().out
    assert "3/6 cases" in printed and "| backend | runs | ok | refused | wrong | crash |" in printed
    assert "| reference | 12 | 12 | 0 | 0 | 0 |" in printed and "no failures." in printed
