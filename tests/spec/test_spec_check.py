"""The ``enginewire spec check`` entry point: exit codes and what it prints."""

from __future__ import annotations

import pytest

from enginewire.testing.spec_check import SpecReport, render_report, run_spec_check


def test_negative_control_as_the_spec_fails_with_a_shortest_counterexample() -> None:
    lines: list[str] = []
    rc = run_spec_check(negative="shutdown_skips_join", spin=False, out=lines.append)
    text = "\n".join(lines)
    assert rc == 1
    assert "safety property shutdown_reclaims violated after 4 steps:" in text
    assert "shutdown_finish" in text
    assert "spec check FAILED" in text


def test_unknown_negative_control_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    lines: list[str] = []
    assert run_spec_check(negative="nope", spin=False, out=lines.append) == 2
    assert not lines  # a usage error is not part of the report: it goes to stderr
    assert "forget_pending_on_death" in capsys.readouterr().err


def test_empty_report_renders_ok() -> None:
    assert "spec check OK" in render_report(SpecReport())
