"""``to_transitions`` gives a ``transitions`` machine that agrees with ``Lifecycle`` on every
(state, event, guard): each row fires to the same state, and every other combination is refused
by both (``SpecViolation``, ``MachineError``) with the state unchanged."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest

from enginewire.spec import CLIENT, MACHINES, Lifecycle, Machine, SpecViolation, to_transitions
from enginewire.spec.client import FULLY_AWAKE, PARTIALLY_AWAKE

transitions = pytest.importorskip("transitions")

# A guard no machine declares: refused everywhere, like any other non-row.
_UNKNOWN_GUARD = "no_such_guard"


class _Model:
    """A user's own model object: ``to_transitions`` binds ``state`` and triggers onto it."""


def _guards(mach: Machine[Any, Any]) -> list[str | None]:
    return [None, *sorted({t.guard for t in mach.transitions if t.guard}), _UNKNOWN_GUARD]


@pytest.mark.parametrize("send_event", [False, True], ids=["args", "send_event"])
@pytest.mark.parametrize("mach", MACHINES, ids=lambda m: m.name)
def test_every_state_event_and_guard_agrees_with_lifecycle(
    mach: Machine[Any, Any], send_event: bool
) -> None:
    table = mach.table()
    fired: set[tuple[Any, Any, str | None]] = set()
    for state in mach.states:
        model = _Model()
        theirs = to_transitions(mach, model=model, initial=state, send_event=send_event)
        for event in mach.events:
            for guard in _guards(mach):
                where = (mach.name, state.name, event.name, guard)
                theirs.set_state(state.value, model)
                ours: Lifecycle[Any, Any] = Lifecycle(mach.name, state, mach.compiled())
                may = getattr(model, f"may_{event.value}")(guard=guard)
                assert may == ours.can(event, guard), where

                try:
                    ours.fire(event, guard)
                    ours_after = ours.state.value
                except SpecViolation:
                    assert ours.state is state, where
                    ours_after = None
                try:
                    assert getattr(model, event.value)(guard=guard) is True, where
                    theirs_after = model.state  # type: ignore[attr-defined]
                except transitions.MachineError:
                    assert model.state == state.value, where  # type: ignore[attr-defined]
                    theirs_after = None

                assert theirs_after == ours_after, where
                expected = table.get((state, event, guard))
                assert ours_after == (None if expected is None else expected.value), where
                if expected is not None:
                    fired.add((state, event, guard))
                    if state in mach.terminal:
                        assert expected in mach.terminal, where
    assert fired == set(table), mach.name


@pytest.mark.parametrize("mach", MACHINES, ids=lambda m: m.name)
def test_states_triggers_rows_and_finals_are_read_from_the_declaration(
    mach: Machine[Any, Any],
) -> None:
    m = to_transitions(mach)
    assert list(m.states) == [s.value for s in mach.states]
    assert list(m.events) == [e.value for e in mach.events]
    assert m.state == mach.initial.value
    assert {n for n, s in m.states.items() if s.final} == {
        s.value for s in mach.terminal | mach.forgets}
    rows = sorted(
        (src, name, tr.dest, cond.func.guard or "")  # type: ignore[union-attr]
        for name, ev in m.events.items()
        for src, trs in ev.transitions.items()
        for tr in trs
        for cond in tr.conditions
    )
    assert rows == sorted(
        (t.source.value, t.event.value, t.target.value, t.guard or "") for t in mach.transitions
    )
    # No auto transitions: nothing but a row assigns a state.
    assert not any(name.startswith("to_") for name in m.events)


def test_stepping_interactively_with_positional_and_keyword_guards() -> None:
    client = to_transitions(CLIENT)
    client.handshake_ok()
    client.sleep_acked()
    client.wake_acked(PARTIALLY_AWAKE)
    assert client.state == "sleeping"
    with pytest.raises(transitions.MachineError, match="guard None"):
        client.wake_acked()
    assert client.state == "sleeping"
    client.wake_acked(guard=FULLY_AWAKE)
    assert client.state == "running"


def test_bad_arguments_are_refused_with_a_sentence() -> None:
    with pytest.raises(TypeError, match="auto_transitions"):
        to_transitions(CLIENT, auto_transitions=True)
    with pytest.raises(TypeError, match="ClientState"):
        to_transitions(CLIENT, initial="ready")  # type: ignore[arg-type]


def _graph_labels(mach: Machine[Any, Any]) -> list[str]:
    return [t.event.value + (f" [{t.guard}]" if t.guard else "") for t in mach.transitions]


@pytest.mark.parametrize("mach", MACHINES, ids=lambda m: m.name)
def test_graph_machine_draws_every_row_with_mermaid(mach: Machine[Any, Any]) -> None:
    # The mermaid engine ships inside transitions: no Graphviz needed, so this never skips.
    from transitions.extensions import GraphMachine

    m = to_transitions(mach, graph=True, graph_engine="mermaid")
    assert isinstance(m, GraphMachine)
    source = m.get_graph().draw(None)
    assert f"[*] --> {mach.initial.value}" in source
    for t, label in zip(mach.transitions, _graph_labels(mach), strict=True):
        edge = next(line for line in source.splitlines()
                    if line.strip().startswith(f"{t.source.value} --> {t.target.value}:"))
        assert label in [s.strip() for s in edge.split(":", 1)[1].split("|")], (t, edge)


@pytest.mark.skipif(
    importlib.util.find_spec("graphviz") is None and importlib.util.find_spec("pygraphviz") is None,
    reason="neither the graphviz nor the pygraphviz Python package is installed",
)
def test_graph_machine_builds_with_graphviz() -> None:
    m = to_transitions(CLIENT, graph=True, graph_engine="graphviz")
    assert "wake_acked [fully_awake]" in str(m.get_graph())


@pytest.mark.parametrize("missing, graph", [
    ("transitions", False), ("transitions", True), ("transitions.extensions.diagrams", True),
])
def test_missing_transitions_names_the_install(
    monkeypatch: pytest.MonkeyPatch, missing: str, graph: bool
) -> None:
    # None in sys.modules makes the import fail, as if the package were not installed.
    monkeypatch.setitem(sys.modules, missing, None)
    with pytest.raises(ImportError, match=r"pip install transitions.*enginewire\[docs\]"):
        to_transitions(CLIENT, graph=graph)
