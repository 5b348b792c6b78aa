"""Every Python example in the docs is checked against the code it shows: it compiles, what it
imports exists, every name it calls is imported or defined in the example, and every call to
an enginewire callable binds to its signature (a missing keyword-only argument, a positional
one the callable refuses, an unknown keyword). The README's example is also run whole
(tests/test_readme.py); these use placeholder paths and configs, so they are not run."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# Names an example may use without defining them: the reader's own objects.
PLACEHOLDERS = {"config", "my_config", "MY_CONFIG"}


def _examples() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
            found.append((f"{path.relative_to(ROOT)}#{i}", code))
    return found


EXAMPLES = _examples()


def _bound_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _imported(tree: ast.AST) -> dict[str, Any]:
    """Name -> object for every ``from enginewire... import name`` (it must exist)."""
    objs: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                if node.module.startswith("enginewire"):
                    objs[alias.asname or alias.name] = getattr(module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
    return objs


def test_the_docs_have_examples() -> None:
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("where,code", EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_doc_example_matches_the_code(where: str, code: str) -> None:
    tree = ast.parse(code, where)
    compile(tree, where, "exec")
    objs = _imported(tree)
    known = _bound_names(tree) | set(dir(builtins)) | PLACEHOLDERS
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        name = node.func.id
        assert name in known, f"{where}: {name}() is called but never imported or defined"
        target = objs.get(name)
        if target is None or any(isinstance(a, ast.Starred) for a in node.args) or any(
                k.arg is None for k in node.keywords):
            continue
        try:
            sig = inspect.signature(target)
        except (TypeError, ValueError):
            continue
        try:
            sig.bind(*[None] * len(node.args), **{k.arg: None for k in node.keywords
                                                   if k.arg is not None})
        except TypeError as e:
            raise AssertionError(f"{where}: {name}(...) does not fit {name}{sig}: {e}") from e
