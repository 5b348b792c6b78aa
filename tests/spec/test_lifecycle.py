"""The runtime side of the tables: ``Lifecycle`` on the generated int-keyed rows."""

from __future__ import annotations

from enum import Enum
from typing import Any

import pytest

from enginewire.spec import (
    CLIENT,
    CLIENT_REQUEST,
    ENGINE,
    MACHINES,
    ClientEvent,
    ClientRequestEvent,
    ClientState,
    EngineEvent,
    EngineState,
    Lifecycle,
    Machine,
    SpecViolation,
    TraceEntry,
)
from enginewire.testing.spec_check import spec_transition_cost_ns


def test_every_machine_runs_on_the_generated_tables() -> None:
    # A stale _tables.py would silently fall back to rebuilding; the freshness test catches
    # that, and this one proves the fresh tables are what the runtime reads.
    for mach in MACHINES:
        assert mach.compiled().generated, mach.name


def test_fire_follows_the_table_and_returns_the_new_state() -> None:
    lc = CLIENT.lifecycle()
    assert lc.state is ClientState.CONSTRUCTING
    assert lc.fire(ClientEvent.HANDSHAKE_OK) is ClientState.READY
    assert lc.fire(ClientEvent.SLEEP_ACKED) is ClientState.SLEEPING
    assert lc.fire(ClientEvent.WAKE_ACKED, "partially_awake") is ClientState.SLEEPING
    assert lc.fire(ClientEvent.WAKE_ACKED, "fully_awake") is ClientState.RUNNING
    assert lc.state is ClientState.RUNNING


def test_illegal_event_raises_and_changes_nothing() -> None:
    trace: list[tuple[str, str, str, str, float]] = []
    lc = ENGINE.lifecycle(trace=trace)
    with pytest.raises(SpecViolation) as info:
        lc.fire(EngineEvent.WORK_ARRIVED)
    assert lc.state is EngineState.CONSTRUCTING
    assert trace == []
    assert "engine" in str(info.value) and "CONSTRUCTING" in str(info.value)
    # A guarded row needs its guard, and an unguarded one refuses a guard.
    with pytest.raises(SpecViolation):
        lc.fire(EngineEvent.BUILT)
    lc.fire(EngineEvent.BUILT, "subprocess")
    with pytest.raises(SpecViolation):
        lc.fire(EngineEvent.HANDSHAKE_SENT, "subprocess")
    assert lc.state is EngineState.CONSTRUCTING
    assert [t[2] for t in trace] == ["BUILT"]


def test_an_event_of_another_machine_is_a_violation_not_a_lookup_hit() -> None:
    # Indices collide across enums (both have a member at position 0); keys must not.
    lc = CLIENT.lifecycle()
    assert not lc.can(ClientRequestEvent.SEND)  # type: ignore[arg-type]
    with pytest.raises(SpecViolation):
        lc.fire(ClientRequestEvent.SEND)  # type: ignore[arg-type]
    assert lc.state is ClientState.CONSTRUCTING


def test_can_matches_fire_for_every_state_event_guard() -> None:
    for mach in MACHINES:
        guards = sorted({t.guard or "" for t in mach.transitions})
        table = mach.table()
        for state in mach.states:
            for event in mach.events:
                for g in guards:
                    guard = g or None
                    lc = Lifecycle(mach.name, state, mach.compiled())  # starts in each state
                    expected = table.get((state, event, guard))
                    assert lc.can(event, guard) == (expected is not None)
                    if expected is None:
                        with pytest.raises(SpecViolation):
                            lc.fire(event, guard)
                        assert lc.state is state
                    else:
                        assert lc.fire(event, guard) is expected


def test_dead_and_shutdown_are_sticky() -> None:
    for mach in MACHINES:
        for t in mach.transitions:
            if t.source in mach.terminal:
                assert t.target in mach.terminal, (mach.name, t)


def test_hand_built_dict_table_still_works() -> None:
    class S(Enum):
        A = "a"
        B = "b"

    class E(Enum):
        GO = "go"

    lc: Lifecycle[S, E] = Lifecycle("toy", S.A, {(S.A, E.GO, None): S.B})
    assert lc.fire(E.GO) is S.B
    with pytest.raises(SpecViolation):
        lc.fire(E.GO)


def test_transition_cost_measures_a_lifecycle_that_still_works() -> None:
    # The 1 µs bar lives in `enginewire bench` (spec enforcement), not in a timed test: shared
    # cores would make it flaky. Here: the measurement runs and yields a plausible figure.
    cost = spec_transition_cost_ns(n=1_000, repeat=1)
    assert 0.0 < cost < float("inf")
    lc = CLIENT_REQUEST.lifecycle()
    lc.fire(ClientRequestEvent.SEND)
    assert lc.fire(ClientRequestEvent.OUTPUT).name == "STREAMING"


def _reach_every_state(mach: Machine[Any, Any]) -> dict[Enum, list[tuple[Enum, str | None]]]:
    """A path of legal (event, guard) steps from the initial state to each reachable state."""
    paths: dict[Enum, list[tuple[Enum, str | None]]] = {mach.initial: []}
    frontier = [mach.initial]
    while frontier:
        state = frontier.pop(0)
        for t in mach.transitions:
            if t.source is state and t.target not in paths:
                paths[t.target] = [*paths[state], (t.event, t.guard)]
                frontier.append(t.target)
    return paths


@pytest.mark.parametrize("mach", MACHINES, ids=lambda m: m.name)
def test_every_forbidden_event_in_every_state_raises_and_changes_nothing(
    mach: Machine[Any, Any],
) -> None:
    # Each state is reached through the table (never by assigning it), then probed with every
    # event under no guard, each guard of any machine, and the event's bare name: whatever the
    # table lacks raises SpecViolation naming the step, and leaves state and trace as they were.
    paths = _reach_every_state(mach)
    assert set(paths) == set(mach.states), f"{mach.name}: states no event leads to"
    table = mach.table()
    guards = sorted({t.guard for m in MACHINES for t in m.transitions if t.guard is not None})
    refused = 0
    for state, path in paths.items():
        trace: list[TraceEntry] = []
        lc = mach.lifecycle(trace=trace)
        for event, guard in path:
            lc.fire(event, guard)
        assert lc.state is state
        for event in mach.events:
            for guard in (None, *guards):
                if (state, event, guard) in table:
                    continue
                before = list(trace)
                assert not lc.can(event, guard)
                with pytest.raises(SpecViolation) as info:
                    lc.fire(event, guard)
                err = info.value
                assert (err.machine, err.state, err.event, err.guard) == (
                    mach.name, state.name, event.name, guard)
                assert lc.state is state and trace == before
                refused += 1
            with pytest.raises(SpecViolation):
                lc.fire(event.name)  # a string is never an event, even one spelling its name
            assert lc.state is state
    assert refused > 0
