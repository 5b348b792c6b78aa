"""The campaign and the quick fault matrix with the engine on CUDA, each in a fresh process (as
a user runs them: the first CUDA use happens inside the run, which is what broke the
in-process leak check on the first H200 lease). Skipped without CUDA; ``scripts/gpu_check.sh``
runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from enginewire.testing.campaign import ALL_CLIENTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_STORAGE_DIRECTORY"}
    return subprocess.run([sys.executable, "-m", "enginewire", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_ci_campaign_on_a_cuda_engine_passes_for_every_client(tmp_path: Path) -> None:
    # The README's campaign (derandomized: the same programs as on the CPU), device auto.
    res = _run(["campaign", "--client", "all", "--examples", "3", "--steps", "15",
                "--model", "tiny", "--results-dir", str(tmp_path)], tmp_path, 240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    (report,) = tmp_path.glob("campaign-*.json")
    clients = json.loads(report.read_text())["clients"]
    assert [c["client"] for c in clients] == list(ALL_CLIENTS)  # standalone and dp ones too


def test_the_quick_fault_matrix_on_a_cuda_engine_is_as_the_spec_requires(tmp_path: Path) -> None:
    res = _run(["faults", "matrix", "--quick", "--results-dir", str(tmp_path)], tmp_path, 240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    report = json.loads((tmp_path / "fault_matrix.json").read_text())
    assert report["results"] and all(r["passed"] for r in report["results"]), report
