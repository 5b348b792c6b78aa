"""The composed model's world: bounds, message codes, the flat world layout, and the step.

Shared by the actions (``_compose_front.py``: the owner and the client's threads;
``_compose_engine.py``: the engine process, its watchdog and the faults), the composition that
orders them (``compose.py``), the properties (``properties.py``) and the two-engine model.
Everything here is data or a small helper; no action lives here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .attach import ATTACH_DROPS_MESSAGES, AttachEvent, AttachState
from .client import CLIENT_LIVE, ClientEvent, ClientState
from .engine import (
    AWAKE,
    IN_LOOP,
    REPORTS_SLEEPING,
    STATE_TRIGGERED,
    EngineEvent,
    EngineState,
)
from .machine import Machine
from .request import (
    CLIENT_REQUEST_LIVE,
    ENGINE_REQUEST_LIVE,
    ENGINE_REQUEST_QUEUED,
    ClientRequestEvent,
    ClientRequestState,
    EngineRequestEvent,
    EngineRequestState,
)
from .session import SESSION_DROPS_INPUT, SessionEvent, SessionState
from .utility import UtilityEvent, UtilityState

# ---- bounds --------------------------------------------------------------------------------
BUDGET = 3  # owner API calls per run, shutdown included (an owner may never shut down)
FAULTS = 1  # single-fault assumption
IN_CAP = 2
OUT_CAP = 4
TOKENS = 1  # tokens a request may emit before its length limit

# ---- messages (kind in the low 4 bits, request-frame sequence number above) -----------------
IN_MSGS = (
    "ADD", "ABORT", "UTIL", "SLEEP_ABORT", "SLEEP_WAIT", "PAUSE_KEEP",
    "WAKE_WEIGHTS", "WAKE_ALL", "RESUME", "SHUTDOWN", "CORRUPT", "ATTACH",
)
OUT_MSGS = (
    "HS", "TOK", "FIN_STOP", "FIN_LENGTH", "FIN_ABORT", "FIN_ERROR",
    "UREPLY_OK", "UREPLY_ERR", "SLEPT", "WOKE_FULL", "WOKE_PART", "DEAD", "CORRUPT",
    "POWER_ERR", "STALE", "MARKER", "SESSION_END",
)
(I_ADD, I_ABORT, I_UTIL, I_SLEEP_ABORT, I_SLEEP_WAIT, I_PAUSE_KEEP,
 I_WAKE_WEIGHTS, I_WAKE_ALL, I_RESUME, I_SHUTDOWN, I_CORRUPT, I_ATTACH) = range(1, len(IN_MSGS) + 1)
(O_HS, O_TOK, O_FIN_STOP, O_FIN_LENGTH, O_FIN_ABORT, O_FIN_ERROR, O_UREPLY_OK, O_UREPLY_ERR,
 O_SLEPT, O_WOKE_FULL, O_WOKE_PART, O_DEAD, O_CORRUPT, O_POWER_ERR, O_STALE,
 O_MARKER, O_SESSION_END) = range(1, len(OUT_MSGS) + 1)
# O_STALE: any output of a previous front end's request (token or finish); O_MARKER: the
# engine's answer to this client's ATTACH; O_SESSION_END: the engine ended this client's
# session (its input failed the integrity check).
# Replies that end one power call (sleep, pause, wake_up, resume_scheduler).
O_POWER_REPLIES = frozenset({O_SLEPT, O_WOKE_FULL, O_WOKE_PART, O_POWER_ERR})

# ---- world layout ----------------------------------------------------------------------------
FIELDS = (
    "client", "engine", "proc_exited", "hung", "parent_dead", "inq", "outq", "creq", "ereq",
    "toks", "preempted", "sent", "applied", "util", "util_ends", "weights_asleep",
    "kv_asleep", "sleep_flag", "drain_waiters", "closing", "budget", "faults", "monitor_seen",
    "power_pending", "asked_awake", "standalone", "stale", "attach", "left_work",
    "session", "bad",
)
(C, E, PROC_EXITED, HUNG, PARENT_DEAD, INQ, OUTQ, CREQ, EREQ, TOKS, PREEMPTED, SENT, APPLIED,
 UTIL, UTIL_ENDS, WA, KVA, SLEEP_FLAG, DRAIN_WAITERS, CLOSING, BUDGET_LEFT, FAULTS_LEFT,
 MONITOR_SEEN, POWER_PENDING, ASKED_AWAKE, STANDALONE, STALE, ATT, LEFT, SESS,
 BAD) = range(len(FIELDS))
# drain_waiters: deferred sleep(wait) calls, each answered once; bounded by BUDGET.
# power_pending: power calls sent whose reply the client has not read; bounded by BUDGET.
# asked_awake: the owner's latest power call was a full wake-up.
# standalone: the engine was started on its own (not this client's child).
# stale: the engine's request is a previous front end's (until it ends or the attach drops it).
# attach: the client's attach phase (spec/attach.py).
# left_work: the client shut down owing a standalone engine the abort of a live request.
# session: the engine's session (spec/session.py); ENDED ignores the front end until an ATTACH.
NO_UTIL = -1  # ``util`` before the one call is made
World = tuple[Any, ...]


# How a standalone engine can find the previous front end's session: still running its
# request, or asleep with it parked (engine_start's alternatives).
STANDALONE_STARTS: tuple[str, ...] = ("busy", "parked")

CS, CE = ClientState, ClientEvent
ES, EE = EngineState, EngineEvent
RS, RE = EngineRequestState, EngineRequestEvent
QS, QE = ClientRequestState, ClientRequestEvent
US, UE = UtilityState, UtilityEvent
AS, AE = AttachState, AttachEvent
SS, SE = SessionState, SessionEvent


def ix(member: Enum) -> int:
    return list(type(member)).index(member)


# Int views of the states the actions test (computed once; worlds store ints).
C_CONSTRUCTING, C_READY, C_RUNNING, C_SLEEPING, C_DEAD, C_SHUTDOWN = (ix(s) for s in CS)
C_LIVE = frozenset(ix(s) for s in CLIENT_LIVE)
E_IDLE, E_RUNNING, E_DRAINING, E_PAUSED, E_SLEEPING = (
    ix(ES.IDLE), ix(ES.RUNNING), ix(ES.DRAINING), ix(ES.PAUSED), ix(ES.SLEEPING))
E_CONSTRUCTING, E_DEAD, E_SHUTDOWN = ix(ES.CONSTRUCTING), ix(ES.DEAD), ix(ES.SHUTDOWN)
# The named sets of spec/engine.py and spec/request.py, as ints: the model and the runtime
# read the same declaration.
E_LOOP = frozenset(ix(s) for s in IN_LOOP)
E_AWAKE = frozenset(ix(s) for s in AWAKE)
# What the runtime's is_sleeping() reports from the state alone (vLLM: a paused scheduler is
# "sleeping"), DRAINING included.
E_SLEEPY = frozenset(ix(s) for s in REPORTS_SLEEPING)
R_LIVE = frozenset(ix(s) for s in ENGINE_REQUEST_LIVE)
R_QUEUED = frozenset(ix(s) for s in ENGINE_REQUEST_QUEUED)
R_RUNNING = ix(RS.RUNNING)
Q_LIVE = frozenset(ix(s) for s in CLIENT_REQUEST_LIVE)
# State-triggered transitions (spec/engine.py), as ints.
TRIGGERED = {ix(state): event for state, (_cond, event) in STATE_TRIGGERED.items()}
# The owner may abort any id: aborting an unknown, finished or already aborting request is a
# no-op on both sides, and the model checks that it stays one.
Q_ABORTABLE = frozenset(ix(s) for s in QS)
Q_FREE = frozenset(ix(s) for s in QS) - Q_LIVE
U_PENDING = ix(US.PENDING)
A_ATTACHED = ix(AS.ATTACHED)
A_DROPS = frozenset(ix(s) for s in ATTACH_DROPS_MESSAGES)
S_DROPS = frozenset(ix(s) for s in SESSION_DROPS_INPUT)
U_LATE_OK = frozenset({ix(US.CANCELLED), ix(US.TIMED_OUT)})

POWER_CALLS = frozenset(
    {I_SLEEP_ABORT, I_SLEEP_WAIT, I_PAUSE_KEEP, I_WAKE_WEIGHTS, I_WAKE_ALL, I_RESUME})
SLEEP_CALLS = frozenset({I_SLEEP_ABORT, I_SLEEP_WAIT, I_PAUSE_KEEP})

FIN_EVENT = {
    O_FIN_STOP: QE.FINISH_STOP,
    O_FIN_LENGTH: QE.FINISH_LENGTH,
    O_FIN_ABORT: QE.FINISH_ABORT,
    O_FIN_ERROR: QE.FINISH_ERROR,
}



class Table:
    """``(state_ix, event, guard) -> state_ix`` for one machine, plus a coverage log."""

    def __init__(self, machine: Machine[Any, Any]) -> None:
        self.machine = machine
        # Keyed by ints: Enum.__hash__ is Python-level and this lookup runs millions of times.
        self.rows = {
            (ix(t.source), ix(t.event), t.guard): ix(t.target) for t in machine.transitions
        }
        # Machine.forgets: an event on a forgotten instance is one of a new instance.
        self.forgotten = frozenset(ix(st) for st in machine.forgets)
        self.initial = ix(machine.initial)
        machine.compiled()  # gives every member its ``_ix``


@dataclass(frozen=True)
class Action:
    actor: str
    name: str
    run: Callable[[World], Iterator[tuple[str, World]]]


class StepBase:
    """A mutable copy of a world for one action; ``fire`` reads the machine tables. Shared
    by both composed models: each names where its world keeps the first broken property
    (``BAD_FIELD``) and what a row the tables lack breaks (``CONFORMANCE``)."""

    __slots__ = ("comp", "w")
    BAD_FIELD: int
    CONFORMANCE: str

    def __init__(self, comp: Any, world: World) -> None:
        self.comp = comp
        self.w = list(world)

    def fire(self, field: int, table: Table, event: Enum, guard: str | None = None) -> None:
        src = self.w[field]
        if src in table.forgotten:  # the runtime dropped that instance (Machine.model_source)
            src = table.initial
        key = (src, event._ix, guard)  # type: ignore[attr-defined]
        new = table.rows.get(key)
        if new is None:
            self.flag(self.CONFORMANCE)
            return
        self.comp.covered.add((table.machine.name, *key))
        self.w[field] = new

    def flag(self, prop: str) -> None:
        if not self.w[self.BAD_FIELD]:
            self.w[self.BAD_FIELD] = prop

    def freeze(self) -> World:
        return tuple(self.w)


class Step(StepBase):
    """A step of the one-engine model, with its two channels."""

    __slots__ = ()
    BAD_FIELD = BAD
    CONFORMANCE = "spec_conformance"

    def push_out(self, msg: int, front: bool = False) -> None:
        q = self.w[OUTQ]
        self.w[OUTQ] = (msg, *q) if front else (*q, msg)

    def push_in(self, msg: int) -> None:
        self.w[INQ] = (*self.w[INQ], msg)


class ComposedModel:
    """What every composed model shares (compose.py, compose_dp.py, compose_fe.py): its
    negative control (``bug``, one of ``BUGS``), the rows its steps fired (``covered``), a
    ``Table`` per machine it drives (``TABLES``: attribute and machine), its actions, and the
    successors of a world: none once a property broke (the world's ``BAD_FIELD`` is set)."""

    BUGS: tuple[str, ...]
    TABLES: tuple[tuple[str, Machine[Any, Any]], ...]
    BAD_FIELD: int

    def __init__(self, bug: str | None = None) -> None:
        if bug is not None and bug not in self.BUGS:
            raise ValueError(f"unknown negative control {bug!r}; choose one of"
                             f" {', '.join(self.BUGS)}")
        self.bug = bug
        # (machine name, source index, event index, guard) of every row a step fired
        self.covered: set[tuple[str, int, int, str | None]] = set()
        for attr, machine in self.TABLES:
            setattr(self, attr, Table(machine))
        self.actions: tuple[Action, ...] = self._actions()

    def _actions(self) -> tuple[Action, ...]:
        raise NotImplementedError

    def successors(self, world: World) -> Iterator[tuple[str, World]]:
        if world[self.BAD_FIELD]:
            return
        for action in self.actions:
            yield from action.run(world)


class Model(ComposedModel):
    """What the actions read of the composition (``compose.Composition`` sets it all)."""

    t_client: Table
    t_engine: Table
    t_ereq: Table
    t_creq: Table
    t_util: Table
    t_attach: Table
    t_session: Table
