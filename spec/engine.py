"""Engine lifecycle: the EngineCore's busy loop as a state machine.

Theory of operation
-------------------
Rule 1: every engine state and transition lives in this table; the engine core and its
process wrapper fire events, they never assign a state.
Rule 2: this machine is the same in-process and in a subprocess; the process wrapper adds
the handshake and the sentinel, which are events here.

The engine is CONSTRUCTING while it loads weights and sizes its KV cache. In a subprocess it
then sends the ready handshake (READY); in-process the handshake is implicit. The loop is IDLE
when nothing is scheduled (it blocks on its input queue, never spins) and RUNNING while
requests are in flight. A pause stops scheduling: mode ``abort`` ends in-flight requests with
ABORT outputs and pauses at once, ``keep`` parks them and pauses at once, ``wait`` lets them
finish first (DRAINING) and only then pauses, so the pause reply means "idle". Sleep is a pause
followed by releasing memory: level 0 releases nothing (the engine stays PAUSED), level 1
offloads weights and frees the KV cache, level 2 frees both (SLEEPING). ``wake_up`` restores
tags; scheduling resumes only once every tag is resident, into IDLE or RUNNING depending on
whether parked requests remain; a wake-up while DRAINING ends the pending wait (its reply is
an error) and resumes scheduling. Any fatal error sends the engine-dead sentinel (DEAD).
SHUTDOWN is reached by a shutdown request or process exit; DEAD and SHUTDOWN are sticky.
A new front end attaching to an engine started on its own needs no state of its own: the
previous front end's requests end (ABORT) and the engine settles (ALL_FINISHED) or wakes up
(WAKE_UP, every tag) into IDLE through the transitions below.
"""

from __future__ import annotations

from enum import Enum

from .machine import Machine, Transition

__all__ = [
    "ACCEPTS_WORK",
    "AWAKE",
    "ENGINE",
    "HAS_WORK",
    "INPROC",
    "IN_LOOP",
    "NONE_DRAINING",
    "NO_LIVE_REQUESTS",
    "NO_WORK",
    "PARTIAL",
    "PAUSE_EVENTS",
    "POWER_PARKED",
    "REPORTS_SLEEPING",
    "SCHEDULING",
    "STATE_TRIGGERED",
    "SUBPROCESS",
    "EngineEvent",
    "EngineState",
]


class EngineState(Enum):
    CONSTRUCTING = "constructing"
    READY = "ready"
    IDLE = "idle"
    RUNNING = "running"
    DRAINING = "draining"
    PAUSED = "paused"
    SLEEPING = "sleeping"
    DEAD = "dead"
    SHUTDOWN = "shutdown"


class EngineEvent(Enum):
    BUILT = "built"
    HANDSHAKE_SENT = "handshake_sent"
    LOOP_STARTED = "loop_started"
    WORK_ARRIVED = "work_arrived"
    ALL_FINISHED = "all_finished"
    PAUSE_ABORT = "pause_abort"
    PAUSE_KEEP = "pause_keep"
    PAUSE_WAIT = "pause_wait"
    DRAINED = "drained"
    RESUME = "resume"
    RELEASE_MEMORY = "release_memory"
    WAKE_UP = "wake_up"
    FATAL_ERROR = "fatal_error"
    SHUTDOWN = "shutdown"


S, E = EngineState, EngineEvent
_LIVE = (S.READY, S.IDLE, S.RUNNING, S.DRAINING, S.PAUSED, S.SLEEPING)
# Guards on resuming: where the loop lands depends on whether parked requests remain.
HAS_WORK, NO_WORK = "has_work", "no_work"
# Guards on BUILT (which loop the engine runs in) and on a wake-up that leaves tags asleep.
INPROC, SUBPROCESS, PARTIAL = "inproc", "subprocess", "partial"

