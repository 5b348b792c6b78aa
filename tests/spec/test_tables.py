"""Three readings of one declaration agree on every (state, event, guard): the generated runtime
tables, a ``transitions`` reference machine built from the declarations, and the explorer."""

from __future__ import annotations

from typing import Any

import pytest

from enginewire.spec import MACHINES, Lifecycle, Machine
from enginewire.spec._tables import TABLES
from enginewire.spec.explore import explore_machine

transitions = pytest.importorskip("transitions")


def _reference(mach: Machine[Any, Any]) -> Any:
    """A ``transitions`` machine; each guard is a condition reading the model's ``guard``."""

    class Model:
        guard: str | None = None

    model = Model()
    rows = []
    for t in mach.transitions:
        row: dict[str, Any] = {
            "trigger": t.event.name, "source": t.source.name, "dest": t.target.name,
        }
        g = t.guard
        row["conditions"] = [lambda g=g: model.guard == g]
        rows.append(row)
    machine = transitions.Machine(
        model=model, states=[s.name for s in mach.states], transitions=rows,
        initial=mach.initial.name, auto_transitions=False, ignore_invalid_triggers=False,
    )
    return model, machine


@pytest.mark.parametrize("mach", MACHINES, ids=lambda m: m.name)
def test_generated_tables_reference_machine_and_explorer_agree(mach: Machine[Any, Any]) -> None:
    entry = TABLES[mach.name]
    states, events = list(mach.states), list(mach.events)
    assert entry["states"] == tuple(s.name for s in states)
    assert entry["events"] == tuple(e.name for e in events)
    generated = {(states[s], events[e], g): states[d] for s, e, g, d in entry["rows"]}
    assert generated == mach.table()

    model, machine = _reference(mach)
    guards = sorted({t.guard or "" for t in mach.transitions})
    reachable = explore_machine(mach)
    assert reachable.ok
    for state in states:
        for event in events:
            for g in guards:
                guard = g or None
                machine.set_state(state.name)
                model.guard = guard
                try:
                    known = event.name in machine.events
                    moved = machine.events[event.name].trigger(model) if known else False
                except transitions.MachineError:
                    moved = False
                ref = states[[s.name for s in states].index(model.state)] if moved else None
                expected = generated.get((state, event, guard))
                assert ref == expected, (mach.name, state, event, guard)
                lc = Lifecycle(mach.name, state, mach.compiled())
                assert lc.can(event, guard) == (expected is not None)
