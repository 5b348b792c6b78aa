"""Rule 1 (h11): what the runtime asks of a lifecycle state lives beside its machine.

A set of spec states spelled out in ``runtime/`` (``frozenset({S.PAUSED, S.SLEEPING})``, or
``state in (S.IDLE, S.RUNNING)``) is a copy of knowledge the tables own: when a row is added,
the copy silently disagrees. The named sets in ``spec/`` (``SCHEDULING``,
``REPORTS_SLEEPING``, ``ACCEPTS_WORK``, ``CLIENT_REQUEST_LIVE``, a machine's ``terminal``...)
are what runtime code reads; this test fails on a hand-written one."""

from __future__ import annotations

import ast
from enum import Enum
from pathlib import Path

import pytest

from enginewire.spec import MACHINES

ROOT = Path(__file__).resolve().parents[2]
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


def _state_members(node: ast.expr, aliases: dict[str, type[Enum]]) -> int:
    if not isinstance(node, (ast.Set, ast.Tuple, ast.List)):
        return 0
    count = 0
    for elt in node.elts:
        if (isinstance(elt, ast.Attribute) and isinstance(elt.value, ast.Name)
                and elt.value.id in aliases and elt.attr in aliases[elt.value.id].__members__):
            count += 1
    return count


def hand_written_state_sets(source: str, filename: str) -> list[str]:
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    return [f"{filename}:{node.lineno}: {ast.unparse(node)}"
            for node in ast.walk(tree)
            if isinstance(node, ast.expr) and _state_members(node, aliases) >= 2]


def test_runtime_spells_out_no_set_of_spec_states() -> None:
    found: list[str] = []
    for path in sorted((ROOT / "runtime").glob("*.py")):
        found += hand_written_state_sets(path.read_text(encoding="utf-8"),
                                         str(path.relative_to(ROOT)))
    assert not found, "read the named sets beside each machine in spec/ instead:\n" + "\n".join(
        found)


@pytest.mark.parametrize("source", [
    "S, E = EngineState, EngineEvent\n_P = frozenset({S.PAUSED, S.SLEEPING})\n",
    "ok = state in (ClientState.DEAD, ClientState.SHUTDOWN)\n",
    "CS = ClientRequestState\nL = [CS.SENT, CS.STREAMING]\n",
])
def test_the_scan_sees_the_shapes_it_forbids(source: str) -> None:
    assert hand_written_state_sets(source, "example.py")


def test_one_state_or_other_enums_pass() -> None:
    assert not hand_written_state_sets(
        "S = EngineState\nx = state is S.IDLE\ny = (Mode.A, Mode.B)\n", "example.py")