ENGINE: Machine[EngineState, EngineEvent] = Machine(
    name="engine",
    states=EngineState,
    events=EngineEvent,
    initial=S.CONSTRUCTING,
    terminal=frozenset({S.DEAD, S.SHUTDOWN}),
    doc=__doc__ or "",
    transitions=(
        # In-process engines skip the handshake: BUILT goes straight to IDLE.
        Transition(S.CONSTRUCTING, E.BUILT, S.IDLE, guard=INPROC),
        Transition(S.CONSTRUCTING, E.BUILT, S.CONSTRUCTING, guard=SUBPROCESS),
        Transition(S.CONSTRUCTING, E.HANDSHAKE_SENT, S.READY),
        Transition(S.READY, E.LOOP_STARTED, S.IDLE),
        Transition(S.IDLE, E.WORK_ARRIVED, S.RUNNING),
        Transition(S.RUNNING, E.ALL_FINISHED, S.IDLE),
        # Pausing from the active states.
        Transition(S.IDLE, E.PAUSE_ABORT, S.PAUSED),
        Transition(S.RUNNING, E.PAUSE_ABORT, S.PAUSED, note="in-flight requests end with ABORT"),
        Transition(S.IDLE, E.PAUSE_KEEP, S.PAUSED),
        Transition(S.RUNNING, E.PAUSE_KEEP, S.PAUSED, note="in-flight requests are parked"),
        Transition(S.IDLE, E.PAUSE_WAIT, S.PAUSED),
        Transition(S.RUNNING, E.PAUSE_WAIT, S.DRAINING, note="reply deferred until idle"),
        Transition(S.DRAINING, E.DRAINED, S.PAUSED),
        Transition(S.DRAINING, E.PAUSE_ABORT, S.PAUSED, note="stop waiting: abort the rest"),
        Transition(S.DRAINING, E.PAUSE_KEEP, S.PAUSED, note="stop waiting: park the rest"),
        Transition(S.DRAINING, E.PAUSE_WAIT, S.DRAINING),
        # Work may still arrive while paused or draining; it is queued, not scheduled.
        Transition(S.PAUSED, E.WORK_ARRIVED, S.PAUSED),
        Transition(S.SLEEPING, E.WORK_ARRIVED, S.SLEEPING),
        Transition(S.DRAINING, E.WORK_ARRIVED, S.DRAINING),
        # Pausing again while paused or asleep is a no-op (a repeated sleep/pause request).
        *(Transition(s, e, s) for s in (S.PAUSED, S.SLEEPING)
          for e in (E.PAUSE_ABORT, E.PAUSE_KEEP, E.PAUSE_WAIT)),
        Transition(S.PAUSED, E.RESUME, S.RUNNING, guard=HAS_WORK),
        Transition(S.PAUSED, E.RESUME, S.IDLE, guard=NO_WORK),
        Transition(S.IDLE, E.RESUME, S.IDLE, note="resume while not paused is a no-op"),
        Transition(S.RUNNING, E.RESUME, S.RUNNING, note="resume while not paused is a no-op"),
        # Memory: only a paused engine releases memory (sleep always pauses first).
        Transition(S.PAUSED, E.RELEASE_MEMORY, S.SLEEPING),
        Transition(S.SLEEPING, E.RELEASE_MEMORY, S.SLEEPING, note="deeper level"),
        Transition(S.SLEEPING, E.WAKE_UP, S.SLEEPING, guard=PARTIAL),
        Transition(S.SLEEPING, E.WAKE_UP, S.RUNNING, guard=HAS_WORK),
        Transition(S.SLEEPING, E.WAKE_UP, S.IDLE, guard=NO_WORK),
        # wake_up of a level-0 sleep (paused, nothing released) resumes scheduling.
        Transition(S.PAUSED, E.WAKE_UP, S.RUNNING, guard=HAS_WORK),
        Transition(S.PAUSED, E.WAKE_UP, S.IDLE, guard=NO_WORK),
        Transition(S.IDLE, E.WAKE_UP, S.IDLE, note="not asleep: no-op"),
        Transition(S.RUNNING, E.WAKE_UP, S.RUNNING, note="not asleep: no-op"),
        # A wake-up can overtake a sleep(wait) that is still draining (the caller timed out,
        # or another thread woke the engine): it ends the drain and resumes scheduling, and
        # the pending sleep's reply is an error. As a no-op it answered "fully awake" and the
        # engine fell asleep afterwards (property awake_when_asked).
        Transition(S.DRAINING, E.WAKE_UP, S.RUNNING, guard=HAS_WORK,
                   note="ends the pending sleep/pause(wait): its reply is an error"),
        Transition(S.DRAINING, E.WAKE_UP, S.IDLE, guard=NO_WORK),
        *(Transition(s, E.FATAL_ERROR, S.DEAD) for s in (S.CONSTRUCTING, *_LIVE)),
        Transition(S.DEAD, E.FATAL_ERROR, S.DEAD),
        *(Transition(s, E.SHUTDOWN, S.SHUTDOWN) for s in (S.CONSTRUCTING, *_LIVE, S.DEAD)),
        Transition(S.SHUTDOWN, E.SHUTDOWN, S.SHUTDOWN),
    ),
)

