"""How a lifecycle is declared, and the few lines of code that read a declaration.

A machine is data (h11's ``_state.py``): an enum of states, an enum of events, an initial
state and a tuple of ``Transition(source, event, target, guard)``. A *guard* is a name for the
condition that selects one of several targets for the same (state, event); the runtime says
which guard holds when it fires, and model checkers treat the guards of one (state, event) as
a nondeterministic choice. Everything else (the runtime tables, the explorer, the Promela
model, the diagrams) is derived from these tuples.

``Lifecycle`` is the runtime side: one dict lookup per event. An event missing from the table
raises ``SpecViolation`` and leaves the state as it was.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from .errors import SpecViolation

__all__ = ["Lifecycle", "Machine", "TraceEntry", "Transition"]

S = TypeVar("S", bound=Enum)
E = TypeVar("E", bound=Enum)

# (machine name, state before, event, state after, monotonic timestamp)
TraceEntry = tuple[str, str, str, str, float]


@dataclass(frozen=True)
class Transition(Generic[S, E]):
    source: S
    event: E
    target: S
    guard: str | None = None
    note: str = ""


@dataclass(frozen=True)
class Machine(Generic[S, E]):
    """A lifecycle declared as data; see the module docstring."""

    name: str
    states: type[S]
    events: type[E]
    initial: S
    transitions: tuple[Transition[S, E], ...]
    # States that never lead back to a live state (dead and shutdown are sticky).
    terminal: frozenset[S] = field(default_factory=frozenset)
    doc: str = ""

    def __post_init__(self) -> None:
        seen: set[tuple[S, E, str | None]] = set()
        for t in self.transitions:
            if not isinstance(t.source, self.states) or not isinstance(t.target, self.states):
                raise TypeError(f"{self.name}: {t} uses a state outside {self.states.__name__}")
            if not isinstance(t.event, self.events):
                raise TypeError(f"{self.name}: {t} uses an event outside {self.events.__name__}")
            key = (t.source, t.event, t.guard)
            if key in seen:
                raise ValueError(f"{self.name}: two transitions for {key}")
            seen.add(key)
        for (src, ev, guard) in seen:
            # A guarded (state, event) must not also have an unguarded entry: the choice
            # would be ambiguous.
            if guard is not None and (src, ev, None) in seen:
                raise ValueError(f"{self.name}: {src.name} x {ev.name} is both guarded and not")
        for t in self.transitions:
            if t.source in self.terminal and t.target not in self.terminal:
                raise ValueError(f"{self.name}: terminal {t.source.name} leaves to {t.target.name}")

    def table(self) -> dict[tuple[S, E, str | None], S]:
        """``(state, event, guard) -> new state``: the lookup the runtime uses."""
        return {(t.source, t.event, t.guard): t.target for t in self.transitions}

    def guards(self, state: S, event: E) -> tuple[str | None, ...]:
        return tuple(
            sorted(
                (t.guard for t in self.transitions if t.source is state and t.event is event),
                key=lambda g: "" if g is None else g,
            )
        )

    def allowed(self, state: S) -> tuple[E, ...]:
        evs = {t.event for t in self.transitions if t.source is state}
        return tuple(e for e in self.events if e in evs)

    def lifecycle(self, *, trace: list[TraceEntry] | None = None) -> Lifecycle[S, E]:
        return Lifecycle(self.name, self.initial, self.table(), trace)


class Lifecycle(Generic[S, E]):
    """The current state of one machine instance, advanced only through its table."""

    __slots__ = ("_name", "_table", "state", "trace")

    def __init__(
        self,
        name: str,
        initial: S,
        table: dict[tuple[S, E, str | None], S],
        trace: list[TraceEntry] | None = None,
    ) -> None:
        self._name = name
        self._table = table
        self.state = initial
        self.trace = trace

    def fire(self, event: E, guard: str | None = None) -> S:
        try:
            new = self._table[(self.state, event, guard)]
        except KeyError:
            raise SpecViolation(self._name, self.state.name, event.name, guard) from None
        if self.trace is not None:
            self.trace.append((self._name, self.state.name, event.name, new.name, time.monotonic()))
        self.state = new
        return new

    def can(self, event: E, guard: str | None = None) -> bool:
        return (self.state, event, guard) in self._table

    def __repr__(self) -> str:
        return f"<Lifecycle {self._name} in {self.state.name}>"


def validate_trace(machine: Machine[S, E], trace: Iterable[TraceEntry]) -> None:
    """Replay a recorded trace against the declaration; raise ``SpecViolation`` on a bad step."""
    allowed = {(t.source.name, t.event.name, t.target.name) for t in machine.transitions}
    for name, before, event, after, _ts in trace:
        if name == machine.name and (before, event, after) not in allowed:
            raise SpecViolation(machine.name, before, event, None)
