"""Exhaustive explicit-state exploration: each machine alone, and the composed model.

Theory of operation
-------------------
Rule 1: breadth first, so the first violating world found for a property is at the least
depth, and its counterexample (the list of action labels from the initial world) is a
shortest one.
Rule 2: no I/O; ``time.perf_counter`` only measures. Callers print.

``explore_machine`` walks one machine's table with every guard treated as a nondeterministic
choice and reports the transitions and states no path reaches (each is a modelling defect).
``explore`` walks the composed model, checks every safety property after each step and every
liveness obligation at each quiescent world, and records which table rows the composition
exercised; ``explore_dp`` does the same for the two-engine model (``compose_dp.py``), and
``explore_fe`` for the front-end model (``compose_fe.py``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from . import compose_dp, compose_fe
from .compose import Composition, World, describe_world
from .machine import Machine, Transition
from .properties import (
    DP_LIVENESS,
    DP_SAFETY,
    FE_LIVENESS,
    FE_SAFETY,
    LIVENESS,
    SAFETY,
    Property,
)

__all__ = [
    "ExploreResult",
    "MachineReport",
    "Violation",
    "explore",
    "explore_dp",
    "explore_fe",
    "explore_machine",
]


class _Model(Protocol):
    covered: set[tuple[str, int, int, str | None]]

    def initial(self) -> World: ...

    def successors(self, world: World) -> Iterator[tuple[str, World]]: ...


@dataclass(frozen=True)
class MachineReport:
    machine: str
    states: int
    transitions: int
    reachable_states: int
    unreachable_states: tuple[str, ...]
    unreachable_transitions: tuple[str, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.unreachable_states and not self.unreachable_transitions


def _row(t: Transition[Any, Any]) -> str:
    guard = f" [{t.guard}]" if t.guard else ""
    return f"{t.source.name} --{t.event.name}{guard}--> {t.target.name}"


def explore_machine(machine: Machine[Any, Any]) -> MachineReport:
    """BFS over one machine's table; every guard of a (state, event) is a possible outcome."""
    t0 = time.perf_counter()
    out: dict[Enum, list[Transition[Any, Any]]] = {}
    for t in machine.transitions:
        out.setdefault(t.source, []).append(t)
    seen = {machine.initial}
    todo = deque([machine.initial])
    fired: set[int] = set()
    index = {id(t): i for i, t in enumerate(machine.transitions)}
    while todo:
        state = todo.popleft()
        for t in out.get(state, ()):
            fired.add(index[id(t)])
            if t.target not in seen:
                seen.add(t.target)
                todo.append(t.target)
    return MachineReport(
        machine=machine.name,
        states=len(machine.state_members()),
        transitions=len(machine.transitions),
        reachable_states=len(seen),
        unreachable_states=tuple(s.name for s in machine.state_members() if s not in seen),
        unreachable_transitions=tuple(
            _row(t) for i, t in enumerate(machine.transitions) if i not in fired
        ),
        seconds=time.perf_counter() - t0,
    )


@dataclass(frozen=True)
class Violation:
    prop: str
    kind: str
    trace: tuple[str, ...]  # action labels from the initial world, shortest first
    world: dict[str, object]

    def render(self) -> str:
        steps = "\n".join(f"  {i + 1:2d}. {label}" for i, label in enumerate(self.trace))
        return f"{self.kind} property {self.prop} violated after {len(self.trace)} steps:\n{steps}"


@dataclass
class ExploreResult:
    bug: str | None
    states: int = 0
    edges: int = 0
    quiescent: int = 0
    seconds: float = 0.0
    violations: dict[str, Violation] = field(default_factory=dict)
    # (machine name, source index, event, guard) rows the composition exercised
    covered: set[tuple[str, int, int, str | None]] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return not self.violations


def _trace(parents: dict[World, tuple[World | None, str]], world: World) -> tuple[str, ...]:
    labels: list[str] = []
    cur: World | None = world
    while cur is not None:
        prev, label = parents[cur]
        if prev is None:
            break
        labels.append(label)
        cur = prev
    return tuple(reversed(labels))


