"""The fault matrix's front-end cells (model_tests/fault_matrix_fe.py, ``enginewire faults
matrix --front-ends 2``): one engine serving two front ends, one of them killed, stopped past
the front-end timeout, or sending garbage, while the other streams on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from enginewire.cli import main
from enginewire.runtime._engine_input import CONNECTION_LOSS_S
from enginewire.testing import fault_matrix as fm
from enginewire.testing import mutants
from enginewire.testing._cells import Outcome
from enginewire.testing.fault_matrix_fe import (
    FE_HOWS,
    FE_TIMEOUT_S,
    GONE_BOUND_S,
    FECell,
    fe_cells,
)


def test_the_cells_of_each_kind_and_the_quick_pair() -> None:
    full = fe_cells(["inproc", "sync", "async"], quick=False)
    assert sorted((c.client, c.how) for c in full) == sorted(
        (k, h) for k in ("sync", "async") for h in FE_HOWS)
    # CI's quick matrix: a loss the heartbeat reveals and one the integrity check ends.
    assert [(c.client, c.how) for c in fe_cells(["sync", "async"], quick=True)] == [
        ("sync", "kill"), ("async", "garbage_integrity")]
    assert [c.how for c in fe_cells(["sync"], quick=True)] == ["kill"]
    assert {c.expected for c in full} == {Outcome.OK, Outcome.FRONT_END_GONE}
    with pytest.raises(ValueError, match="must be 'sync' or 'async'"):
        FECell("inproc", "kill")
    with pytest.raises(ValueError, match="must be one of"):
        FECell("sync", "explode")


def test_the_cli_refuses_what_the_cells_cannot_run(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    for extra in (["--engines", "2"], ["--client", "inproc"]):
        assert main(["faults", "matrix", "--front-ends", "2", "--results-dir",
                     str(tmp_path), *extra]) == 2
        assert "--front-ends 2" in capsys.readouterr().err


@pytest.mark.slow
def test_a_killed_or_stopped_front_end_s_work_ends_and_the_other_streams_on(
        tmp_path: Path) -> None:
    # The garbage cells: the quick matrix (CI) runs the integrity one; the full one both.
    rc = fm.run_fault_matrix(["sync"], results_dir=str(tmp_path), echo=None, cells=[],
                             extra_cells=[FECell("sync", "kill"), FECell("sync", "stop")])
    report = json.loads((tmp_path / "fault_matrix.json").read_text())
    rows = {r["action"]: r for r in report["results"]}
    assert rc == 0, report
    for how in ("kill", "stop"):
        assert rows[how]["outcome"] == "front_end_gone" and rows[how]["leaks"] == {}
    # A killed one's connection closes: gone once it stayed down CONNECTION_LOSS_S. A stopped
    # one's stays up: lost to its silence, about the engine's front-end timeout.
    assert CONNECTION_LOSS_S * 900 <= rows["kill"]["latency_ms"] < FE_TIMEOUT_S * 1000 + 500, (
        rows["kill"])
    assert FE_TIMEOUT_S * 900 <= rows["stop"]["latency_ms"] <= GONE_BOUND_S * 1000, rows["stop"]
    # The resumed victim was told (never an ending after its loss, never a call left waiting).
    assert rows["stop"]["detail"].startswith("resumed victim dead"), rows["stop"]
    assert "session is gone" in rows["stop"]["detail"], rows["stop"]


@pytest.mark.slow
def test_the_kill_cell_finds_a_gone_front_end_s_requests_left_running(
        tmp_path: Path) -> None:
    mutants.apply("fe_gone_requests_left_running")  # here and in the engine it spawns
    try:
        result = FECell("sync", "kill")(str(tmp_path))
    finally:
        mutants.revert()
    assert not result.passed and result.outcome == "hang", result
    assert "still live" in result.detail
