"""States and events are symbols, never bare strings (style.md, principle 3).

Code above ``spec/`` names a state or an event through its enum member (``EngineState.IDLE``,
``EngineState.IDLE.name`` where a trace's text is compared), so renaming one in its table is a
NameError at import rather than a string that silently stops matching.
"""

from __future__ import annotations

import ast
from pathlib import Path

import enginewire.spec
from enginewire.spec import MACHINES

ROOT = Path(enginewire.spec.__file__).resolve().parent.parent
LAYERS = ("protocol", "runtime", "model_tests", "enginewire")

# (file, literal) -> why that literal is not a state or event of the spec.
NOT_SPEC_NAMES: dict[tuple[str, str], str] = {
    ("model_tests/mutant_runs.py", "ERROR"): "the mutant table's verdict for a crashed child run",
}


def _spec_names() -> set[str]:
    names: set[str] = set()
    for mach in MACHINES:
        names |= {s.name for s in mach.states} | {e.name for e in mach.events}
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def spelled_out_names(root: Path = ROOT) -> list[str]:
    """``path:line: 'NAME'`` for every string literal (docstrings aside) that is the name of
    a state or event of a spec machine, in the layers above ``spec/``."""
    names = _spec_names()
    hits: list[tuple[str, int, str]] = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"))
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                        and node.value in names and id(node) not in docs
                        and (rel, node.value) not in NOT_SPEC_NAMES):
                    hits.append((rel, node.lineno, node.value))
    return [f"{rel}:{line}: {value!r}" for rel, line, value in sorted(hits)]


def test_no_layer_spells_a_state_or_event_name_as_a_string() -> None:
    hits = spelled_out_names()
    assert not hits, "use the enum member (or its .name) instead of:\n" + "\n".join(hits)


def test_the_scan_sees_a_spelled_out_name(tmp_path: Path) -> None:
    # The check above can fail: a literal like the ones it forbids is found.
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    (tmp_path / "runtime" / "bad.py").write_text(
        '"""IDLE in a docstring is prose."""\nif state == "IDLE":\n    pass\n', encoding="utf-8")
    assert spelled_out_names(tmp_path) == ["runtime/bad.py:2: 'IDLE'"]


def test_exceptions_name_literals_that_are_no_spec_names() -> None:
    # An entry for a literal that is not a spec name, or that its file no longer holds, is stale.
    names = _spec_names()
    for (rel, literal), why in NOT_SPEC_NAMES.items():
        assert literal in names and why.strip(), (rel, literal)
        assert repr(literal) in (ROOT / rel).read_text(encoding="utf-8") or (
            f'"{literal}"' in (ROOT / rel).read_text(encoding="utf-8")), (rel, literal)
