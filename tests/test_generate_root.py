"""``generate --root``: the generated files are a function of the imported declarations, so
another checkout is accepted only if its declarations are the imported ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from enginewire._tools import generate

ROOT = Path(__file__).resolve().parents[1]


def _checkout_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "checkout"
    for name in ("spec", "protocol", "docs"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    # The one generated file outside spec/ and docs/: the utility wrappers; and the options
    # records, which docs/options.md is generated from.
    (copy / "runtime").mkdir()
    for name in ("_utilities.py", "options.py"):
        shutil.copy(ROOT / "runtime" / name, copy / "runtime" / name)
    return copy


def test_a_checkout_with_the_imported_declarations_is_checked(tmp_path: Path) -> None:
    copy = _checkout_copy(tmp_path)
    assert generate.main(["--check", "--root", str(copy)]) == 0


def test_a_checkout_with_other_declarations_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A changed table in the other checkout used to pass --check (rc 0): the imported
    tables were rendered and compared with that checkout's files."""
    copy = _checkout_copy(tmp_path)
    client = copy / "spec" / "client.py"
    client.write_text(client.read_text().replace(
        '        Transition(S.SHUTDOWN, E.SHUTDOWN, S.SHUTDOWN, note="shutdown is idempotent"),\n',
        ""))
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    assert generate.main(["--check", "--root", str(copy)]) == 3
    assert generate.main(["--root", str(copy)]) == 3
    assert "spec/client.py" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before  # untouched


def test_a_checkout_with_other_options_records_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/options.md is generated from runtime/options.py's fields, so it counts too."""
    copy = _checkout_copy(tmp_path)
    options = copy / "runtime" / "options.py"
    options.write_text(options.read_text() + "\n# changed\n")
    assert generate.main(["--check", "--root", str(copy)]) == 3
    assert "runtime/options.py" in capsys.readouterr().err
