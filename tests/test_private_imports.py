"""Our modules import only public names from each other (trio's ``_core`` style).

A name with a leading underscore has one owner, the module that defines it, which may change
or drop it without looking elsewhere. Where two modules share something, the seam between
them is a public name, and the underscore goes on the module instead: the private
``runtime/_engine_link.py`` defines ``Link``, not ``_Link``. So no module of ours, in any
installed package, takes a ``_name`` from another with ``from ... import`` (relative, or
absolute from ``enginewire``), whether at the top, inside a function or under
``TYPE_CHECKING``. Importing a private *module* (``from . import _cells``) is the style, not a
breach; dunders (``__version__``) are not private; tests may still reach into privates.
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> import name under enginewire (pyproject.toml's package-dir; tests/test_layering.py
# checks that this mapping names every installed package)
LAYERS = {"spec": "spec", "protocol": "protocol", "runtime": "runtime",
          "model_tests": "testing", "benchmarks": "benchmarks", "enginewire": ""}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, sub in LAYERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(["enginewire", *([sub] if sub else []), *parts])] = path
    return found


MODULES = _modules()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(module: str, source: str, is_package: bool = False,
                    known: Collection[str] | None = None) -> list[tuple[int, str]]:
    """``(line, statement)`` for each private name ``module`` imports from a module of ours;
    ``known`` (default: every module of ours) tells an imported private module from a name."""
    known = MODULES if known is None else known
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")
            target = ".".join(base[:len(base) - node.level + 1]
                              + ([node.module] if node.module else []))
        else:
            target = node.module or ""
            if target != "enginewire" and not target.startswith("enginewire."):
                continue
        for alias in node.names:
            if _is_private(alias.name) and f"{target}.{alias.name}" not in known:
                written = "." * node.level + (node.module or "")
                found.append((node.lineno, f"from {written} import {alias.name}"))
    return found


def test_no_module_imports_a_private_name_of_another() -> None:
    bad = [f"  {path.relative_to(ROOT).as_posix()}:{line}: {statement}"
           for module, path in MODULES.items()
           for line, statement in private_imports(module, path.read_text(encoding="utf-8"),
                                                  path.name == "__init__.py")]
    assert not bad, (
        "a private name is its module's own; make it public where it is defined (drop the"
        " underscore, keep it on the module) and import that:\n" + "\n".join(bad))


def test_the_scan_covers_every_package() -> None:
    for folder in LAYERS:
        assert any(p.parent == ROOT / folder for p in MODULES.values()), folder


KNOWN = ("enginewire.runtime.a", "enginewire.runtime._mod", "enginewire.testing._cells")


@pytest.mark.parametrize("source, flagged", [
    ("from .a import _b\n", [(1, "from .a import _b")]),
    ("from .a import b, _c as c\n", [(1, "from .a import _c")]),
    ("from ..spec.compose import _ix\n", [(1, "from ..spec.compose import _ix")]),
    ("from enginewire.runtime.a import _b\n", [(1, "from enginewire.runtime.a import _b")]),
    ("def f():\n    from ._mod import _b\n", [(2, "from ._mod import _b")]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import _T\n",
     [(3, "from .a import _T")]),
    ("from .a import b\n", []),
    ("from .a import __version__\n", []),
    ("from . import _mod\n", []),
    ("from ..testing import _cells as cells\n", []),
    ("from enginewire.runtime import _mod\n", []),
    ("from os import _exit\n", []),
])
def test_the_check_flags_a_private_name_and_nothing_else(
        source: str, flagged: list[tuple[int, str]]) -> None:
    assert private_imports("enginewire.runtime.x", source, known=KNOWN) == flagged
