"""Rule 1 (h11): what the runtime asks of a lifecycle state lives beside its machine.

A set of spec states spelled out in ``runtime/`` or ``model_tests/`` (installed as
``enginewire.testing``): ``frozenset({S.PAUSED, S.SLEEPING})``, ``state in (S.IDLE,
S.RUNNING)``, or the same set as a chain, ``st is S.SLEEPING or st is S.PAUSED``, is a copy of
knowledge the tables own: when a row is added, the copy silently disagrees. The named sets in
``spec/`` (``SCHEDULING``, ``REPORTS_SLEEPING``, ``ACCEPTS_WORK``, ``CLIENT_REQUEST_LIVE``, a
machine's ``terminal``...) are what that code reads; this test fails on a hand-written one."""

from __future__ import annotations

import ast
from enum import Enum
from pathlib import Path

import pytest

from enginewire.spec import MACHINES

ROOT = Path(__file__).resolve().parents[2]
# The code that reads the spec: the runtime and the campaign's oracle and harness.
SCANNED = ("runtime", "model_tests")
STATE_ENUMS: dict[str, type[Enum]] = {m.states.__name__: m.states for m in MACHINES}


def _aliases(tree: ast.Module) -> dict[str, type[Enum]]:
    """Names a module binds to a state enum: its own name, ``S = EngineState`` and
    ``S, E = EngineState, EngineEvent``."""
    names = dict(STATE_ENUMS)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        pairs: list[tuple[ast.expr, ast.expr]] = []
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            pairs = list(zip(target.elts, value.elts, strict=False))
        else:
            pairs = [(target, value)]
        for t, v in pairs:
            if isinstance(t, ast.Name) and isinstance(v, ast.Name) and v.id in STATE_ENUMS:
                names[t.id] = STATE_ENUMS[v.id]
    return names


def _is_state_member(node: ast.expr, aliases: dict[str, type[Enum]]) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in aliases and node.attr in aliases[node.value.id].__members__)


def _state_members(node: ast.expr, aliases: dict[str, type[Enum]]) -> int:
    if not isinstance(node, (ast.Set, ast.Tuple, ast.List)):
        return 0
    return sum(_is_state_member(elt, aliases) for elt in node.elts)


_IDENTITY_OPS = (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)


def _chained_state_tests(node: ast.expr, aliases: dict[str, type[Enum]]) -> int:
    """The most state members one subject is compared with (``is``, ``==`` and their
    negations) in one ``or``/``and`` chain: ``st is S.A or st is S.B`` is the set {A, B}
    spelled as code. Tests of different subjects (``a is S.A or b is T.B``) are no set."""
    if not isinstance(node, ast.BoolOp):
        return 0
    per_subject: dict[str, int] = {}
    for value in node.values:
        if not (isinstance(value, ast.Compare) and len(value.ops) == 1
                and isinstance(value.ops[0], _IDENTITY_OPS)):
            continue
        left, right = value.left, value.comparators[0]
        if _is_state_member(right, aliases):
            subject = left
        elif _is_state_member(left, aliases):
            subject = right
        else:
            continue
        key = ast.dump(subject)
        per_subject[key] = per_subject.get(key, 0) + 1
    return max(per_subject.values(), default=0)


def hand_written_state_sets(source: str, filename: str) -> list[str]:
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    return [f"{filename}:{node.lineno}: {ast.unparse(node)}"
            for node in ast.walk(tree)
            if isinstance(node, ast.expr) and (_state_members(node, aliases) >= 2
                                               or _chained_state_tests(node, aliases) >= 2)]


@pytest.mark.parametrize("folder", SCANNED)
def test_no_set_of_spec_states_is_spelled_out(folder: str) -> None:
    paths = sorted((ROOT / folder).glob("*.py"))
    assert paths, f"nothing to scan in {folder}/"
    found: list[str] = []
    for path in paths:
        found += hand_written_state_sets(path.read_text(encoding="utf-8"),
                                         str(path.relative_to(ROOT)))
    assert not found, "read the named sets beside each machine in spec/ instead:\n" + "\n".join(
        found)


@pytest.mark.parametrize("source", [
    "S, E = EngineState, EngineEvent\n_P = frozenset({S.PAUSED, S.SLEEPING})\n",
    "ok = state in (ClientState.DEAD, ClientState.SHUTDOWN)\n",
    "CS = ClientRequestState\nL = [CS.SENT, CS.STREAMING]\n",
    "S = EngineState\nif st is S.SLEEPING or st is S.PAUSED:\n    pass\n",
    "ok = lc.state == ClientState.DEAD or x or lc.state == ClientState.SHUTDOWN\n",
    "S = EngineState\nawake = st is not S.SLEEPING and st is not S.PAUSED\n",
])
def test_the_scan_sees_the_shapes_it_forbids(source: str) -> None:
    assert hand_written_state_sets(source, "example.py")


def test_one_state_or_other_enums_pass() -> None:
    assert not hand_written_state_sets(
        "S = EngineState\nx = state is S.IDLE\ny = (Mode.A, Mode.B)\n"
        "z = a is S.IDLE or b is ClientState.DEAD\nw = m is Mode.A or m is Mode.B\n",
        "example.py")
