"""The explorer: every machine fully reachable, the composed model safe and live, and every
negative control rejected with a shortest counterexample."""

from __future__ import annotations

from enum import Enum

import pytest

from enginewire.spec import MACHINES, Machine, Transition
from enginewire.spec.compose import BUGS, Composition
from enginewire.spec.explore import ExploreResult, explore, explore_machine
from enginewire.spec.properties import PROPERTIES, control_targets


@pytest.mark.parametrize("mach", MACHINES, ids=lambda m: m.name)
def test_every_state_and_transition_is_reachable(mach: Machine) -> None:  # type: ignore[type-arg]
    report = explore_machine(mach)
    assert report.ok, (report.unreachable_states, report.unreachable_transitions)
    assert report.reachable_states == len(mach.states)


def test_an_unreachable_transition_is_reported() -> None:
    class S(Enum):
        A = "a"
        B = "b"
        ORPHAN = "orphan"

    class E(Enum):
        GO = "go"

    toy = Machine("toy", S, E, S.A, (Transition(S.A, E.GO, S.B), Transition(S.ORPHAN, E.GO, S.A)))
    report = explore_machine(toy)
    assert not report.ok
    assert report.unreachable_states == ("ORPHAN",)
    assert report.unreachable_transitions == ("ORPHAN --GO--> A",)


def test_the_composed_model_satisfies_every_property(composed: ExploreResult) -> None:
    res = composed
    assert res.ok, "\n".join(v.render() for v in res.violations.values())
    assert res.states > 10_000 and res.quiescent > 0  # the model is not trivially small
    assert res.seconds < 60


def test_every_property_has_a_negative_control_and_every_control_a_target() -> None:
    targets = control_targets()
    assert set(targets) == set(BUGS)
    assert all(targets.values())
    assert {p.name for p in PROPERTIES} == {p for ps in targets.values() for p in ps}


@pytest.mark.parametrize("bug", BUGS)
def test_each_negative_control_is_rejected_with_a_shortest_counterexample(bug: str) -> None:
    targets = control_targets()[bug]
    res = explore(bug, stop_when=frozenset(targets))
    for prop in targets:
        assert prop in res.violations, f"{bug} does not break {prop}: the property is vacuous"
        violation = res.violations[prop]
        # Shortest: replaying one step fewer cannot reach a violation of this property.
        assert violation.trace
        assert _replay_breaks(bug, violation.trace, prop)
        assert not _replay_breaks(bug, violation.trace[:-1], prop)


def _replay_breaks(bug: str, trace: tuple[str, ...], prop_name: str) -> bool:
    """Follow the labelled steps (any world matching each label) and test the property."""
    comp = Composition(bug)
    prop = next(p for p in PROPERTIES if p.name == prop_name)
    frontier = {comp.initial()}
    for label in trace:
        frontier = {nxt for w in frontier for lab, nxt in comp.successors(w) if lab == label}
        assert frontier, f"step {label} not enabled on replay"
    for w in frontier:
        if prop.kind == "safety" and not prop.holds(w):  # type: ignore[misc]
            return True
        if (prop.kind == "liveness" and not any(True for _ in comp.successors(w))
                and prop.trigger(w) and not prop.discharged(w)):  # type: ignore[misc]
            return True
    return False


def test_unknown_negative_control_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="forget_pending_on_death"):
        Composition("no_such_bug")