def explore(
    bug: str | None = None,
    *,
    safety: Sequence[Property] = SAFETY,
    liveness: Sequence[Property] = LIVENESS,
    max_states: int = 2_000_000,
    stop_when: frozenset[str] = frozenset(),
    model: Callable[[str | None], _Model] = Composition,
    describe: Callable[[World], dict[str, object]] = describe_world,
) -> ExploreResult:
    """Explore the composed model (with negative control ``bug``) exhaustively, BFS.

    ``stop_when``: stop as soon as every named property has a counterexample (negative
    controls need only their own shortest counterexamples, not the whole space).
    ``model``/``describe``: another composition (``explore_dp`` passes the two-engine one).
    """
    t0 = time.perf_counter()
    comp = model(bug)
    init = comp.initial()
    parents: dict[World, tuple[World | None, str]] = {init: (None, "")}
    todo = deque([init])
    res = ExploreResult(bug)
    while todo:
        if stop_when and stop_when.issubset(res.violations):
            break
        world = todo.popleft()
        broken = False
        for prop in safety:
            if not prop.holds(world):  # type: ignore[misc]
                broken = True
                if prop.name not in res.violations:
                    res.violations[prop.name] = Violation(
                        prop.name, "safety", _trace(parents, world), describe(world)
                    )
        if broken:
            continue  # a violating world is a dead end: its successors prove nothing new
        moved = False
        for label, nxt in comp.successors(world):
            moved = True
            res.edges += 1
            if nxt not in parents:
                parents[nxt] = (world, label)
                todo.append(nxt)
                if len(parents) > max_states:
                    raise RuntimeError(f"more than {max_states} worlds: the bounds are too loose")
        if not moved:
            res.quiescent += 1
            for prop in liveness:
                if (prop.name not in res.violations and prop.trigger(world)  # type: ignore[misc]
                        and not prop.discharged(world)):  # type: ignore[misc]
                    res.violations[prop.name] = Violation(
                        prop.name, "liveness", _trace(parents, world), describe(world)
                    )
    res.states = len(parents)
    res.covered = comp.covered
    res.seconds = time.perf_counter() - t0
    return res


def explore_dp(
    bug: str | None = None,
    *,
    safety: Sequence[Property] = DP_SAFETY,
    liveness: Sequence[Property] = DP_LIVENESS,
    max_states: int = 2_000_000,
    stop_when: frozenset[str] = frozenset(),
) -> ExploreResult:
    """``explore`` over the two-engine model (``compose_dp.DPComposition``)."""
    return explore(bug, safety=safety, liveness=liveness, max_states=max_states,
                   stop_when=stop_when, model=compose_dp.DPComposition,
                   describe=compose_dp.describe_world)


def explore_fe(
    bug: str | None = None,
    *,
    safety: Sequence[Property] = FE_SAFETY,
    liveness: Sequence[Property] = FE_LIVENESS,
    max_states: int = 2_000_000,
    stop_when: frozenset[str] = frozenset(),
) -> ExploreResult:
    """``explore`` over the front-end model (``compose_fe.FEComposition``)."""
    return explore(bug, safety=safety, liveness=liveness, max_states=max_states,
                   stop_when=stop_when, model=compose_fe.FEComposition,
                   describe=compose_fe.describe_world)


def uncovered_rows(
    result: ExploreResult, machines: Sequence[Machine[Any, Any]]
) -> dict[str, list[str]]:
    """Table rows of each machine that no run of the composition exercised (information)."""
    out: dict[str, list[str]] = {}
    for machine in machines:
        states, events = machine.state_members(), machine.event_members()
        missing = [
            _row(t) for t in machine.transitions
            if (machine.name, states.index(t.source), events.index(t.event), t.guard)
            not in result.covered
        ]
        out[machine.name] = missing
    return out
