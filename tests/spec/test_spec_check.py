"""The ``enginewire spec check`` entry point: exit codes and what it prints."""

from __future__ import annotations

import pytest

from enginewire.spec.compose import UNEXERCISED
from enginewire.testing.spec_check import SpecReport, coverage_gaps, render_report, run_spec_check


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


def test_coverage_gaps_name_undeclared_and_stale_rows() -> None:
    declared = sorted(UNEXERCISED)
    (mach, row), rest = declared[0], declared[1:]
    uncovered: dict[str, list[str]] = {m: [] for m, _ in declared}  # as uncovered_rows gives
    for m, r in rest:
        uncovered.setdefault(m, []).append(r)
    uncovered.setdefault("engine", []).append("IDLE --NEW_EVENT--> IDLE")
    undeclared, stale = coverage_gaps(uncovered)
    assert undeclared == ["engine: IDLE --NEW_EVENT--> IDLE"]
    assert stale == [f"{mach}: {row}"]  # now exercised: the declaration must go


def test_a_gap_fails_the_report_and_is_named() -> None:
    report = SpecReport(undeclared=["engine: IDLE --NEW_EVENT--> IDLE"])
    text = render_report(report)
    assert not report.ok
    assert "NOT EXERCISED and not declared in compose.UNEXERCISED: engine: IDLE" in text
    assert "spec check FAILED" in text
    stale = SpecReport(stale_declared=["engine: READY --SHUTDOWN--> SHUTDOWN"])
    assert not stale.ok and "remove it" in render_report(stale)
