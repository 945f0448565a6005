"""The attnkit command: the tour passes its own checks; masks and plans print."""

from __future__ import annotations

from attnkit.cli import main
from attnkit.tour import run_tour


def test_tour_runs_every_section_and_every_check_passes():
    lines: list[str] = []
    failed = run_tour(lines.append)
    text = "\n".join(lines)
    assert failed == 0
    for section in range(1, 8):
        assert f"\n{section}. " in text
    assert "0.1956" in text and "0.8044" in text
    checks = [line for line in lines if line.startswith(("   ✓", "   ✗"))]
    assert len(checks) >= 15 and all(line.startswith("   ✓") for line in checks)


def test_mask_command_draws(capsys):
    assert main(["mask", "causal", "-L", "3"]) == 0
    out = capsys.readouterr().out
    assert "■ · ·\n■ ■ ·\n■ ■ ■" in out


def test_mask_command_reports_contract_errors(capsys):
    assert main(["mask", "causal", "-L", "2", "-S", "4"]) == 2
    assert "align" in capsys.readouterr().err


def test_explain_command_prints_a_plan(capsys):
    assert main(["explain", "sliding", "-L", "256", "--window", "15"]) == 0
    out = capsys.readouterr().out
    assert "attnkit plan" in out and "sliding_window(left=15" in out
