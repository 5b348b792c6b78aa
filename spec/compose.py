"""The composed model: client x engine x input channel x output channel x process monitor.

Theory of operation
-------------------
Rule 1: every component fires its events through the machine tables of this package (the
same rows the runtime uses); an event the tables forbid is itself a violation
(``spec_conformance``), so the composition can never drift from the declarations silently.
Rule 2: the model is bounded, so its state space is finite: one request id (reusable after it
finishes), at most one utility call, ``BUDGET`` owner actions, at most one fault, an input
channel of ``IN_CAP`` frames and an output channel of ``OUT_CAP`` frames.

A ``World`` is a flat tuple of small ints (enum members are stored by ``_ix``) so that the
explorer can hash millions of them quickly. An *action* is a guarded atomic step of one
actor: the owner (``user``), the client's output thread (``client``), the engine busy loop
(``engine``), the client's process monitor (``monitor``), the engine's parent-death watcher
(``watchdog``) and the fault injector (``fault``). Faults are ordinary actions: a crash with
or without the dead sentinel (also during the handshake), a hang, a corrupted input frame
(one the integrity check rejects: the engine ends the session, tells its front end and ignores
it; without integrity a malformed frame is rejected on its own, tested in tests/runtime), a
corrupted output frame, a lost ATTACH, and the death of the parent. The client's start-up deadline
(``ready_timeout_s``) is not a fault: it may fire at any time during construction, so a hung
or slow engine still ends the constructor.

The engine's first move also decides how it was deployed: *launched* by this client (a
subprocess it owns, stops and reaps) or *standalone* (started on its own, already serving a
previous front end: still running its request, of the same id as this client's, or asleep
with that request parked). Every client attaches after the ready handshake (``ATTACH``; the
engine ends the previous session and answers with a marker) and drops everything read before
the marker; a marker overdue by ``ready_timeout_s`` declares the engine dead (a timer, which
the model fires only when the marker is not on its way: the engine hangs or the ATTACH was
lost; firing earlier is a slow engine, which ends like any death). A client leaving a
standalone engine aborts what the engine still runs for it and does not stop the engine; once
no front end is connected the engine's outputs are dropped. The monitor stands for the
heartbeat deadline there (a standalone engine is not this client's child), and the
parent-death watchdog applies only to launched engines.

Power calls (sleep, pause, wake_up, resume_scheduler) are counted from the owner's send to the
client's reading of their reply (``power_pending``), as the runtime answers each: every
deferred sleep(wait) is answered once the engine drained, or when an abort/keep pause ends the
drain, or with an error when a wake-up ends it.

Each negative control (``BUGS``) is a one-line deviation from the correct protocol; the
generated Promela model carries the same deviations under ``#ifdef BUG_<NAME>`` so that both
checkers are held to rejecting it. Keep this file and ``promela.py``'s template in step: the
tests compare the explorer's and SPIN's verdicts on every property and every control.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .client import CLIENT, CLIENT_LIVE, ClientEvent, ClientState
from .engine import (
    AWAKE,
    ENGINE,
    IN_LOOP,
    REPORTS_SLEEPING,
    STATE_TRIGGERED,
    EngineEvent,
    EngineState,
)
from .machine import Machine
from .request import (
    CLIENT_REQUEST,
    CLIENT_REQUEST_LIVE,
    ENGINE_REQUEST,
    ENGINE_REQUEST_LIVE,
    ENGINE_REQUEST_QUEUED,
    ClientRequestEvent,
    ClientRequestState,
    EngineRequestEvent,
    EngineRequestState,
)
from .utility import UTILITY, UtilityEvent, UtilityState

__all__ = [
    "BUGS",
    "COVERS",
    "FIELDS",
    "IN_MSGS",
    "OUT_MSGS",
    "UNEXERCISED",
    "Composition",
    "World",
    "describe_world",
]

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
    "power_pending", "asked_awake", "standalone", "stale", "attached", "left_work",
    "refused", "bad",
)
(C, E, PROC_EXITED, HUNG, PARENT_DEAD, INQ, OUTQ, CREQ, EREQ, TOKS, PREEMPTED, SENT, APPLIED,
 UTIL, UTIL_ENDS, WA, KVA, SLEEP_FLAG, DRAIN_WAITERS, CLOSING, BUDGET_LEFT, FAULTS_LEFT,
 MONITOR_SEEN, POWER_PENDING, ASKED_AWAKE, STANDALONE, STALE, ATTACHED, LEFT, REFUSED,
 BAD) = range(len(FIELDS))
# drain_waiters: deferred sleep(wait) calls, each answered once; bounded by BUDGET.
# power_pending: power calls sent whose reply the client has not read; bounded by BUDGET.
# asked_awake: the owner's latest power call was a full wake-up.
# standalone: the engine was started on its own (not this client's child).
# stale: the engine's request is a previous front end's (until it ends or the attach drops it).
# attached: the client has read its attach marker.
# left_work: the client shut down owing a standalone engine the abort of a live request.
# refused: the engine ended the session and ignores its front end until an ATTACH.
NO_UTIL = -1  # ``util`` before the one call is made
World = tuple[Any, ...]

# Negative controls: each breaks the protocol in one place (see ``properties.CONTROLS``).
BUGS = (
    "forget_pending_on_death",
    "late_reply_resolves",
    "abort_ack_before_flush",
    "abort_unanswered",
    "reply_before_drain",
    "wake_ignored_while_draining",
    "cancelled_wait_unanswered",
    "no_startup_deadline",
    "partial_wake_clears_flag",
    "input_reorders",
    "shutdown_skips_join",
    "shutdown_no_kill",
    "no_monitor",
    "ignore_parent_death",
    "drop_failed_reply",
    "add_before_ready",
    "reader_keeps_stale",
    "attach_keeps_work",
    "no_attach_deadline",
    "shutdown_leaves_work",
    "session_end_unannounced",
)

# The machines whose every row this model must exercise (membership is the two-engine
# model's, compose_dp.py).
COVERS: tuple[Machine[Any, Any], ...] = (CLIENT, ENGINE, ENGINE_REQUEST, CLIENT_REQUEST, UTILITY)

# Table rows no run of this model fires, each with why (machine, row as explore prints it).
# ``enginewire spec check`` fails when a row is neither exercised nor listed here, and when a
# listed row becomes exercised, so this list stays true.
# How a standalone engine can find the previous front end's session: still running its
# request, or asleep with it parked (engine_start's alternatives).
_STANDALONE_STARTS: tuple[str, ...] = ("busy", "parked")

_REJECT = "not modelled: the engine rejects an invalid add (tested in tests/runtime)"
UNEXERCISED: dict[tuple[str, str], str] = {
    ("client", "SHUTDOWN --SHUTDOWN--> SHUTDOWN"):
        "bounded: the owner calls shutdown() once (repeats are tested in tests/runtime)",
    ("engine", "CONSTRUCTING --BUILT [inproc]--> IDLE"):
        "in-process only: the model composes the engine process",
    ("engine", "DRAINING --WORK_ARRIVED--> DRAINING"):
        "bounded: one request id, live for the whole drain",
    ("engine", "READY --FATAL_ERROR--> DEAD"):
        "atomic: the model's engine_start passes READY in one step",
    ("engine", "READY --SHUTDOWN--> SHUTDOWN"):
        "atomic: the model's engine_start passes READY in one step",
    ("engine", "DEAD --FATAL_ERROR--> DEAD"): "bounded by FAULTS=1",
    ("engine", "DEAD --SHUTDOWN--> SHUTDOWN"):
        "in-process only: a dead engine process has exited and reads no shutdown frame",
    ("engine", "SHUTDOWN --SHUTDOWN--> SHUTDOWN"):
        "in-process only: the engine process exits on its first shutdown",
    ("engine_request", "UNKNOWN --REJECT--> FINISHED_ERROR"): _REJECT,
    ("engine_request", "FINISHED_STOPPED --REJECT--> FINISHED_ERROR"): _REJECT,
    ("engine_request", "FINISHED_LENGTH --REJECT--> FINISHED_ERROR"): _REJECT,
    ("engine_request", "FINISHED_ABORTED --REJECT--> FINISHED_ERROR"): _REJECT,
    ("engine_request", "FINISHED_ERROR --REJECT--> FINISHED_ERROR"): _REJECT,
    ("engine_request", "WAITING --ERROR--> FINISHED_ERROR"):
        "not modelled: a step error hits a scheduled (RUNNING) request only",
    ("engine_request", "PREEMPTED --ERROR--> FINISHED_ERROR"):
        "not modelled: a step error hits a scheduled (RUNNING) request only",
    ("client_request", "STREAMING --OUTPUT--> STREAMING"): "bounded by TOKENS=1",
    ("client_request", "SENT --FINISH_LENGTH--> FINISHED_LENGTH"):
        "bounded by TOKENS=1: a length finish follows the one token",
}

CS, CE = ClientState, ClientEvent
ES, EE = EngineState, EngineEvent
RS, RE = EngineRequestState, EngineRequestEvent
QS, QE = ClientRequestState, ClientRequestEvent
US, UE = UtilityState, UtilityEvent


def _ix(member: Enum) -> int:
    return list(type(member)).index(member)


# Int views of the states the actions test (computed once; worlds store ints).
C_CONSTRUCTING, C_READY, C_RUNNING, C_SLEEPING, C_DEAD, C_SHUTDOWN = (_ix(s) for s in CS)
C_LIVE = frozenset(_ix(s) for s in CLIENT_LIVE)
E_IDLE, E_RUNNING, E_DRAINING, E_PAUSED, E_SLEEPING = (
    _ix(ES.IDLE), _ix(ES.RUNNING), _ix(ES.DRAINING), _ix(ES.PAUSED), _ix(ES.SLEEPING))
E_CONSTRUCTING, E_DEAD, E_SHUTDOWN = _ix(ES.CONSTRUCTING), _ix(ES.DEAD), _ix(ES.SHUTDOWN)
# The named sets of spec/engine.py and spec/request.py, as ints: the model and the runtime
# read the same declaration.
E_LOOP = frozenset(_ix(s) for s in IN_LOOP)
E_AWAKE = frozenset(_ix(s) for s in AWAKE)
# What the runtime's is_sleeping() reports from the state alone (vLLM: a paused scheduler is
# "sleeping"), DRAINING included.
E_SLEEPY = frozenset(_ix(s) for s in REPORTS_SLEEPING)
R_LIVE = frozenset(_ix(s) for s in ENGINE_REQUEST_LIVE)
R_QUEUED = frozenset(_ix(s) for s in ENGINE_REQUEST_QUEUED)
R_RUNNING = _ix(RS.RUNNING)
Q_LIVE = frozenset(_ix(s) for s in CLIENT_REQUEST_LIVE)
# State-triggered transitions (spec/engine.py), as ints.
_TRIGGERED = {_ix(state): event for state, (_cond, event) in STATE_TRIGGERED.items()}
# The owner may abort any id: aborting an unknown, finished or already aborting request is a
# no-op on both sides, and the model checks that it stays one.
Q_ABORTABLE = frozenset(_ix(s) for s in QS)
Q_FREE = frozenset(_ix(s) for s in QS) - Q_LIVE
U_PENDING = _ix(US.PENDING)
U_LATE_OK = frozenset({_ix(US.CANCELLED), _ix(US.TIMED_OUT)})

_POWER_CALLS = frozenset(
    {I_SLEEP_ABORT, I_SLEEP_WAIT, I_PAUSE_KEEP, I_WAKE_WEIGHTS, I_WAKE_ALL, I_RESUME})
_SLEEP_CALLS = frozenset({I_SLEEP_ABORT, I_SLEEP_WAIT, I_PAUSE_KEEP})

_FIN_EVENT = {
    O_FIN_STOP: QE.FINISH_STOP,
    O_FIN_LENGTH: QE.FINISH_LENGTH,
    O_FIN_ABORT: QE.FINISH_ABORT,
    O_FIN_ERROR: QE.FINISH_ERROR,
}


class _Table:
    """``(state_ix, event, guard) -> state_ix`` for one machine, plus a coverage log."""

    def __init__(self, machine: Machine[Any, Any]) -> None:
        self.machine = machine
        # Keyed by ints: Enum.__hash__ is Python-level and this lookup runs millions of times.
        self.rows = {
            (_ix(t.source), _ix(t.event), t.guard): _ix(t.target) for t in machine.transitions
        }
        machine.compiled()  # gives every member its ``_ix``


@dataclass(frozen=True)
class Action:
    actor: str
    name: str
    run: Callable[[World], Iterator[tuple[str, World]]]


class _Step:
    """A mutable copy of a world for one action; ``fire`` reads the machine tables."""

    __slots__ = ("comp", "w")

    def __init__(self, comp: Composition, world: World) -> None:
        self.comp = comp
        self.w = list(world)

    def fire(self, field: int, table: _Table, event: Enum, guard: str | None = None) -> None:
        key = (self.w[field], event._ix, guard)  # type: ignore[attr-defined]
        new = table.rows.get(key)
        if new is None:
            self.flag("spec_conformance")
            return
        self.comp.covered.add((table.machine.name, *key))
        self.w[field] = new

    def flag(self, prop: str) -> None:
        if not self.w[BAD]:
            self.w[BAD] = prop

    def push_out(self, msg: int, front: bool = False) -> None:
        q = self.w[OUTQ]
        self.w[OUTQ] = (msg, *q) if front else (*q, msg)

    def push_in(self, msg: int) -> None:
        self.w[INQ] = (*self.w[INQ], msg)

    def freeze(self) -> World:
        return tuple(self.w)


class Composition:
    """The composed model; ``bug`` selects one negative control (``None``: the real protocol)."""

    def __init__(self, bug: str | None = None) -> None:
        if bug is not None and bug not in BUGS:
            raise ValueError(f"unknown negative control {bug!r}; choose one of {', '.join(BUGS)}")
        self.bug = bug
        # (machine name, source index, event index, guard) of every row a step fired
        self.covered: set[tuple[str, int, int, str | None]] = set()
        self.t_client = _Table(CLIENT)
        self.t_engine = _Table(ENGINE)
        self.t_ereq = _Table(ENGINE_REQUEST)
        self.t_creq = _Table(CLIENT_REQUEST)
        self.t_util = _Table(UTILITY)
        self.actions: tuple[Action, ...] = self._actions()

    def tables(self) -> tuple[_Table, ...]:
        return (self.t_client, self.t_engine, self.t_ereq, self.t_creq, self.t_util)

    # ---- the initial world -------------------------------------------------------------------
    def initial(self) -> World:
        w: list[Any] = [0] * len(FIELDS)
        w[C] = C_CONSTRUCTING
        w[E] = E_CONSTRUCTING
        w[INQ] = ()
        w[OUTQ] = ()
        w[CREQ] = _ix(QS.UNKNOWN)
        w[EREQ] = _ix(RS.UNKNOWN)
        w[UTIL] = NO_UTIL
        w[BUDGET_LEFT] = BUDGET
        w[FAULTS_LEFT] = FAULTS
        w[BAD] = ""
        return tuple(w)

    def successors(self, world: World) -> Iterator[tuple[str, World]]:
        if world[BAD]:
            return
        for action in self.actions:
            yield from action.run(world)

    # ---- shared effects ----------------------------------------------------------------------
    def _on_death(self, s: _Step) -> None:
        """The client learns the engine is dead: every pending and live thing fails now."""
        s.fire(C, self.t_client, CE.ENGINE_DIED)
        if s.w[UTIL] == U_PENDING and self.bug != "forget_pending_on_death":
            s.fire(UTIL, self.t_util, UE.ENGINE_DIED)
            s.w[UTIL_ENDS] += 1
        # Unconditional: for a finished request the table makes the notice a no-op.
        s.fire(CREQ, self.t_creq, QE.ENGINE_DIED)
        s.w[POWER_PENDING] = 0  # pending sleep/wake calls fail with EngineDeadError

    def _has_work(self, s: _Step) -> bool:
        return s.w[EREQ] in R_LIVE

    def _reply_slept(self, s: _Step) -> None:
        # "sleep/pause replies only once the engine is idle": paused or asleep, nothing running.
        if s.w[E] not in (E_PAUSED, E_SLEEPING) or s.w[EREQ] == R_RUNNING:
            s.flag("sleep_reply_when_idle")
        s.push_out(O_SLEPT)

    def _release(self, s: _Step) -> None:
        s.fire(E, self.t_engine, EE.RELEASE_MEMORY)
        s.w[WA] = s.w[KVA] = 1
        s.w[SLEEP_FLAG] = 1

    def _abort_live(self, s: _Step) -> None:
        if s.w[EREQ] in R_LIVE:
            s.fire(EREQ, self.t_ereq, RE.ABORT)
            if self.bug != "abort_unanswered":
                s.push_out(O_FIN_ABORT, front=self.bug == "abort_ack_before_flush")

    def _complete_waiters(self, s: _Step) -> None:
        """Each deferred sleep(wait) releases memory and is answered (``_complete_deferred``)."""
        for _ in range(s.w[DRAIN_WAITERS]):
            self._release(s)
            self._reply_slept(s)
        s.w[DRAIN_WAITERS] = 0

    def _settle(self, s: _Step) -> None:
        """The busy loop's bookkeeping after each step: the state-triggered table (idle when
        done, pause when drained). With one request, both of its conditions (no live request,
        none draining) read as "the request is not live"."""
        event = _TRIGGERED.get(s.w[E])
        if event is None or s.w[EREQ] in R_LIVE:
            return
        s.fire(E, self.t_engine, event)
        if event is EE.DRAINED:
            self._complete_waiters(s)

    def _wake(self, s: _Step, full: bool) -> None:
        e = s.w[E]
        if e == E_SLEEPING:
            s.w[WA] = 0
            if full:
                s.w[KVA] = 0
            if s.w[KVA]:
                s.fire(E, self.t_engine, EE.WAKE_UP, "partial")
                if self.bug == "partial_wake_clears_flag":
                    s.w[SLEEP_FLAG] = 0
                s.push_out(O_WOKE_PART)
                return
        if e in (E_SLEEPING, E_PAUSED):
            s.fire(E, self.t_engine, EE.WAKE_UP, "has_work" if self._has_work(s) else "no_work")
            s.w[SLEEP_FLAG] = 0
        elif e in (E_IDLE, E_RUNNING):
            s.fire(E, self.t_engine, EE.WAKE_UP)
        elif self.bug == "wake_ignored_while_draining":
            pass  # the old no-op: the deferred sleep completes after this "fully awake"
        else:  # draining: the wake-up ends the pending sleep(wait)s, each answered an error
            s.fire(E, self.t_engine, EE.WAKE_UP, "has_work" if self._has_work(s) else "no_work")
            s.w[SLEEP_FLAG] = 0
            if self.bug != "cancelled_wait_unanswered":
                for _ in range(s.w[DRAIN_WAITERS]):
                    s.push_out(O_POWER_ERR)
            s.w[DRAIN_WAITERS] = 0
        s.push_out(O_WOKE_FULL)

    def _resume(self, s: _Step) -> None:
        e = s.w[E]
        if e == E_PAUSED:
            s.fire(E, self.t_engine, EE.RESUME, "has_work" if self._has_work(s) else "no_work")
            s.w[SLEEP_FLAG] = 0
        elif e in E_AWAKE:
            s.fire(E, self.t_engine, EE.RESUME)
        else:  # draining or asleep: the table forbids it, so the call fails, nothing changes
            s.push_out(O_POWER_ERR)
            return
        s.push_out(O_WOKE_FULL)  # the client reads a resume like a full wake-up

    def _check_seq(self, s: _Step, msg: int) -> None:
        seq = msg >> 4
        if seq != s.w[APPLIED]:
            s.flag("frames_in_order")
        s.w[APPLIED] = seq + 1

    # ---- actions -----------------------------------------------------------------------------
    def _actions(self) -> tuple[Action, ...]:
        bug = self.bug
        acts: list[Action] = []

        def action(actor: str, name: str) -> Callable[[Callable[..., Any]], Any]:
            def wrap(fn: Callable[[World], Iterator[tuple[str, World]]]) -> Any:
                acts.append(Action(actor, name, fn))
                return fn

            return wrap

        def owner_may_call(w: World) -> bool:
            return bool(not w[PARENT_DEAD] and not w[CLOSING] and w[BUDGET_LEFT] > 0)

        def user_send(
            w: World, msg: int, label: str, *, request_frame: bool = False
        ) -> Iterator[tuple[str, World]]:
            if owner_may_call(w) and w[C] in C_LIVE and len(w[INQ]) < IN_CAP:
                s = _Step(self, w)
                s.w[BUDGET_LEFT] -= 1
                if request_frame:
                    msg |= s.w[SENT] << 4
                    s.w[SENT] += 1
                elif msg in _POWER_CALLS:
                    s.w[POWER_PENDING] += 1
                    if msg in _SLEEP_CALLS:
                        s.w[ASKED_AWAKE] = 0
                    elif msg == I_WAKE_ALL:
                        s.w[ASKED_AWAKE] = 1
                s.push_in(msg)
                yield label, s.freeze()

        # -- the owner (user) ---------------------------------------------------------------
        @action("user", "add_request")
        def _add(w: World) -> Iterator[tuple[str, World]]:
            ok_state = w[C] in C_LIVE or (bug == "add_before_ready" and w[C] == C_CONSTRUCTING)
            if owner_may_call(w) and ok_state and w[CREQ] in Q_FREE and len(w[INQ]) < IN_CAP:
                s = _Step(self, w)
                s.w[BUDGET_LEFT] -= 1
                s.fire(C, self.t_client, CE.ADD_REQUEST)
                s.fire(CREQ, self.t_creq, QE.SEND)
                s.push_in(I_ADD | s.w[SENT] << 4)
                s.w[SENT] += 1
                yield "add_request", s.freeze()

        @action("user", "abort_request")
        def _abort(w: World) -> Iterator[tuple[str, World]]:
            if w[CREQ] in Q_ABORTABLE:
                for label, nw in user_send(w, I_ABORT, "abort_request", request_frame=True):
                    s = _Step(self, nw)
                    s.fire(CREQ, self.t_creq, QE.ABORT_SENT)
                    yield label, s.freeze()

        @action("user", "call_utility")
        def _util(w: World) -> Iterator[tuple[str, World]]:
            if not owner_may_call(w) or w[UTIL] != NO_UTIL:
                return
            if w[C] == C_DEAD:  # fails at once with EngineDeadError
                s = _Step(self, w)
                s.w[BUDGET_LEFT] -= 1
                s.w[UTIL] = U_PENDING
                s.fire(UTIL, self.t_util, UE.ENGINE_DIED)
                s.w[UTIL_ENDS] += 1
                yield "call_utility", s.freeze()
                return
            for label, nw in user_send(w, I_UTIL, "call_utility"):
                s = _Step(self, nw)
                s.w[UTIL] = U_PENDING
                yield label, s.freeze()

        for ev, label in ((UE.CANCEL, "cancel_utility"), (UE.TIMEOUT, "utility_timeout")):
            def _end_call(
                w: World, ev: UtilityEvent = ev, label: str = label
            ) -> Iterator[tuple[str, World]]:
                if owner_may_call(w) and w[UTIL] == U_PENDING:
                    s = _Step(self, w)
                    s.w[BUDGET_LEFT] -= 1
                    s.fire(UTIL, self.t_util, ev)
                    s.w[UTIL_ENDS] += 1
                    yield label, s.freeze()

            acts.append(Action("user", label, _end_call))

        for msg, label in (
            (I_SLEEP_ABORT, "sleep_abort"),
            (I_SLEEP_WAIT, "sleep_wait"),
            (I_PAUSE_KEEP, "pause_keep"),
            (I_WAKE_WEIGHTS, "wake_weights"),
            (I_WAKE_ALL, "wake_all"),
            (I_RESUME, "resume_scheduler"),
        ):
            def _send(w: World, msg: int = msg, label: str = label) -> Iterator[tuple[str, World]]:
                yield from user_send(w, msg, label)

            acts.append(Action("user", label, _send))

        @action("user", "shutdown")
        def _shutdown(w: World) -> Iterator[tuple[str, World]]:
            if owner_may_call(w) and (w[C] in C_LIVE or w[C] == C_DEAD):
                s = _Step(self, w)
                s.w[BUDGET_LEFT] -= 1
                s.w[CLOSING] = 1
                if s.w[STANDALONE]:
                    # The engine outlives this client: abort what it still runs for it (a
                    # dead client sends nothing). Past IN_CAP: the last frame, sent once.
                    if w[C] in C_LIVE and s.w[CREQ] in Q_LIVE:
                        s.w[LEFT] = 1
                        if bug != "shutdown_leaves_work":
                            s.push_in(I_ABORT | s.w[SENT] << 4)
                            s.w[SENT] += 1
                            s.fire(CREQ, self.t_creq, QE.ABORT_SENT)
                elif not s.w[PROC_EXITED] and len(s.w[INQ]) < IN_CAP:
                    s.push_in(I_SHUTDOWN)
                yield "shutdown", s.freeze()

        # -- the client's own threads ----------------------------------------------------------
        @action("client", "shutdown_kill")
        def _kill(w: World) -> Iterator[tuple[str, World]]:
            # The grace period ran out: terminate, then kill, the engine process.
            if (bug != "shutdown_no_kill" and w[CLOSING] and not w[PROC_EXITED]
                    and not w[PARENT_DEAD] and not w[STANDALONE]):
                s = _Step(self, w)
                s.w[PROC_EXITED] = 1
                yield "shutdown_kill", s.freeze()

        @action("client", "shutdown_finish")
        def _finish(w: World) -> Iterator[tuple[str, World]]:
            joined = w[PROC_EXITED] or w[STANDALONE] or bug == "shutdown_skips_join"
            if w[CLOSING] and joined and w[C] != C_SHUTDOWN and not w[PARENT_DEAD]:
                s = _Step(self, w)
                s.fire(C, self.t_client, CE.SHUTDOWN)
                if s.w[UTIL] == U_PENDING:
                    s.fire(UTIL, self.t_util, UE.CLIENT_SHUTDOWN)
                    s.w[UTIL_ENDS] += 1
                if s.w[CREQ] in Q_LIVE:
                    s.fire(CREQ, self.t_creq, QE.FINISH_ERROR)
                s.w[POWER_PENDING] = 0  # pending power calls end with ClientClosedError
                yield "shutdown_finish", s.freeze()

        @action("client", "handshake_deadline")
        def _deadline(w: World) -> Iterator[tuple[str, World]]:
            # ready_timeout_s: a timer, not a fault, so it also ends a hung construction.
            if w[C] == C_CONSTRUCTING and not w[PARENT_DEAD] and bug != "no_startup_deadline":
                s = _Step(self, w)
                s.fire(C, self.t_client, CE.CONSTRUCTION_FAILED)
                if not s.w[STANDALONE]:
                    s.w[PROC_EXITED] = 1  # the constructor kills and reaps its engine
                yield "handshake_deadline", s.freeze()

        @action("client", "attach_deadline")
        def _attach_deadline(w: World) -> Iterator[tuple[str, World]]:
            # The marker is overdue (ready_timeout_s after the ATTACH): a timer, so a hung
            # engine or a lost ATTACH cannot leave the client waiting. Modelled as firing only
            # when the marker is not on its way (ATTACH queued or marker queued, engine not
            # hung): firing while it is in flight is a slow engine, which ends like any death.
            on_way = not w[HUNG] and (I_ATTACH in w[INQ] or O_MARKER in w[OUTQ])
            if (bug != "no_attach_deadline" and w[C] in C_LIVE and not w[ATTACHED]
                    and not on_way and not w[CLOSING] and not w[PARENT_DEAD]):
                s = _Step(self, w)
                self._on_death(s)
                yield "attach_deadline", s.freeze()

        @action("client", "receive_output")
        def _rx(w: World) -> Iterator[tuple[str, World]]:
            if not w[OUTQ] or w[PARENT_DEAD] or w[C] == C_DEAD:
                return
            if w[C] == C_SHUTDOWN:
                if w[STANDALONE]:  # no front end connected: the engine's outputs are dropped
                    s = _Step(self, w)
                    s.w[OUTQ] = s.w[OUTQ][1:]
                    yield "output_dropped", s.freeze()
                return
            s = _Step(self, w)
            msg, s.w[OUTQ] = s.w[OUTQ][0], s.w[OUTQ][1:]
            if msg == O_HS:
                s.fire(C, self.t_client, CE.HANDSHAKE_OK)
                s.push_in(I_ATTACH)  # sent by the constructor, ahead of any owner call
            elif (not s.w[ATTACHED] and msg != O_DEAD
                    and (msg == O_MARKER or bug != "reader_keeps_stale")):
                # Before its marker only the marker and the dead sentinel count; the rest
                # (a previous front end's outputs, an undecodable frame) is dropped unread.
                if msg == O_MARKER:
                    s.w[ATTACHED] = 1
            elif msg == O_STALE:
                s.flag("no_foreign_output")
            elif msg == O_MARKER:
                s.flag("spec_conformance")  # one marker per session
            elif msg == O_TOK or msg in _FIN_EVENT:
                if s.w[CREQ] not in Q_LIVE:
                    s.flag("no_output_after_finish")
                elif msg == O_TOK:
                    s.fire(CREQ, self.t_creq, QE.OUTPUT)
                else:
                    s.fire(CREQ, self.t_creq, _FIN_EVENT[msg])
            elif msg in (O_UREPLY_OK, O_UREPLY_ERR):
                ev = UE.REPLY_OK if msg == O_UREPLY_OK else UE.REPLY_ERROR
                if s.w[UTIL] == U_PENDING:
                    s.fire(UTIL, self.t_util, ev)
                    s.w[UTIL_ENDS] += 1
                elif s.w[UTIL] in U_LATE_OK:
                    s.fire(UTIL, self.t_util, ev)  # late reply: dropped, no entry left
                    if bug == "late_reply_resolves":
                        s.w[UTIL_ENDS] += 1
                else:
                    s.flag("spec_conformance")
            elif msg in O_POWER_REPLIES:
                if not s.w[POWER_PENDING]:
                    s.flag("spec_conformance")  # a reply nobody asked for
                else:
                    s.w[POWER_PENDING] -= 1
                if msg == O_SLEPT:
                    s.fire(C, self.t_client, CE.SLEEP_ACKED)
                elif msg == O_WOKE_FULL:
                    s.fire(C, self.t_client, CE.WAKE_ACKED, "fully_awake")
                elif msg == O_WOKE_PART:
                    s.fire(C, self.t_client, CE.WAKE_ACKED, "partially_awake")
                # O_POWER_ERR: the call raises UtilityError; the client's state stays.
            elif msg in (O_DEAD, O_SESSION_END):  # the sentinel; the session's end: ProtocolError
                self._on_death(s)
            else:  # O_CORRUPT: undecodable frame -> ProtocolError, engine unusable: kill it
                self._on_death(s)
                if not s.w[STANDALONE]:  # a standalone engine is not this client's to kill
                    s.w[PROC_EXITED] = 1
            yield "receive_output", s.freeze()

        @action("monitor", "process_exit_noticed")
        def _monitor(w: World) -> Iterator[tuple[str, World]]:
            # Reports each exit once. It races the dead sentinel (then the client is already
            # DEAD and the notice loops there) and a finished shutdown (the notice is ignored
            # there); while a shutdown is under way the exit is expected and not reported,
            # so pending calls end in ClientClosedError, not a spurious EngineDeadError.
            if (bug == "no_monitor" or not w[PROC_EXITED] or w[MONITOR_SEEN] or w[PARENT_DEAD]
                    or (w[CLOSING] and w[C] != C_SHUTDOWN)):
                return
            s = _Step(self, w)
            s.w[MONITOR_SEEN] = 1
            if w[C] in (C_DEAD, C_SHUTDOWN):
                s.fire(C, self.t_client, CE.ENGINE_DIED)
            else:
                self._on_death(s)
            yield "process_exit_noticed", s.freeze()

        # -- the engine process ------------------------------------------------------------
        def engine_runs(w: World) -> bool:
            return not w[PROC_EXITED] and not w[HUNG]

        @action("engine", "start")
        def _start(w: World) -> Iterator[tuple[str, World]]:
            if engine_runs(w) and w[E] == E_CONSTRUCTING:
                s = _Step(self, w)
                s.fire(E, self.t_engine, EE.BUILT, "subprocess")
                s.fire(E, self.t_engine, EE.HANDSHAKE_SENT)
                s.push_out(O_HS)
                s.fire(E, self.t_engine, EE.LOOP_STARTED)
                yield "engine_start", s.freeze()
                if w[C] != C_CONSTRUCTING:
                    return
                # Or the engine was started on its own and a previous front end used it: it
                # answers this client's connection with its ready, in one of these states.
                for label in _STANDALONE_STARTS:
                    s = _Step(self, w)
                    s.w[STANDALONE] = 1
                    s.fire(E, self.t_engine, EE.BUILT, "subprocess")
                    s.fire(E, self.t_engine, EE.HANDSHAKE_SENT)
                    s.fire(E, self.t_engine, EE.LOOP_STARTED)
                    # A request of the same id as this client's; a running one outputs more,
                    # maybe before this client reads the ready.
                    s.fire(EREQ, self.t_ereq, RE.ADD)
                    s.fire(E, self.t_engine, EE.WORK_ARRIVED)
                    s.fire(EREQ, self.t_ereq, RE.SCHEDULE)
                    s.w[TOKS] = TOKENS
                    s.w[STALE] = 1
                    if label == "parked":  # sleep(level=1, mode="keep")
                        s.fire(EREQ, self.t_ereq, RE.PREEMPT)
                        s.w[PREEMPTED] = 1
                        s.fire(E, self.t_engine, EE.PAUSE_KEEP)
                        self._release(s)
                    s.push_out(O_HS)
                    yield f"engine_standalone_{label}", s.freeze()

        @action("engine", "receive_input")
        def _recv(w: World) -> Iterator[tuple[str, World]]:
            if not (engine_runs(w) and w[INQ] and w[E] in E_LOOP and len(w[OUTQ]) <= 1):
                return
            s = _Step(self, w)
            q = s.w[INQ]
            if bug == "input_reorders" and len(q) > 1:
                msg, s.w[INQ] = q[-1], q[:-1]
            else:
                msg, s.w[INQ] = q[0], q[1:]
            kind = msg & 15
            if s.w[REFUSED]:
                if kind != I_ATTACH:  # the ended session's front end is not listened to
                    self._settle(s)
                    yield "engine_ignores_refused", s.freeze()
                    return
                s.w[REFUSED] = 0
            if kind == I_ADD:
                self._check_seq(s, msg)
                s.fire(EREQ, self.t_ereq, RE.ADD)
                s.w[TOKS] = TOKENS
                if s.w[E] != E_RUNNING:
                    s.fire(E, self.t_engine, EE.WORK_ARRIVED)
            elif kind == I_ABORT:
                self._check_seq(s, msg)
                if s.w[EREQ] in R_LIVE:
                    self._abort_live(s)
                else:
                    s.fire(EREQ, self.t_ereq, RE.ABORT)  # unknown or finished id: no-op
            elif kind == I_UTIL:
                s0 = _Step(self, s.freeze())
                s0.push_out(O_UREPLY_OK)
                self._settle(s0)
                yield "engine_utility_ok", s0.freeze()
                if bug != "drop_failed_reply":
                    s.push_out(O_UREPLY_ERR)
                self._settle(s)
                yield "engine_utility_error", s.freeze()
                return
            elif kind == I_SLEEP_ABORT:
                self._abort_live(s)
                s.fire(E, self.t_engine, EE.PAUSE_ABORT)
                self._complete_waiters(s)  # the abort ended their wait
                self._release(s)
                self._reply_slept(s)
            elif kind == I_SLEEP_WAIT:
                s.fire(E, self.t_engine, EE.PAUSE_WAIT)
                if s.w[E] == E_DRAINING:
                    s.w[SLEEP_FLAG] = 1
                    if bug == "reply_before_drain":
                        self._reply_slept(s)
                    else:
                        s.w[DRAIN_WAITERS] += 1
                else:
                    self._release(s)
                    self._reply_slept(s)
            elif kind == I_PAUSE_KEEP:
                if s.w[EREQ] == R_RUNNING:
                    s.fire(EREQ, self.t_ereq, RE.PREEMPT)  # parked, resumes after wake-up
                s.fire(E, self.t_engine, EE.PAUSE_KEEP)
                s.w[SLEEP_FLAG] = 1
                self._complete_waiters(s)  # earlier sleep(wait)s stop waiting: answered first
                self._reply_slept(s)
            elif kind in (I_WAKE_WEIGHTS, I_WAKE_ALL):
                self._wake(s, full=kind == I_WAKE_ALL)
            elif kind == I_RESUME:
                self._resume(s)
            elif kind == I_SHUTDOWN:
                s.fire(E, self.t_engine, EE.SHUTDOWN)
                s.w[PROC_EXITED] = 1
            elif kind == I_ATTACH:
                if bug != "attach_keeps_work":  # EngineCore.start_session()
                    if s.w[STALE]:
                        if s.w[EREQ] in R_LIVE:
                            s.fire(EREQ, self.t_ereq, RE.ABORT)  # dropped: nobody listens
                        s.w[STALE] = 0
                    if s.w[E] in (E_PAUSED, E_SLEEPING, E_DRAINING):
                        s.w[WA] = s.w[KVA] = 0
                        s.fire(E, self.t_engine, EE.WAKE_UP,
                               "has_work" if self._has_work(s) else "no_work")
                        s.w[SLEEP_FLAG] = 0
                    self._settle(s)
                if (s.w[E] != E_IDLE or s.w[EREQ] in R_LIVE or s.w[STALE] or s.w[WA]
                        or s.w[KVA] or s.w[SLEEP_FLAG]):
                    s.flag("session_starts_fresh")
                s.push_out(O_MARKER)
            else:  # I_CORRUPT: a frame the integrity check rejects ends the session, not the
                # engine: its work is dropped (as by an attach), its front end told, then
                # ignored until it attaches again.
                if s.w[EREQ] in R_LIVE:
                    s.fire(EREQ, self.t_ereq, RE.ABORT)  # no output: the notice says it all
                s.w[STALE] = s.w[DRAIN_WAITERS] = 0
                if s.w[E] in (E_PAUSED, E_SLEEPING, E_DRAINING):
                    s.w[WA] = s.w[KVA] = 0
                    s.fire(E, self.t_engine, EE.WAKE_UP, "no_work")
                    s.w[SLEEP_FLAG] = 0
                self._settle(s)
                s.w[REFUSED] = 1
                if bug != "session_end_unannounced":
                    s.push_out(O_SESSION_END)
            self._settle(s)
            yield "engine_receive", s.freeze()

        @action("engine", "step")
        def _step(w: World) -> Iterator[tuple[str, World]]:
            if not (engine_runs(w) and w[E] in (E_RUNNING, E_DRAINING) and len(w[OUTQ]) < OUT_CAP):
                return
            r = w[EREQ]
            if r in R_QUEUED:
                s = _Step(self, w)
                s.fire(EREQ, self.t_ereq, RE.SCHEDULE)
                yield "engine_schedule", s.freeze()
                return
            if r != R_RUNNING:
                return
            if w[STALE]:  # a previous front end's request: how it ends is nobody's business
                s = _Step(self, w)
                s.fire(EREQ, self.t_ereq, RE.STOP)
                s.w[STALE] = 0
                s.push_out(O_STALE)
                self._settle(s)
                yield "engine_stale_finish", s.freeze()
                return
            choices: list[tuple[str, EngineRequestEvent | None, int]] = []
            if w[TOKS] > 0:
                choices.append(("engine_token", None, O_TOK))
            else:
                choices.append(("engine_length", RE.LENGTH, O_FIN_LENGTH))
            choices.append(("engine_stop", RE.STOP, O_FIN_STOP))
            choices.append(("engine_request_error", RE.ERROR, O_FIN_ERROR))
            if not w[PREEMPTED]:
                choices.append(("engine_preempt", RE.PREEMPT, 0))
            for label, ev, out in choices:
                s = _Step(self, w)
                if ev is None:
                    s.w[TOKS] -= 1
                else:
                    s.fire(EREQ, self.t_ereq, ev)
                if ev is RE.PREEMPT:
                    s.w[PREEMPTED] = 1
                if out:
                    s.push_out(out)
                self._settle(s)
                yield label, s.freeze()

        @action("watchdog", "parent_gone")
        def _watchdog(w: World) -> Iterator[tuple[str, World]]:
            if (bug != "ignore_parent_death" and w[PARENT_DEAD] and not w[PROC_EXITED]
                    and not w[STANDALONE]):
                s = _Step(self, w)
                if s.w[E] != E_SHUTDOWN:
                    s.fire(E, self.t_engine, EE.SHUTDOWN)
                s.w[PROC_EXITED] = 1
                yield "engine_exits_orphaned", s.freeze()

        # -- faults ------------------------------------------------------------------------------
        @action("fault", "faults")
        def _faults(w: World) -> Iterator[tuple[str, World]]:
            if not w[FAULTS_LEFT]:
                return
            # A run may also be fault-free; without this choice every quiescent world would
            # have seen a fault, and fault-excused obligations would hide liveness bugs.
            s = _Step(self, w)
            s.w[FAULTS_LEFT] = 0
            yield "no_fault", s.freeze()
            alive = not w[PROC_EXITED]
            if alive and w[E] not in (E_DEAD, E_SHUTDOWN) and not w[HUNG]:
                s = _Step(self, w)
                s.w[FAULTS_LEFT] -= 1
                s.fire(E, self.t_engine, EE.FATAL_ERROR)
                s.push_out(O_DEAD)
                s.w[PROC_EXITED] = 1
                yield "crash_with_sentinel", s.freeze()
            if alive:
                s = _Step(self, w)
                s.w[FAULTS_LEFT] -= 1
                s.w[PROC_EXITED] = 1
                yield "crash_silently", s.freeze()
                if not w[HUNG]:
                    s = _Step(self, w)
                    s.w[FAULTS_LEFT] -= 1
                    s.w[HUNG] = 1
                    yield "engine_hangs", s.freeze()
            if alive and len(w[INQ]) < IN_CAP and not w[PARENT_DEAD]:
                s = _Step(self, w)
                s.w[FAULTS_LEFT] -= 1
                s.push_in(I_CORRUPT)
                yield "corrupt_input_frame", s.freeze()
            if w[C] not in (C_DEAD, C_SHUTDOWN) and alive and not w[PARENT_DEAD]:
                s = _Step(self, w)
                s.w[FAULTS_LEFT] -= 1
                s.push_out(O_CORRUPT)
                yield "corrupt_output_frame", s.freeze()
            # A link that drops just as the client attaches loses its ATTACH: the engine goes
            # on serving, with no marker. (Not over a previous front end's live request: the
            # model's single id would collide; the runtime refuses such an add, tested apart.)
            if w[INQ] and w[INQ][0] == I_ATTACH and not w[STALE]:
                s = _Step(self, w)
                s.w[FAULTS_LEFT] -= 1
                s.w[INQ] = s.w[INQ][1:]
                yield "attach_lost", s.freeze()
            if not w[PARENT_DEAD]:
                s = _Step(self, w)
                s.w[FAULTS_LEFT] -= 1
                s.w[PARENT_DEAD] = 1
                yield "parent_dies", s.freeze()

        return tuple(acts)


def describe_world(world: World) -> dict[str, object]:
    """A readable view of a world (enum names instead of ints) for counterexamples."""
    names: dict[int, type[Enum]] = {
        C: ClientState, E: EngineState, CREQ: ClientRequestState, EREQ: EngineRequestState,
    }
    out: dict[str, object] = {}
    for i, field in enumerate(FIELDS):
        v = world[i]
        if i in names:
            v = list(names[i])[v].name
        elif i == UTIL:
            v = "none" if v == NO_UTIL else list(UtilityState)[v].name
        elif i == INQ:
            v = [IN_MSGS[(m & 15) - 1] for m in v]
        elif i == OUTQ:
            v = [OUT_MSGS[m - 1] for m in v]
        out[field] = v
    return out
