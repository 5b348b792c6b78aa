"""model_tests/fault_matrix.py with ``factory=`` (``enginewire faults matrix --factory``): the
matrix on a client factory of the user's own, as the conformance suite's ClientFactory
contract has it: cells it can honour run as on a built-in client, cells whose options it
refuses are not applicable (not failures), and a factory that breaks is a failure row."""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginewire.cli import main
from enginewire.faults import Cell, Fault, FaultAction, FaultPoint, FrameAction, run_fault_matrix
from enginewire.testing import interposer
from enginewire.testing.campaign import load_factory
from enginewire.testing.fault_matrix import Scenario

torch.set_num_threads(1)
os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")

# The user's module, importable by name as a test suite's helper is (a launched engine gets
# this process's sys.path).
FACTORIES = textwrap.dedent('''
    from typing import Any

    from enginewire.runtime import make_client
    from enginewire.runtime.config import EngineConfig
    from enginewire.testing.conformance import ClientUnderTest, NotApplicable, open_client

    CONFIG = EngineConfig(model="tiny", max_num_seqs=4)


    def mine(**options: Any) -> ClientUnderTest:
        """The public constructor, wrapped as the ClientFactory contract asks."""
        config, trace = options.pop("config", CONFIG), []
        return ClientUnderTest(make_client(config, multiprocess=True, asyncio=False,
                                           trace=trace, **options), "sync", trace)


    def in_process(**options: Any) -> ClientUnderTest:
        """An in-process client: it refuses engine-process options itself."""
        return open_client("inproc", options.pop("config", CONFIG), **options)


    def no_engine_faults(**options: Any) -> ClientUnderTest:
        """An engine that cannot plant faults: it says so, as the contract asks."""
        if "engine_fault" in options:
            raise NotApplicable("this engine takes no engine_fault plan")
        return mine(**options)


    def no_options() -> ClientUnderTest:
        """Breaks the contract: any option is a TypeError."""
        return mine()


    def broken(**options: Any) -> ClientUnderTest:
        raise TypeError("cannot build my client")
''')

