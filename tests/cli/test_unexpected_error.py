"""An exception no handler expected is still the closed exit codes' business: exit 1 with one
line on stderr that names it and the file holding its traceback, never a traceback (issue
44: `enginewire bench --quick` ended in one). Every subcommand, and the bench's own module."""

from __future__ import annotations

import argparse
import itertools
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginewire import cli
from enginewire.benchmarks import run as bench_run

# Each subcommand's handler as cli.build_parser finds it, and a command line that reaches it.
SUBCOMMANDS = {
    "_spec_check": ["spec", "check", "--no-spin"],
    "_spec_diagrams": ["spec", "diagrams", "--out", "{tmp}"],
    "_campaign": ["campaign", "--client", "inproc"],
    "_faults_matrix": ["faults", "matrix", "--quick"],
    "_generate": ["generate", "--model", "null"],
    "_engine": ["engine", "--input-address", "ipc://{tmp}/i", "--output-address",
                "ipc://{tmp}/o"],
    "_monitor": ["monitor", "--replay", "{tmp}/capture"],
}


def _boom(args: Any) -> int:
    raise RuntimeError("a bug\nover two lines")


def _the_line(err: str, prog: str) -> Path:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    m = re.fullmatch(rf"{prog}: error: unexpected RuntimeError: a bug over two lines "
                     r"\(a bug: please report it; traceback in (\S+)\)", lines[0])
    assert m, lines[0]
    return Path(m.group(1))


def _saved(path: Path) -> str:
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # another user must not read it
        text = path.read_text()
    finally:
        path.unlink(missing_ok=True)
    assert "Traceback" in text and "RuntimeError: a bug" in text
    return text


def test_every_subcommand_ends_an_unexpected_error_in_one_line_and_exit_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser()
    tried = {("bench",)}
    for name, argv in SUBCOMMANDS.items():
        monkeypatch.setattr(cli, name, _boom)
        args = [a.format(tmp=tmp_path) for a in argv]
        assert cli.main(args) == cli.EXIT_FAILED, name
        prog = cli._prog(parser, parser.parse_args(args))
        assert _saved(_the_line(capsys.readouterr().err, prog)).startswith(prog)
        tried.add(tuple(itertools.takewhile(lambda w: not w.startswith("-"), argv)))
    monkeypatch.setattr(bench_run, "bench_command", _boom)
    assert cli.main(["bench", "--quick"]) == cli.EXIT_FAILED
    _saved(_the_line(capsys.readouterr().err, "enginewire bench"))
    assert bench_run.main(["--quick"]) == cli.EXIT_FAILED  # python -m enginewire.benchmarks.run
    _saved(_the_line(capsys.readouterr().err, "enginewire bench"))
    # Every subcommand the parser has was tried (a new one must be added above).
    assert set(_leaves(parser)) == tried


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
            ) -> Iterator[tuple[str, ...]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path
        return
    for name, sub in subs[0].choices.items():
        yield from _leaves(sub, (*path, name))


def test_a_missing_module_that_no_extra_installs_is_unexpected_too(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def missing(args: Any) -> int:
        raise ModuleNotFoundError("No module named 'nosuch'", name="nosuch")

    monkeypatch.setattr(cli, "_generate", missing)
    assert cli.main(["generate", "--model", "null"]) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unexpected ModuleNotFoundError" in err, err
    Path(err.rsplit("traceback in ", 1)[1].rstrip(")\n")).unlink()


def test_the_process_exits_1_with_one_line(tmp_path: Path) -> None:
    # As a user meets it: the console's own process, no pytest around it to catch anything.
    code = ("import sys\n"
            "from enginewire import cli\n"
            "def boom(args):\n"
            "    raise RuntimeError('a bug\\nover two lines')\n"
            "cli._spec_diagrams = boom\n"
            f"sys.exit(cli.main(['spec', 'diagrams', '--out', {str(tmp_path)!r}]))\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where the traceback file goes
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 1, res.stderr
    saved = _the_line(res.stderr, "enginewire spec diagrams")
    assert saved.parent == tmp_path
    _saved(saved)
