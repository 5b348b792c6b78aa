"""The fault matrix's data-parallel cells (model_tests/fault_matrix_dp.py): a fault on one
engine of two, the other serving on, every cell as the spec requires."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from enginewire.cli import main
from enginewire.faults import Fault, run_dp_fault_matrix
from enginewire.runtime.config import EngineConfig
from enginewire.testing.fault_matrix_dp import DPCell, dp_cells
from enginewire.testing.fault_matrix_scale import SCALE_FAULTS, ScaleCell, scale_cells


@pytest.mark.slow
def test_quick_dp_cells_are_one_down(tmp_path: Path) -> None:
    rc = run_dp_fault_matrix(quick=True, results_dir=str(tmp_path), echo=None,
                             config=EngineConfig(model="tiny", max_num_seqs=4))
    report = json.loads((tmp_path / "fault_matrix.json").read_text())
    failed = [(r["cell"], r["outcome"], r["detail"]) for r in report["results"]
              if not r["passed"]]
    assert rc == 0 and not failed, failed
    names = {r["cell"] for r in report["results"]}
    assert any("sigkill" in n for n in names) and any("bitflip" in n for n in names)
    assert any("/scale/" in n for n in names)  # issue 46: a leaver killed in its drain
    assert all(r["outcome"] == ("left" if "/scale/" in r["cell"] else "one_down")
               for r in report["results"])


def test_every_way_to_go_has_a_cell_on_both_clients() -> None:
    cells = dp_cells(["sync", "async", "inproc"], quick=False, config=EngineConfig())
    assert {c.client for c in cells} == {"sync", "async"}
    actions = {str(c.fault.action) for c in cells if c.fault is not None}
    assert {"sigkill", "sigstop", "raise", "exit"} <= actions
    assert sum(c.rule is not None for c in cells) == 2


def test_every_scale_fault_has_a_cell_on_both_clients() -> None:
    cells = scale_cells(["sync", "async", "inproc"], quick=False, config=EngineConfig())
    assert {(c.client, c.how) for c in cells} == {
        (k, h) for k in ("sync", "async") for h in SCALE_FAULTS}
    assert {c.expected.value for c in cells} == {"scale_undone", "left"}
    with pytest.raises(ValueError, match="how"):
        ScaleCell("sync", EngineConfig(), "nosuch")
    with pytest.raises(ValueError, match="client"):
        ScaleCell("inproc", EngineConfig(), "joiner")


@pytest.mark.slow
@pytest.mark.parametrize("how", [h for h in SCALE_FAULTS if h != "leaver-kill"])
def test_each_scale_cell_passes(how: str, tmp_path: Path) -> None:
    # (leaver-kill: the quick matrix above runs it)
    cell = ScaleCell("sync", EngineConfig(model="tiny", max_num_seqs=4), how)
    result = cell(str(tmp_path))
    assert result.passed, (result.outcome, result.detail, result.leaks)


def test_bad_cells_and_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        DPCell("sync", EngineConfig())
    with pytest.raises(ValueError, match="client"):
        DPCell("inproc", EngineConfig(), fault=Fault(point="step"))
    with pytest.raises(ValueError, match="engines"):
        DPCell("sync", EngineConfig(), fault=Fault(point="step"), engines=1)
    with pytest.raises(ValueError, match="at least 2"):
        run_dp_fault_matrix(engines=1)
    with pytest.raises(ValueError, match="sync and async"):
        run_dp_fault_matrix(["inproc"])


def test_cli_refuses_engines_with_the_inproc_client(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["faults", "matrix", "--engines", "2", "--client", "inproc"]) == 2
    assert "--engines 2" in capsys.readouterr().err