DEAD_IN_FORWARD = Cell("sync", Scenario.GENERATE, Fault(point=FaultPoint.FORWARD, at=3))
FAILED_ECHO = Cell("sync", Scenario.UTILITY, Fault(point=FaultPoint.UTILITY, method="echo"))
ASYNC_CELL = Cell("async", Scenario.GENERATE, Fault(point=FaultPoint.FORWARD, at=3,
                                                    action=FaultAction.OOM))


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The module's name; it is importable from the current directory, as ``--factory``
    finds it."""
    (tmp_path / "ew_matrix_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield "ew_matrix_factories"


def _matrix(tmp_path: Path, ref: str, cells: list[Cell],
            extra_cells: list[Any] | None = None) -> tuple[int, dict[str, Any]]:
    status = run_fault_matrix(results_dir=str(tmp_path / "res"), cells=cells,
                              extra_cells=extra_cells, echo=None, factory=load_factory(ref))
    return status, json.loads((tmp_path / "res" / "fault_matrix.json").read_text())


def test_a_users_factory_passes_as_the_builtin_client_does(factories: str,
                                                           tmp_path: Path) -> None:
    status, report = _matrix(tmp_path, f"{factories}:mine",
                             [DEAD_IN_FORWARD, FAILED_ECHO, ASYNC_CELL], extra_cells=[])
    assert status == 0, report
    assert report["factory"] == f"{factories}:mine" and report["clients"] == ["sync"]
    rows = {r["cell"]: r for r in report["results"]}
    builtin = tmp_path / "builtin"
    assert run_fault_matrix(["sync"], results_dir=str(builtin), cells=[DEAD_IN_FORWARD,
                            FAILED_ECHO], extra_cells=[], echo=None) == 0
    for r in json.loads((builtin / "fault_matrix.json").read_text())["results"]:
        # What the built-in client gives, detected within the same bound.
        assert rows[r["cell"]]["outcome"] == r["outcome"], (rows[r["cell"]], r)
    assert rows[DEAD_IN_FORWARD.name]["outcome"] == "dead"
    assert rows[DEAD_IN_FORWARD.name]["latency_ms"] is not None
    assert rows[FAILED_ECHO.name]["outcome"] == "utility_error"
    assert all(r["passed"] and r["leaks"] == {} for r in report["results"]
               if r["client"] == "sync")
    # The factory builds sync clients: the async cell is there, and says why it did not run.
    skipped = rows[ASYNC_CELL.name]
    assert skipped["outcome"] == "not_applicable" and "builds sync clients" in skipped["detail"]
    assert report["failed"] == 0 and report["not_applicable"] == 1


def test_the_kind_the_factory_builds_picks_the_cells(factories: str, tmp_path: Path) -> None:
    # No clients named: the quick matrix of the kind the factory builds, faults planted in
    # the in-process engine's hook; no frame cells (they need an engine process).
    status = run_fault_matrix(quick=True, results_dir=str(tmp_path), echo=None,
                              factory=load_factory(f"{factories}:in_process"))
    report = json.loads((tmp_path / "fault_matrix.json").read_text())
    assert status == 0, report
    assert report["clients"] == ["inproc"] and report["results"]
    assert all(r["client"] == "inproc" and r["passed"] for r in report["results"]), report


def test_refused_options_are_not_applicable_and_frame_cells_still_run(
        factories: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Of the interposer's cells, only the bit-flipped token frame (one engine, ~2 s).
    every = interposer.interposer_cells

    def one_frame_cell(*args: Any, **kwargs: Any) -> list[Any]:
        return [c for c in every(*args, **kwargs) if c.rule.action is FrameAction.BITFLIP
                and c.rule.direction == "to_client"][:1]

    monkeypatch.setattr(interposer, "interposer_cells", one_frame_cell)
    status, report = _matrix(tmp_path, f"{factories}:no_engine_faults",
                             [DEAD_IN_FORWARD, FAILED_ECHO])
    assert status == 0, report
    rows = {r["cell"]: r for r in report["results"]}
    for cell in (DEAD_IN_FORWARD, FAILED_ECHO):
        assert rows[cell.name]["outcome"] == "not_applicable", rows[cell.name]
        assert "no engine_fault" in rows[cell.name]["detail"]
        assert not rows[cell.name]["passed"]
    # The factory takes the proxy's addresses, so the frame cell is honoured: detected.
    (frame,) = [r for r in report["results"] if r["scenario"] == "frames"]
    assert frame["passed"] and frame["outcome"] == "dead" and "checksum" in frame["detail"]
    assert report["failed"] == 0 and report["not_applicable"] == 2


def test_a_factory_that_breaks_is_a_failure_row_not_a_crash(factories: str,
                                                            tmp_path: Path) -> None:
    # Builds a client as configured, but chokes on the cell's options.
    status, report = _matrix(tmp_path, f"{factories}:no_options", [DEAD_IN_FORWARD],
                             extra_cells=[])
    assert status == 1
    (row,) = report["results"]
    assert row["outcome"] == "harness_error" and not row["passed"]
    assert "TypeError" in row["detail"] and "NotApplicable" in row["detail"]
    # Cannot build a client at all: one row says so, and no cell runs.
    status, report = _matrix(tmp_path, f"{factories}:broken", [DEAD_IN_FORWARD],
                             extra_cells=[])
    assert status == 1 and report["failed"] == 1
    (row,) = report["results"]
    assert row["cell"] == f"factory {factories}:broken"
    assert "cannot build my client" in row["detail"] and "no cell ran" in row["detail"]


def test_the_command_line_takes_a_factory_and_refuses_a_bad_one(
        factories: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["faults", "matrix", "--results-dir", str(tmp_path / "res")]
    # The command reaches the factory: this one fails its row, exit 1, the table printed.
    assert main([*base, "--factory", f"{factories}:broken"]) == 1
    assert f"factory {factories}:broken" in capsys.readouterr().out
    for args, error in [
        (["--factory", "no_colon"], "expected module:function"),
        (["--factory", "ew_no_such_module:f"], "cannot import"),
        (["--factory", f"{factories}:missing"], "has no 'missing'"),
        (["--factory", f"{factories}:mine", "--engines", "2"], "data-parallel"),
        (["--factory", f"{factories}:mine", "--model", "tiny"], "drop --model"),
    ]:
        assert main([*base, *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("enginewire faults matrix: error: --factory"), err
        assert error in err and "Traceback" not in err, err
