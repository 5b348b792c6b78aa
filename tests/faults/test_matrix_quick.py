"""model_tests/fault_matrix.py: a bounded slice of the quick matrix, and its exit status.

The whole quick matrix (``enginewire faults matrix --quick``, a few minutes) runs in CI as
its own step; here a few cells prove the cell runner, the table and the JSON copy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from enginewire.faults import (
    Cell,
    CellResult,
    Fault,
    FaultAction,
    FaultPoint,
    FrameAction,
    Outcome,
    expected_outcome,
    matrix_cells,
    run_fault_matrix,
)
from enginewire.testing.fault_matrix import DEATH_BOUND_S, Scenario, _default_config
from enginewire.testing.interposer import interposer_cells

torch.set_num_threads(1)
os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")


def test_expectations_follow_the_spec() -> None:
    def exp(scenario: Scenario, point: FaultPoint, action: FaultAction) -> Outcome:
        return expected_outcome(Cell("sync", scenario, Fault(point=point, action=action)))

    assert exp(Scenario.GENERATE, FaultPoint.FORWARD, FaultAction.RAISE) is Outcome.DEAD
    assert exp(Scenario.GENERATE, FaultPoint.STEP, FaultAction.SIGSTOP) is Outcome.DEAD
    assert exp(Scenario.GENERATE, FaultPoint.STEP, FaultAction.DELAY) is Outcome.OK
    assert exp(Scenario.UTILITY, FaultPoint.UTILITY, FaultAction.OOM) is Outcome.UTILITY_ERROR
    assert exp(Scenario.UTILITY, FaultPoint.UTILITY, FaultAction.EXIT) is Outcome.DEAD
    assert exp(Scenario.STARTUP, FaultPoint.BEFORE_READY,
               FaultAction.SIGKILL) is Outcome.STARTUP_ERROR
    assert exp(Scenario.SHUTDOWN, FaultPoint.SHUTDOWN, FaultAction.SIGKILL) is Outcome.OK


def test_full_matrix_covers_every_point_and_keeps_process_faults_out_of_process() -> None:
    cells = matrix_cells(["inproc", "sync", "async"], quick=False)
    assert {c.fault.point for c in cells if c.client == "sync"} == set(FaultPoint)
    assert {c.fault.action for c in cells if c.client == "sync"} == set(FaultAction)
    inproc = [c for c in cells if c.client == "inproc"]
    assert inproc and all(c.fault.action not in (FaultAction.SIGKILL, FaultAction.SIGSTOP,
                                                 FaultAction.EXIT) for c in inproc)
    quick = matrix_cells(["inproc", "sync", "async"], quick=True)
    assert {c.client for c in quick} == {"inproc", "sync", "async"} and len(quick) < 20


def test_a_slice_of_the_quick_matrix_passes(tmp_path: Path) -> None:
    quick = matrix_cells(["inproc", "sync"], quick=True)
    picks = [c for c in quick if c.client == "inproc"][:1] + [
        c for c in quick if c.client == "sync" and c.fault.action is FaultAction.SIGSTOP
        and c.fault.point is FaultPoint.OUTPUT_SEND]
    assert len(picks) == 2
    # A bit flipped inside a token frame: the integrity trailer must catch it.
    (flip,) = [c for c in interposer_cells(["sync"], True, _default_config())
               if c.rule.action is FrameAction.BITFLIP]
    status = run_fault_matrix(["inproc", "sync"], quick=True, results_dir=str(tmp_path),
                              cells=picks, extra_cells=[flip], echo=None)
    report = json.loads((tmp_path / "fault_matrix.json").read_text())
    assert status == 0, report
    flipped = next(r for r in report["results"] if r["action"] == "bitflip")
    assert flipped["outcome"] == "dead" and "checksum" in flipped["detail"]
    hung = next(r for r in report["results"] if r["action"] == "sigstop")
    assert hung["outcome"] == "dead" and hung["leaks"] == {}
    assert hung["latency_ms"] is not None and hung["latency_ms"] <= DEATH_BOUND_S * 1000


def test_any_cell_off_the_spec_makes_the_exit_status_non_zero(tmp_path: Path) -> None:
    def off_spec(_work: str) -> CellResult:
        return CellResult(cell="x", client="sync", scenario="generate", point="step",
                          action="raise", expected="dead", outcome="hang", passed=False)

    status = run_fault_matrix(["sync"], quick=True, results_dir=str(tmp_path), cells=[],
                              extra_cells=[off_spec], echo=None)
    assert status == 1
    assert json.loads((tmp_path / "fault_matrix.json").read_text())["failed"] == 1


def test_a_lost_attach_or_marker_has_its_cells_and_deadline_bound() -> None:
    from enginewire.testing.interposer import ATTACH_READY_S, Direction, FrameKind

    def attach_cells(quick: bool) -> list[tuple[str, Direction, bool]]:
        cells = interposer_cells(["sync", "async"], quick, _default_config())
        return [(c.client, c.rule.direction, c.heartbeat) for c in cells
                if c.rule.kind is FrameKind.ATTACH and c.rule.action is FrameAction.DROP]

    # CI pays one whole deadline: the silent one (no heartbeat), which only the timer ends.
    assert attach_cells(True) == [("sync", Direction.TO_ENGINE, False)]
    assert sorted(attach_cells(False)) == [
        ("async", Direction.TO_CLIENT, True), ("async", Direction.TO_ENGINE, False),
        ("sync", Direction.TO_CLIENT, True), ("sync", Direction.TO_ENGINE, False)]
    for cell in interposer_cells(["sync"], False, _default_config()):
        if cell.rule.kind is FrameKind.ATTACH:
            assert cell.allowed == {Outcome.DEAD} and cell.ready_timeout_s == ATTACH_READY_S
            assert cell.latency_bound_s == ATTACH_READY_S + DEATH_BOUND_S
            # The deadline bounds the engine's start too: the fast-starting model keeps a
            # loaded machine's slow start from failing the cell as a startup error.
            assert cell.config.model == "null"


def test_a_lost_attach_is_death_at_the_marker_deadline(tmp_path: Path) -> None:
    """The quick matrix's lost-ATTACH cell: the engine's tokens are dropped as before the
    marker and then it is silent, so only the monitor's timer can declare it dead."""
    from enginewire.testing.interposer import ATTACH_READY_S, FrameKind

    (lost,) = [c for c in interposer_cells(["sync"], True, _default_config())
               if c.rule.kind is FrameKind.ATTACH]
    status = run_fault_matrix(["sync"], quick=True, results_dir=str(tmp_path), cells=[],
                              extra_cells=[lost], echo=None)
    (result,) = json.loads((tmp_path / "fault_matrix.json").read_text())["results"]
    assert status == 0, result
    assert result["outcome"] == "dead" and "no attach marker" in result["detail"], result
    assert result["leaks"] == {}
    # At the deadline (counted from the drop, just after the ATTACH went out), not early.
    assert (ATTACH_READY_S - DEATH_BOUND_S) * 1000 <= result["latency_ms"] <= (
        (ATTACH_READY_S + DEATH_BOUND_S) * 1000), result


