"""`python -m enginewire.benchmarks.run` is `enginewire bench`: one parser, checks up front."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from enginewire.benchmarks import run as bench_run


def _module(*args: str) -> subprocess.CompletedProcess[str]:
    # Every case must stop at argument checking; the timeout catches a benchmark that starts.
    return subprocess.run([sys.executable, "-m", "enginewire.benchmarks.run", *args],
                          capture_output=True, text=True, timeout=30)


def test_module_help_is_the_bench_help() -> None:
    res = _module("--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: enginewire bench") and "--only" in res.stdout


@pytest.mark.parametrize(("args", "says"), [
    (("--bogus",), "--bogus"),
    (("--only", "nosuch"), "--only"),
    (("--only", "spec", "--json", "/nonexistent-dir/b.json"), "--json"),
    (("--only", "spec", "--plot", "/nonexistent-dir/b.png"), "--plot"),
    (("--engines", "1"), "--engines"),
    (("--only", "dp", "--engines", "0"), "--engines"),
])
def test_module_refuses_bad_usage_before_running(args: tuple[str, ...], says: str) -> None:
    res = _module(*args)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and says in lines[0], res.stderr
    assert res.stdout == ""


def test_run_bench_checks_output_paths_before_measuring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("measured before checking the output path")

    monkeypatch.setattr(bench_run, "collect", no_run)
    with pytest.raises(ValueError, match="does not exist"):
        bench_run.run_bench(quick=True, json_out=str(tmp_path / "no" / "b.json"), only=["spec"])
    with pytest.raises(ValueError, match="is a directory"):
        bench_run.run_bench(quick=True, json_out=str(tmp_path), only=["spec"])


def test_the_dp_section_runs_on_two_engines_unless_told_and_refuses_fewer_up_front(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44: the CLI's default ``--engines`` (then 1) reached ``bench_dp`` in the full and
    quick runs, which refused it after every other section had measured."""
    seen: list[tuple[list[str] | None, int]] = []

    def run_bench(**kw: Any) -> int:
        bench_run._selection(kw["only"], kw["engines"])  # what collect would check first
        seen.append((kw["only"], kw["engines"]))
        return 0

    monkeypatch.setattr(bench_run, "run_bench", run_bench)
    for argv in ([], ["--quick"], ["--only", "dp"], ["--engines", "3"]):
        assert bench_run.main(argv) == 0, argv
    assert seen == [(None, 2), (None, 2), (["dp"], 2), (["dp"], 3)]

    def no_measuring(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("measured before checking the sections' arguments")

    monkeypatch.undo()
    monkeypatch.setattr(bench_run, "_machine", no_measuring)
    monkeypatch.setattr("enginewire.benchmarks.floor.freeze_heap", no_measuring)
    for call in (lambda: bench_run.run_bench(quick=True, engines=1),
                 lambda: bench_run.collect(quick=True, engines=1),
                 lambda: bench_run.collect(quick=True, only=["echo", "dp"], engines=0)):
        with pytest.raises(ValueError, match="dp section"):
            call()
