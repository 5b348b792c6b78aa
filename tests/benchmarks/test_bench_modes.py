"""``bench --contended`` and ``bench --against-vllm``: the plumbing, never a time.

The background load must start the processes it says and leave none behind however the run
ends; the vLLM mode must refuse what it cannot run before it starts, and hand the round
script our interpreter and the vLLM one (a stand-in folder and a stand-in vLLM here: the real
comparison needs a 9 GB environment and runs outside CI)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from enginewire.benchmarks import run as bench_run
from enginewire.benchmarks.contention import BackgroundLoad, default_procs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0: read its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_background_load_runs_its_processes_and_reaps_them() -> None:
    with BackgroundLoad(2) as load:
        pids = load.pids
        assert len(pids) == 2 and all(_alive(p) for p in pids), pids
        # They spin: each takes CPU time while the benchmark would measure.
        ticks = [int(Path(f"/proc/{p}/stat").read_text().split()[13]) for p in pids]
    assert not any(_alive(p) for p in pids), "a background process outlived the load"
    assert load.pids == [] and load.describe()["procs"] == 2
    assert all(t >= 0 for t in ticks)


def test_background_load_is_stopped_when_the_run_fails() -> None:
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="measurement failed"), BackgroundLoad(1) as load:
        pids = load.pids
        raise RuntimeError("measurement failed")
    assert pids and not any(_alive(p) for p in pids)


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_background_load_refuses_a_bad_count(n: object) -> None:
    with pytest.raises(ValueError, match="at least one process"):
        BackgroundLoad(n)  # type: ignore[arg-type]


def test_default_is_one_process_per_core() -> None:
    assert default_procs() == len(os.sched_getaffinity(0))


def test_contended_run_records_its_load(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    assert bench_run.run_bench(quick=True, json_out=str(out), only=["spec"], contended=1) == 0
    data = json.loads(out.read_text())
    assert data["contended"] == 1 and data["machine"]["contended"]["procs"] == 1
    assert data["rows"], "no row measured"


def _bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "enginewire.benchmarks.run", *args],
                          capture_output=True, text=True, timeout=120,
                          env=None if env is None else dict(os.environ, **env))


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def fake_bench(tmp_path: Path) -> Path:
    """A folder shaped like shared/bench-vllm whose round script records what it was given."""
    d = tmp_path / "bench-vllm"
    d.mkdir()
    (d / "ew_bench.py").write_text("")
    (d / "vllm_bench.py").write_text("")
    (d / "run_interleaved.sh").write_text(
        'set -eu\n[ -f "$BENCH_ROOT/bench/ew_bench.py" ]\n'
        'echo "$1 $EW_PY $VL_PY ${3:-}" > "$2/rounds.txt"\n')
    (d / "summarize.py").write_text(
        "import sys\nopen(sys.argv[3], 'w').write('summary of ' + sys.argv[1])\n"
        "print('ratio table')\n")
    return d


@pytest.fixture
def fake_vllm_python(tmp_path: Path) -> Path:
    """An interpreter that imports a stand-in vllm package."""
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0.0-stand-in'\n")
    return _executable(tmp_path / "vpython",
                       f'#!/bin/sh\nPYTHONPATH={tmp_path / "site"} exec {sys.executable} "$@"\n')


def test_against_vllm_hands_the_round_script_both_interpreters(
        fake_bench: Path, fake_vllm_python: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = _bench("--against-vllm", str(fake_bench), "--rounds", "3", "--out", str(out),
                 "--vllm-python", str(fake_vllm_python), "--lean")
    assert res.returncode == 0, res.stderr
    rounds, ew_py, vl_py, extra = (out / "rounds.txt").read_text().split()
    assert (rounds, ew_py, vl_py, extra) == ("3", sys.executable, str(fake_vllm_python),
                                             "--delivery-only")
    assert (out / "summary.md").read_text() == f"summary of {out}"
    assert "ratio table" in res.stdout
    assert not any(fake_bench.glob("results*")), "wrote into the benchmark folder"


def test_against_vllm_contended_leaves_no_process(
        fake_bench: Path, fake_vllm_python: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = _bench("--against-vllm", str(fake_bench), "--rounds", "1", "--out", str(out),
                 "--contended", "2", env={"ENGINEWIRE_VLLM_PYTHON": str(fake_vllm_python)})
    assert res.returncode == 0, res.stderr
    assert "'procs': 2" in (out / "contended.txt").read_text()
    assert "beside 2 spinning processes" in res.stdout


@pytest.mark.parametrize(("args", "code", "says"), [
    (("--against-vllm", "/nonexistent-dir"), 2, "not a directory"),
    (("--against-vllm", "."), 2, "not the vLLM side-by-side benchmark"),
    (("--against-vllm", "{bench}", "--rounds", "0"), 2, "--rounds 0"),
    (("--against-vllm", "{bench}", "--only", "spec"), 2, "--only does not go"),
    (("--against-vllm", "{bench}"), 3, "ENGINEWIRE_VLLM_PYTHON"),
    (("--against-vllm", "{bench}", "--vllm-python", "{novllm}"), 3, "cannot import vllm"),
    (("--against-vllm", "{bench}", "--vllm-python", "/nonexistent/python"), 3,
     "not an executable"),
    (("--rounds", "3"), 2, "--rounds goes with --against-vllm"),
    (("--contended", "-2"), 2, "--contended -2"),
])
def test_bench_modes_refuse_before_running(fake_bench: Path, tmp_path: Path,
                                           args: tuple[str, ...], code: int, says: str) -> None:
    env = {"ENGINEWIRE_VLLM_PYTHON": ""}
    # An interpreter without vllm, whatever this one has installed.
    novllm = _executable(tmp_path / "novllm", f'#!/bin/sh\nexec {sys.executable} -I -c'
                         ' "raise ModuleNotFoundError(\'No module named vllm\')"\n')
    res = _bench(*(a.format(bench=fake_bench, novllm=novllm) for a in args), env=env)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == code, res.stderr
    assert len(lines) == 1 and says in lines[0], res.stderr
    assert not (fake_bench / "rounds.txt").exists()
