"""The ``enginewire spec check`` entry point: exit codes and what it prints."""

from __future__ import annotations

from typing import Any

import pytest

from enginewire.spec.explore import ExploreResult
from enginewire.testing import spec_check
from enginewire.testing.spec_check import (
    UNEXERCISED,
    SpecReport,
    coverage_gaps,
    render_report,
    run_spec_check,
)


@pytest.fixture
def explored_spec(monkeypatch: pytest.MonkeyPatch, composed: ExploreResult,
                  composed_dp: ExploreResult, composed_fe: ExploreResult) -> None:
    """``run_spec_check`` explores each model as specified (no control on, nothing else set):
    the explorations tests/spec/conftest.py's session fixtures already made (and
    tests/spec/test_explore.py and test_compose_dp.py assert on), not made again here. A run
    with a control on, or any other argument, still explores afresh."""
    def shared(real: Any, spec: ExploreResult) -> Any:
        def run(bug: str | None = None, **kw: Any) -> ExploreResult:
            return spec if bug is None and not kw else real(bug, **kw)
        return run

    monkeypatch.setattr(spec_check, "explore", shared(spec_check.explore, composed))
    monkeypatch.setattr(spec_check, "explore_dp", shared(spec_check.explore_dp, composed_dp))
    monkeypatch.setattr(spec_check, "explore_fe", shared(spec_check.explore_fe, composed_fe))


@pytest.mark.slow
@pytest.mark.usefixtures("explored_spec")
def test_negative_control_as_the_spec_fails_with_a_shortest_counterexample() -> None:
    lines: list[str] = []
    rc = run_spec_check(negative="shutdown_skips_join", spin=False, out=lines.append)
    text = "\n".join(lines)
    assert rc == 1
    assert "safety property shutdown_reclaims violated after 4 steps:" in text
    assert "shutdown_finish" in text
    assert "spec check FAILED" in text


@pytest.mark.slow
@pytest.mark.usefixtures("explored_spec")
def test_a_two_engine_control_as_the_spec_fails_that_model_only() -> None:
    lines: list[str] = []
    rc = run_spec_check(negative="route_to_restarting", spin=False, controls=False,
                        out=lines.append)
    text = "\n".join(lines)
    assert rc == 1
    assert "two-engine model (negative control route_to_restarting)" in text
    assert "safety property dp_routes_to_serving violated after" in text
    from enginewire.spec.properties import PROPERTIES

    n = len(PROPERTIES)
    assert "composed model: " in text and f"properties held {n}/{n}" in text  # untouched


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


@pytest.mark.slow
@pytest.mark.usefixtures("explored_spec")
def test_quick_runs_the_spec_and_only_the_quick_controls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--quick`` checks every property on the spec itself and runs only QUICK_CONTROLS of
    the negative controls (both kinds among them); the report says how to run all."""
    from enginewire.spec import compose_dp, compose_fe
    from enginewire.spec.properties import DP_PROPERTIES, FE_PROPERTIES, LIVENESS, SAFETY
    from enginewire.testing import spec_check as sc

    targets = sc.all_control_targets()
    assert set(sc.QUICK_CONTROLS) <= set(targets)
    kinds = {p.name: p.kind for p in (*SAFETY, *LIVENESS, *DP_PROPERTIES, *FE_PROPERTIES)}
    assert {kinds[t] for bug in sc.QUICK_CONTROLS for t in targets[bug]} == {
        "safety", "liveness"}
    # the two-engine model's controls are among them, a safety and a liveness one
    dp_quick = [b for b in sc.QUICK_CONTROLS if b in compose_dp.BUGS]
    assert {kinds[t] for bug in dp_quick for t in targets[bug]} == {"safety", "liveness"}
    # and the front-end model's: outputs to front end 0 (vLLM #27711), a dead one's work
    assert {b for b in sc.QUICK_CONTROLS if b in compose_fe.BUGS} == {
        "outputs_to_front_end_0", "dead_work_left_running"}
    ran: list[str] = []

    def control(bug: str, want: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
        ran.append(bug)
        return want, ""

    monkeypatch.setattr(sc, "_explorer_control", control)
    lines: list[str] = []
    assert sc.run_spec_check(spin=False, quick=True, out=lines.append) == 0
    assert ran == [b for b in targets if b in sc.QUICK_CONTROLS]
    text = "\n".join(lines)
    assert f"quick check: {len(ran)} of {len(targets)} negative controls" in text
    assert "properties held" in text  # the spec itself was explored in full
    n = len(DP_PROPERTIES)
    assert "two-engine model: " in text and f"properties held {n}/{n}" in text
    n = len(FE_PROPERTIES)
    assert "front-end model: " in text and f"properties held {n}/{n}" in text


def test_the_quick_summary_fits_a_screen_and_lists_only_what_failed() -> None:
    """``spec check --quick`` (the README's main job) counts what passed in one line each;
    a failing SPIN run or control is listed in full even there."""
    from enginewire.testing.spec_check import ControlResult, SpinResult

    report = SpecReport()
    report.spin = [SpinResult("request_finishes", None, 0, 10, 5, 0.1),
                   SpinResult("death_fails_calls", None, 0, 10, 5, 0.1)]
    report.controls = [ControlResult("no_monitor", ("death_propagates",),
                                     ("death_propagates",), ("death_propagates",), "")]
    brief = render_report(report, brief=True)
    assert "SPIN: all 2 properties hold" in brief and "SPIN property" not in brief
    assert "negative controls: 1 run, each rejected by the explorer and SPIN" in brief
    assert "SPIN property" in render_report(report)  # the full check's tables
    report.spin[0] = SpinResult("request_finishes", None, 1, 10, 5, 0.1, "SPIN trail for it")
    report.controls[0] = ControlResult("no_monitor", ("death_propagates",), (), None, "")
    failing = render_report(report, brief=True)
    assert "SPIN property" in failing and "SPIN trail for it" in failing
    assert "MISSES" in failing
