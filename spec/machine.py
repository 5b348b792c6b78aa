"""How a lifecycle is declared, and the few lines of code that read a declaration.

A machine is data (h11's ``_state.py``): an enum of states, an enum of events, an initial
state and a tuple of ``Transition(source, event, target, guard)``. A *guard* is a name for the
condition that selects one of several targets for the same (state, event); the runtime says
which guard holds when it fires, and model checkers treat the guards of one (state, event) as
a nondeterministic choice. Everything else (the runtime tables, the explorer, the Promela
model, the diagrams) is derived from these tuples.

``Lifecycle`` is the runtime side: one tuple index and one int-keyed dict lookup per event. An
event missing from the table raises ``SpecViolation`` and leaves the state as it was.

Why ints: ``Enum.__hash__`` is written in Python, so a ``(state, event, guard)`` key costs about
1 µs per transition, which is too much per token. Every member therefore carries ``_ix`` (its
position in its enum) and ``_key`` (an int unique across all registered enums), and the hot
table is ``rows[state._ix][event._key] -> new state``. The rows come from the generated
``_tables.py`` when its stamp matches the declaration, and are rebuilt from the declaration
otherwise (the freshness check in CI keeps the two equal).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

from .errors import SpecViolation

__all__ = [
    "CompiledTable",
    "Lifecycle",
    "Machine",
    "TraceEntry",
    "Transition",
    "render_runtime_tables",
    "validate_trace",
]

S = TypeVar("S", bound=Enum)
E = TypeVar("E", bound=Enum)

# (machine name, state before, event, state after, monotonic timestamp)
TraceEntry = tuple[str, str, str, str, float]

# Base of each registered enum's ``_key`` range; keys never leave the process.
_ENUM_BASE: dict[type[Enum], int] = {}
_KEY_STRIDE = 1 << 8


def _index_enum(cls: type[Enum]) -> None:
    """Give every member ``_ix`` (position) and ``_key`` (process-unique int); idempotent."""
    if cls in _ENUM_BASE:
        return
    base = (len(_ENUM_BASE) + 1) * _KEY_STRIDE
    members = list(cls)
    if len(members) >= _KEY_STRIDE:
        raise ValueError(f"{cls.__name__} has more than {_KEY_STRIDE - 1} members")
    for i, member in enumerate(members):
        member._ix = i  # type: ignore[attr-defined]
        member._key = base + i  # type: ignore[attr-defined]
    _ENUM_BASE[cls] = base


@dataclass(frozen=True)
class CompiledTable:
    """The hot lookup: ``plain[state._ix][event._key]`` and ``guarded[state._ix][(key, guard)]``."""

    plain: tuple[dict[int, Enum], ...]
    guarded: tuple[dict[tuple[int, str], Enum], ...]
    # Whether these rows came from the generated ``_tables.py`` (False: rebuilt, tables stale).
    generated: bool = False

    @property
    def size(self) -> int:
        return sum(map(len, self.plain)) + sum(map(len, self.guarded))


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
    # States where the instance is over and forgotten: no transition leaves them, and a later
    # event on the same name (a reused request id, an abort of a finished one) is an event of
    # a new instance in ``initial``. The runtime drops the instance there; models apply the
    # rule in ``model_source``.
    forgets: frozenset[S] = field(default_factory=frozenset)
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
            if t.source in self.forgets:
                raise ValueError(f"{self.name}: forgotten {t.source.name} has a transition"
                                 f" ({t.event.name}); its next event starts a new instance")
        if self.initial in self.forgets:
            raise ValueError(f"{self.name}: the initial state cannot be forgotten")

    def model_source(self, state: S) -> S:
        """The state a model fires the next event from: ``initial`` for a forgotten one."""
        return self.initial if state in self.forgets else state

    def state_members(self) -> tuple[S, ...]:
        """States in declaration order (their ``_ix`` order)."""
        return tuple(self.states)

    def event_members(self) -> tuple[E, ...]:
        """Events in declaration order."""
        return tuple(self.events)

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

    def fingerprint(self) -> str:
        """A stable hash of the declaration; the generated files carry it as their stamp."""
        lines = [
            f"machine {self.name} initial {self.initial.name}",
            "states " + " ".join(s.name for s in self.states),
            "events " + " ".join(e.name for e in self.events),
            "terminal " + " ".join(sorted(s.name for s in self.terminal)),
        ]
        if self.forgets:  # only when declared: older stamps stay valid
            lines.append("forgets " + " ".join(sorted(s.name for s in self.forgets)))
        lines += sorted(
            f"{t.source.name} {t.event.name} {t.guard or '-'} {t.target.name}"
            for t in self.transitions
        )
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]

    def compiled(self) -> CompiledTable:
        """The int-keyed rows ``Lifecycle`` reads, built once per machine."""
        cached: CompiledTable | None = self.__dict__.get("_compiled")
        if cached is None:
            cached = self._compile()
            object.__setattr__(self, "_compiled", cached)
        return cached

    def _compile(self) -> CompiledTable:
        _index_enum(self.states)
        _index_enum(self.events)
        states, events = list(self.states), list(self.events)
        rows: list[tuple[int, int, str | None, int]]
        generated = False
        try:
            from ._tables import TABLES
        except ImportError:  # first generation: no tables yet
            TABLES = {}
        entry = TABLES.get(self.name)
        if entry is not None and entry["stamp"] == self.fingerprint():
            rows = list(entry["rows"])
            generated = True
        else:
            rows = [
                (t.source._ix, t.event._ix, t.guard, t.target._ix)  # type: ignore[attr-defined]
                for t in self.transitions
            ]
        plain: list[dict[int, Enum]] = [{} for _ in states]
        guarded: list[dict[tuple[int, str], Enum]] = [{} for _ in states]
        for src, ev, guard, dst in rows:
            key: int = events[ev]._key  # type: ignore[attr-defined]
            if guard is None:
                plain[src][key] = states[dst]
            else:
                guarded[src][(key, guard)] = states[dst]
        return CompiledTable(tuple(plain), tuple(guarded), generated)

    def lifecycle(self, *, trace: list[TraceEntry] | None = None) -> Lifecycle[S, E]:
        return Lifecycle(self.name, self.initial, self.compiled(), trace)


class Lifecycle(Generic[S, E]):
    """The current state of one machine instance, advanced only through its table.

    ``state`` is read-only (rule 1 of every machine: runtime code never assigns a state);
    ``fire`` alone moves it. A test that needs an instance in a given state constructs one
    there: ``Lifecycle(machine.name, state, machine.compiled())``."""

    __slots__ = ("_guarded", "_name", "_plain", "_state", "trace")

    def __init__(
        self,
        name: str,
        initial: S,
        table: CompiledTable | dict[tuple[S, E, str | None], S],
        trace: list[TraceEntry] | None = None,
    ) -> None:
        if not isinstance(table, CompiledTable):
            table = _compile_dict(initial, table)
        self._name = name
        self._plain = table.plain
        self._guarded = table.guarded
        self._state = initial
        self.trace = trace

    @property
    def state(self) -> S:
        return self._state

    def fire(self, event: E, guard: str | None = None) -> S:
        state = self._state
        try:
            if guard is None:
                new: S = self._plain[state._ix][event._key]  # type: ignore[attr-defined,assignment]
            else:
                new = self._guarded[state._ix][(event._key, guard)]  # type: ignore[attr-defined,assignment]
        except (KeyError, AttributeError):
            name = getattr(event, "name", repr(event))
            raise SpecViolation(self._name, state.name, name, guard) from None
        if self.trace is not None:
            self.trace.append((self._name, state.name, event.name, new.name, time.monotonic()))
        self._state = new
        return new

    def can(self, event: E, guard: str | None = None) -> bool:
        try:
            if guard is None:
                return event._key in self._plain[self._state._ix]  # type: ignore[attr-defined]
            return (event._key, guard) in self._guarded[self._state._ix]  # type: ignore[attr-defined]
        except AttributeError:
            return False

    def __repr__(self) -> str:
        return f"<Lifecycle {self._name} in {self._state.name}>"


# id(table) -> (table, rows): callers that pass one shared dict per request compile it once;
# the table is kept alive in the value so its id cannot be reused.
_DICT_CACHE: dict[int, tuple[dict[Any, Any], CompiledTable]] = {}


def _compile_dict(initial: Enum, table: dict[tuple[Any, Any, str | None], Any]) -> CompiledTable:
    """Rows for a hand-built ``(state, event, guard) -> state`` dict (tests, old callers).

    Prefer ``Machine.lifecycle()``: it reads the generated rows directly.
    """
    hit = _DICT_CACHE.get(id(table))
    if hit is not None and hit[0] is table and len(table) == hit[1].size:
        return hit[1]
    compiled = _compile_dict_rows(initial, table)
    if len(_DICT_CACHE) < 64:
        _DICT_CACHE[id(table)] = (table, compiled)
    return compiled


def _compile_dict_rows(
    initial: Enum, table: dict[tuple[Any, Any, str | None], Any]
) -> CompiledTable:
    states = type(initial)
    _index_enum(states)
    plain: list[dict[int, Enum]] = [{} for _ in states]
    guarded: list[dict[tuple[int, str], Enum]] = [{} for _ in states]
    for (src, ev, guard), dst in table.items():
        _index_enum(type(ev))
        if guard is None:
            plain[src._ix][ev._key] = dst
        else:
            guarded[src._ix][(ev._key, guard)] = dst
    return CompiledTable(tuple(plain), tuple(guarded))


def validate_trace(machine: Machine[S, E], trace: Iterable[TraceEntry]) -> None:
    """Replay a recorded trace against the declaration; raise ``SpecViolation`` on a bad step."""
    allowed = {(t.source.name, t.event.name, t.target.name) for t in machine.transitions}
    for name, before, event, after, _ts in trace:
        if name == machine.name and (before, event, after) not in allowed:
            raise SpecViolation(machine.name, before, event, None)


def render_runtime_tables(machines: Iterable[Machine[Any, Any]]) -> str:
    """The text of ``_tables.py``: int rows per machine, stamped with each fingerprint."""
    body: list[str] = [
        '"""Runtime lookup rows for ``Lifecycle``; see ``machine.py``. Generated, do not edit."""',
        "",
        "from __future__ import annotations",
        "",
        "from typing import Any",
        "",
        "# machine -> stamp (declaration fingerprint), state and event names by index, and",
        "# rows (source index, event index, guard, target index), sorted.",
        "TABLES: dict[str, dict[str, Any]] = {",
    ]
    for mach in machines:
        states, events = list(mach.state_members()), list(mach.event_members())
        rows = sorted(
            ((states.index(t.source), events.index(t.event), t.guard, states.index(t.target))
             for t in mach.transitions),
            key=lambda r: (r[0], r[1], r[2] or ""),
        )
        body += [
            f"    {mach.name!r}: {{",
            f"        \"stamp\": {mach.fingerprint()!r},",
            "        \"states\": (" + ", ".join(repr(s.name) for s in states) + ",),",
            "        \"events\": (" + ", ".join(repr(e.name) for e in events) + ",),",
            "        \"rows\": (",
        ]
        for src, ev, guard, dst in rows:
            g = f"[{guard}]" if guard else ""
            body.append(
                f"            ({src}, {ev}, {guard!r}, {dst}),"
                f"  # {states[src].name} {events[ev].name}{g} -> {states[dst].name}"
            )
        body += ["        ),", "    },"]
    body.append("}")
    text = "\n".join(body) + "\n"
    stamp = hashlib.sha256(text.encode()).hexdigest()[:16]
    header = (
        "# AUTOGENERATED by `python -m enginewire._tools.generate`; ALL EDITS WILL BE LOST.\n"
        f"# stamp {stamp}\n"
        "# ruff: noqa: E501\n"
    )
    return header + text