def test_a_client_named_twice_runs_once(tmp_path: Path) -> None:
    # `faults matrix --client sync --client sync` ran every cell twice.
    status = run_fault_matrix(["sync", "sync"], quick=True, results_dir=str(tmp_path),
                              cells=[], extra_cells=[], echo=None)
    assert status == 0
    assert json.loads((tmp_path / "fault_matrix.json").read_text())["clients"] == ["sync"]


def test_a_death_right_after_the_handshake_is_always_a_ready_clients_death(
        tmp_path: Path) -> None:
    """CI once saw ``after_ready:exit`` as a startup error: the fault fired with the ready
    still in the engine's libzmq queue (os._exit drops it), and a death the monitor saw in
    the constructor's last steps failed construction. Now the point fires once the ATTACH
    is in (the front end has the ready) and the client is READY before its watchers start,
    so every repeat on both clients is DEAD, never STARTUP_ERROR."""
    cells = [Cell(client, Scenario.STARTUP, Fault(point=FaultPoint.AFTER_READY, action=action))
             for _ in range(2) for client in ("sync", "async")
             for action in (FaultAction.EXIT, FaultAction.SIGKILL)]
    status = run_fault_matrix(["sync", "async"], quick=True, results_dir=str(tmp_path),
                              cells=cells, extra_cells=[], echo=None)
    report = json.loads((tmp_path / "fault_matrix.json").read_text())
    assert status == 0, report
    assert [r["outcome"] for r in report["results"]] == ["dead"] * len(cells), report