# -- what the runtime and the composed model ask of a state (h11's Rule 1: it lives here) ----
# Neither re-types these sets: tests/spec/test_state_sets.py fails on a set of spec states
# spelled out in runtime/.

SCHEDULING: frozenset[EngineState] = frozenset({S.IDLE, S.RUNNING, S.DRAINING})
"""The scheduler runs requests (a drain still finishes the in-flight ones)."""
AWAKE: frozenset[EngineState] = frozenset({S.IDLE, S.RUNNING})
"""Not paused, draining or asleep: a pause or sleep request changes the state."""
IN_LOOP: frozenset[EngineState] = frozenset(
    {S.IDLE, S.RUNNING, S.DRAINING, S.PAUSED, S.SLEEPING})
"""The busy loop runs (after the handshake, before death or shutdown)."""
REPORTS_SLEEPING: frozenset[EngineState] = frozenset({S.PAUSED, S.DRAINING, S.SLEEPING})
"""``is_sleeping()`` is true from the state alone (vLLM: a paused scheduler is sleeping)."""
POWER_PARKED: frozenset[EngineState] = REPORTS_SLEEPING - SCHEDULING
"""Asleep or paused, not draining: what a front end attaching then is told it finds (a power
notice after its marker)."""
ACCEPTS_WORK: frozenset[EngineState] = frozenset(
    t.source for t in ENGINE.transitions if t.event is E.WORK_ARRIVED)
"""States with a WORK_ARRIVED row: a new request fires it there (derived from the table)."""

PAUSE_EVENTS: dict[str, EngineEvent] = {
    "abort": E.PAUSE_ABORT, "wait": E.PAUSE_WAIT, "keep": E.PAUSE_KEEP}
"""A pause or sleep request's mode, as the event it fires."""

# Conditions the engine evaluates after its requests change (h11's state-triggered
# transitions): in ``state``, when ``condition`` holds, ``event`` fires.
NO_LIVE_REQUESTS, NONE_DRAINING = "no_live_requests", "none_draining"
STATE_TRIGGERED: dict[EngineState, tuple[str, EngineEvent]] = {
    S.RUNNING: (NO_LIVE_REQUESTS, E.ALL_FINISHED),
    S.DRAINING: (NONE_DRAINING, E.DRAINED),
}
"""At most one trigger per state, so the order of evaluation never matters."""


def _check_sets() -> None:
    for name, states in (("SCHEDULING", SCHEDULING), ("AWAKE", AWAKE), ("IN_LOOP", IN_LOOP),
                         ("REPORTS_SLEEPING", REPORTS_SLEEPING)):
        if states & ENGINE.terminal:
            raise ValueError(f"engine: {name} holds a terminal state")
    for state, (_condition, event) in STATE_TRIGGERED.items():
        if not any(t.source is state and t.event is event for t in ENGINE.transitions):
            raise ValueError(f"engine: state-triggered {event.name} has no row from {state.name}")


_check_sets()
