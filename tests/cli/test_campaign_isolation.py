"""A campaign keeps its files under --results-dir, and a crashed mutant child is an error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from enginewire.testing import campaign, mutant_runs


def test_campaign_leaves_nothing_in_the_current_directory(tmp_path: Path) -> None:
    cwd, results = tmp_path / "cwd", tmp_path / "results"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_STORAGE_DIRECTORY"}
    # Seeded, so every run is the same; its report, logs and Hypothesis' files go to results.
    res = subprocess.run(
        [sys.executable, "-m", "enginewire", "campaign", "--client", "inproc", "--model", "null",
         "--examples", "2", "--steps", "5", "--seed", "5", "--results-dir", str(results)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )
    # 1 would be a campaign failure, which is not this test's business.
    assert res.returncode in (0, 1), res.stderr[-2000:]
    assert list(results.glob("campaign-*.json"))
    assert sorted(p.name for p in cwd.iterdir()) == []


def test_hypothesis_storage_points_at_the_results_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A campaign's draws come from its seed alone (_seed_only_draws), so Hypothesis may write
    # nothing in a short run; where it would write is checked here instead.
    from hypothesis.configuration import set_hypothesis_home_dir, storage_directory

    monkeypatch.delenv("HYPOTHESIS_STORAGE_DIRECTORY", raising=False)
    previous = campaign._hypothesis_home(tmp_path)
    try:
        where = storage_directory("constants", intent_to_write=False).path
        assert Path(where).is_relative_to(tmp_path / ".hypothesis"), where
    finally:
        set_hypothesis_home_dir(previous)
    assert storage_directory(intent_to_write=False).home_directory == previous  # restored


def test_crashed_mutant_child_is_an_error_not_a_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Only the child sees this PYTHONPATH: its `import hypothesis` fails, as without the extra.
    block = tmp_path / "block" / "hypothesis"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'hypothesis'\", name='hypothesis')\n")
    monkeypatch.setenv("PYTHONPATH", str(block.parent))
    rc = campaign.run_campaign(client="inproc", mutant="duplicate_live_id_accepted",
                               examples=1, steps=2, results_dir=str(tmp_path / "results"))
    out, err = capsys.readouterr()
    assert rc == campaign.MUTANT_ERROR == 3
    assert "not detected" not in out
    assert "ERROR" in err and "ModuleNotFoundError" in err
    row = {"mutant": "m", "applicable": True, "detected": False, "error": True}
    assert mutant_runs._verdict(row) == "ERROR"
