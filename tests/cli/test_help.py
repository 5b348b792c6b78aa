"""`enginewire --help` and every subcommand's help describe every option in a sentence."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from enginewire.cli import build_parser, main


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))


def test_every_option_and_subcommand_has_help() -> None:
    seen = []
    for path, parser in _walk(build_parser()):
        seen.append(" ".join(path))
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    assert choice.help, f"{path} {choice.dest}: no help"
                continue
            assert action.help and len(action.help) > 8, f"{' '.join(path)} {action.dest}"
    for cmd in ("spec check", "spec diagrams", "generate", "engine", "bench", "faults matrix",
                "campaign"):
        assert cmd in seen


def test_every_option_with_a_default_shows_it_in_help() -> None:
    # docs/index.md: "`enginewire COMMAND --help` lists every flag with its default".
    missing = []
    for path, parser in _walk(build_parser()):
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            default = action.default
            if (not action.option_strings or default in (None, False, argparse.SUPPRESS)
                    or isinstance(action, argparse._HelpAction)):
                continue
            shown = {str(default), "on" if default is True else str(default)}
            if not any(f"default: {v}" in text or f"default {v}" in text for v in shown):
                missing.append(f"{' '.join(path)} {action.option_strings[0]}={default!r}")
    assert not missing, missing


def test_help_exits_zero_and_bad_usage_exits_two(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ok:
        main(["--help"])
    assert ok.value.code == 0
    assert "Exit codes" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        main(["no-such-command"])
    assert bad.value.code == 2


def test_version_and_python_dash_m(capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess
    import sys

    import enginewire

    with pytest.raises(SystemExit) as ok:
        main(["--version"])
    assert ok.value.code == 0
    assert capsys.readouterr().out.strip() == f"enginewire {enginewire.__version__}"
    res = subprocess.run([sys.executable, "-m", "enginewire", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stdout.strip()) == (0, f"enginewire {enginewire.__version__}")


def test_diagrams_help_shows_the_default_and_the_run_says_where_it_wrote(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["spec", "diagrams", "--help"])
    assert "default: docs/diagrams" in " ".join(capsys.readouterr().out.split())
    monkeypatch.chdir(tmp_path)
    assert main(["spec", "diagrams"]) == 0
    out, err = capsys.readouterr()
    target = tmp_path / "docs" / "diagrams"
    assert f"to {target}" in err
    assert sorted(p.name for p in target.iterdir()) == sorted(Path(ln).name
                                                              for ln in out.split())
