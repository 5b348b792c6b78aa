"""`enginewire faults matrix --model NAME`: the harness from the command line against a model of
the user's own (a weight source registered by name in ENGINEWIRE_WEIGHT_SOURCES), and a name
nothing knows refused before any cell runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

MY_WEIGHTS = textwrap.dedent("""
    import os
    from enginewire.runtime.model import LlamaArch, TinyRandomSource

    def my_source(model, seed):
        with open(os.environ["EW_CLI_MARK"], "a") as f:  # proof the engine loaded this one
            f.write(f"{model}\\n")
        return TinyRandomSource(seed, LlamaArch(num_layers=1), model)
""")


def _matrix(tmp_path: Path, model: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "enginewire", "faults", "matrix", "--model", model,
         "--client", "inproc", "--quick", "--results-dir", str(tmp_path / "res")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "ENGINEWIRE_ENGINE_THREADS": "1", **env})


def test_the_matrix_runs_on_a_registered_weight_source(tmp_path: Path) -> None:
    (tmp_path / "ew_cli_weights.py").write_text(MY_WEIGHTS)
    mark = tmp_path / "mark"
    proc = _matrix(tmp_path, "mine", PYTHONPATH=str(tmp_path), EW_CLI_MARK=str(mark),
                   ENGINEWIRE_WEIGHT_SOURCES=json.dumps({"mine": "ew_cli_weights:my_source"}))
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "cells as the spec requires" in proc.stdout
    assert set(mark.read_text().split()) == {"mine"}  # every engine of the run loaded it


def test_an_unknown_model_is_refused_before_any_cell(tmp_path: Path) -> None:
    proc = _matrix(tmp_path, "no-such-model", ENGINEWIRE_WEIGHT_SOURCES="{}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("enginewire faults matrix: error: --model:"), proc.stderr
    assert "unknown model" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "res" / "fault_matrix.json").exists()


def test_a_missing_gguf_file_is_the_environment(tmp_path: Path) -> None:
    proc = _matrix(tmp_path, str(tmp_path / "absent.gguf"))
    assert proc.returncode == 3, proc.stderr
    assert "absent.gguf" in proc.stderr and "Traceback" not in proc.stderr
