"""What a wheel install gets: every package, its data, types, license, entry point, version;
and the generator refuses to write into an installed package.

The wheel is built from a copy of this tree without build isolation (no network): the test
skips when the installed setuptools cannot build it, never when the build itself is wrong.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path

import pytest

import enginewire
from enginewire._tools import generate

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("enginewire", "enginewire/spec", "enginewire/protocol", "enginewire/runtime",
            "enginewire/testing", "enginewire/benchmarks")
_SKIP_DIRS = {".git", ".venv", "build", "dist", "results", "__pycache__", ".hypothesis",
              ".pytest_cache", ".mypy_cache", ".ruff_cache"}


def _setuptools_can_build() -> str | None:
    """Why a build without isolation cannot work here, or None."""
    try:
        import setuptools
    except ImportError:
        return "setuptools is not installed"
    major = int(setuptools.__version__.split(".")[0])
    if major < 77:  # pyproject's build-system floor (license-files, SPDX license)
        return f"setuptools {setuptools.__version__} < 77"
    return None


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of this tree without build outputs, so building leaves the checkout alone."""
    why = _setuptools_can_build()
    if why:
        pytest.skip(f"cannot build offline: {why}")
    copy = tmp_path_factory.mktemp("build") / "src"
    shutil.copytree(REPO, copy, ignore=lambda d, names: [
        n for n in names if n in _SKIP_DIRS or n.endswith((".egg-info", ".pyc"))])
    return copy


@pytest.fixture(scope="module")
def wheel(src: Path) -> Iterator[Path]:
    tmp = src.parent
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(tmp / "dist"), str(src)],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    (built,) = (tmp / "dist").glob("enginewire-*.whl")
    yield built


def test_wheel_holds_every_package_typed_and_licensed(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        meta = Parser().parsestr(zf.read(f"{info}/METADATA").decode())
        entry = configparser.ConfigParser()
        entry.read_string(zf.read(f"{info}/entry_points.txt").decode())
    for pkg in PACKAGES:
        assert f"{pkg}/__init__.py" in names, pkg
        assert f"{pkg}/py.typed" in names, f"{pkg}: no py.typed"
    for f in ("enginewire/spec/_tables.py", "enginewire/spec/enginewire.pml",
              "enginewire/__main__.py", "enginewire/cli.py", "enginewire/_tools/generate.py"):
        assert f in names, f
    assert f"{info}/licenses/LICENSE" in names
    assert meta["Version"] == enginewire.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["License-File"] == "LICENSE"
    assert entry["console_scripts"]["enginewire"] == "enginewire.cli:main"
    assert not [n for n in names if "__pycache__" in n or n.startswith(("tests/", "model_tests/"))]


def test_license_is_the_apache_license() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_generator_in_a_wheel_install_refuses_to_write(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    before = sorted(p.relative_to(site) for p in site.rglob("*"))
    env = dict(os.environ, PYTHONPATH=str(site))
    for args in (["--check"], []):
        res = subprocess.run(
            [sys.executable, "-m", "enginewire._tools.generate", *args], cwd=tmp_path,
            env=env, capture_output=True, text=True, timeout=60,
        )
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 3, res.stdout + res.stderr
        assert len(lines) == 1 and "--root PATH" in lines[0], res.stderr
        assert str(site) in lines[0], "the import did not come from the unpacked wheel"
    assert sorted(p.relative_to(site) for p in site.rglob("*")
                  if "__pycache__" not in p.parts) == [
        p for p in before if "__pycache__" not in p.parts]
    # --root names where to write: the installed generator writes there, then finds it fresh.
    out = tmp_path / "checkout"
    out.mkdir()
    for args, rc in ((["--check"], 1), ([], 0), (["--check"], 0)):
        res = subprocess.run(
            [sys.executable, "-m", "enginewire._tools.generate", *args, "--root", str(out)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
        )
        assert res.returncode == rc, (args, res.stdout, res.stderr)
    assert (out / "spec" / "_tables.py").is_file()


def test_generator_default_root_must_be_a_checkout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert generate.is_checkout(generate.ROOT)  # this tree
    monkeypatch.setattr(generate, "ROOT", tmp_path)
    for args in (["--check"], []):
        assert generate.main(args) == 3
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "not an enginewire source checkout" in line and "--root PATH" in line
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(generate.NotACheckoutError):
        generate.write_generated()
    with pytest.raises(SystemExit):
        generate.main(["--help"])
    assert "--root PATH" in capsys.readouterr().out


def test_sdist_carries_what_its_tests_need(src: Path) -> None:
    out = src.parent / "sdist"
    res = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta; "
         "print(build_meta.build_sdist(sys.argv[1]))", str(out)],
        cwd=src, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (sdist,) = out.glob("enginewire-*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for f in ("LICENSE", "README.md", "pyproject.toml", "MANIFEST.in", ".ci/run",
              "scripts/bootstrap.sh", "scripts/typecheck.sh", "docs/index.md",
              "docs/benchmarks.md", "tests/test_packaging.py", "tests/cli/test_help.py",
              "spec/_tables.py", "model_tests/py.typed"):
        assert f in names, f
    assert len([n for n in names if n.startswith("tests/") and n.endswith(".py")]) > 20
    assert not [n for n in names if "__pycache__" in n or n.startswith("results/")]
