"""Engine membership: one engine core's place in a data-parallel client, as the client sees it.

Theory of operation
-------------------
Rule 1: a data-parallel client (one client over N engine cores) holds one of these per engine
index; it fires events and reads the state, and the named sets below say what each state
allows. Nothing in ``runtime/`` spells a membership state.
Rule 2: the loss of one engine is this machine's business, not the client's: the client's own
lifecycle (``client.py``) reaches DEAD only when no member is left (``MEMBER_LEFT`` is empty).

An engine is STARTING until its ready handshake (and the attach marker) arrive, then SERVING:
only a serving engine is given requests and utility calls. It DIES from any live state (its
process exited, its heartbeat stopped, it sent the dead sentinel or a frame that does not
decode); a second notice loops. A dead engine's live requests end with ``FinishReason.ERROR``
and its pending calls raise ``EngineDeadError`` naming it; nothing it owned moves to another
engine. Where restarts are enabled, a dead engine is RESTARTING while a replacement under the
same index starts; its handshake makes it SERVING again, a failed start leaves it DEAD. The
replacement has a channel of its own: nothing meant for its predecessor can reach it, and
nothing sent to the predecessor is replayed; the predecessor's process is killed, and gone,
before the replacement starts. A crash loop is bounded: an incarnation that dies within
seconds of its handshake is restarted after a growing backoff, and after the client's
``restart_limit`` such deaths in a row no RESTART is fired: the member stays DEAD.
SHUTDOWN ends every member, whatever its state.

The client's power state (``client.py``) is its serving members': in ``CLIENT_ASLEEP`` while
any serving engine's client is, awake once none is (spec/compose_dp.py checks it against
late replies, a target lost mid-call and replacements, which start awake).

Elastic scaling (``scale(n)``): a *slot* is one tenure of an index. A joining engine is a new
slot, STARTING; the scale commits once every joiner's handshake arrived (each HANDSHAKE_OK
fired together, then they take work); a joiner that fails to start fails the scale and every
other joiner of it is REMOVED (the previous set keeps serving). A leaving engine is LEAVE'd
to DRAINING the moment the scale is called: it takes no new request or call, its live
requests finish (or, at the drain deadline or without a drain, are aborted), then DRAINED
makes it REMOVED, once its process is gone. A leaver that dies is simply gone (its live
requests end with ERROR; it is never restarted). A dead or restarting index may be removed
at once. REMOVED is final for that slot: an index that joins again is a new slot with a new
channel and identity, so nothing of an earlier tenure reaches it. One scale runs at a time,
and none while the client sleeps or a power call runs, nor a power call while a scale runs
(``SCALE``, below).
"""

from __future__ import annotations

from enum import Enum

from .client import CLIENT_ASLEEP, ClientState
from .machine import Machine, Transition

__all__ = [
    "LAST_POWER_CALL",
    "MEMBERSHIP",
    "MEMBER_DOWN",
    "MEMBER_GONE",
    "MEMBER_IN_SET",
    "MEMBER_LEFT",
    "MEMBER_ROUTABLE",
    "OTHER_POWER_CALLS",
    "SCALE",
    "SCALE_REFUSED",
    "MembershipEvent",
    "MembershipState",
    "ScaleEvent",
    "ScaleState",
]


class MembershipState(Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    DEAD = "dead"
    RESTARTING = "restarting"
    REMOVED = "removed"
    SHUT_DOWN = "shut_down"


class MembershipEvent(Enum):
    HANDSHAKE_OK = "handshake_ok"
    DIED = "died"
    RESTART = "restart"
    LEAVE = "leave"
    DRAINED = "drained"
    REMOVE = "remove"
    SHUTDOWN = "shutdown"


S, E = MembershipState, MembershipEvent

MEMBER_ROUTABLE: frozenset[MembershipState] = frozenset({S.SERVING})
"""Requests, aborts and utility calls go only to an engine in one of these states."""
MEMBER_LEFT: frozenset[MembershipState] = frozenset(
    {S.STARTING, S.SERVING, S.DRAINING, S.RESTARTING})
"""An engine still counts: the client is DEAD only when none of its members is in one."""
MEMBER_DOWN: frozenset[MembershipState] = frozenset({S.DEAD, S.RESTARTING})
"""An index of the set that is not serving because its engine died (``dead_engines``)."""
MEMBER_IN_SET: frozenset[MembershipState] = frozenset(
    {S.STARTING, S.SERVING, S.DEAD, S.RESTARTING})
"""The indexes the client is meant to have (``data_parallel_size``): not leaving or gone."""
MEMBER_GONE: frozenset[MembershipState] = frozenset({S.REMOVED})
"""A slot that left the client for good (``scale``): not reported, its index free to join
again as a new slot."""

MEMBERSHIP: Machine[MembershipState, MembershipEvent] = Machine(
    name="membership",
    states=MembershipState,
    events=MembershipEvent,
    initial=S.STARTING,
    terminal=frozenset({S.SHUT_DOWN, S.REMOVED}),
    doc=__doc__ or "",
    transitions=(
        Transition(S.STARTING, E.HANDSHAKE_OK, S.SERVING,
                   note="with every other engine of its start or scale"),
        Transition(S.STARTING, E.DIED, S.DEAD, note="failed to start"),
        Transition(S.STARTING, E.REMOVE, S.REMOVED, note="a joiner of a scale that failed"),
        Transition(S.SERVING, E.DIED, S.DEAD, note="its live requests end with ERROR"),
        Transition(S.SERVING, E.LEAVE, S.DRAINING, note="scale down: no new work from now"),
        Transition(S.DRAINING, E.DRAINED, S.REMOVED,
                   note="its requests ended (the rest aborted at the deadline), process gone"),
        Transition(S.DRAINING, E.DIED, S.REMOVED,
                   note="a dead leaver is gone: its live requests end with ERROR"),
        Transition(S.DEAD, E.DIED, S.DEAD, note="second notice"),
        Transition(S.DEAD, E.RESTART, S.RESTARTING,
                   note="only with restart_dead_engines, within restart_limit"),
        Transition(S.DEAD, E.REMOVE, S.REMOVED, note="scale down takes a dead index at once"),
        Transition(S.RESTARTING, E.HANDSHAKE_OK, S.SERVING, note="same index, a new channel"),
        Transition(S.RESTARTING, E.DIED, S.DEAD, note="the replacement failed to start"),
        Transition(S.RESTARTING, E.REMOVE, S.REMOVED,
                   note="scale down abandons the replacement"),
        *(Transition(s, E.SHUTDOWN, S.SHUT_DOWN)
          for s in (S.STARTING, S.SERVING, S.DRAINING, S.DEAD, S.RESTARTING)),
        Transition(S.SHUT_DOWN, E.SHUTDOWN, S.SHUT_DOWN, note="idempotent"),
        Transition(S.SHUT_DOWN, E.DIED, S.SHUT_DOWN, note="exit after shutdown is expected"),
        Transition(S.REMOVED, E.DIED, S.REMOVED, note="exit after removal is expected"),
        Transition(S.REMOVED, E.SHUTDOWN, S.REMOVED, note="gone already"),
    ),
)


class ScaleState(Enum):
    IDLE = "idle"
    SCALING = "scaling"
    POWERING = "powering"


class ScaleEvent(Enum):
    BEGIN = "begin"
    END = "end"
    POWER_BEGIN = "power_begin"
    POWER_END = "power_end"


LAST_POWER_CALL, OTHER_POWER_CALLS = "last_power_call", "other_power_calls"
"""POWER_END's guards: whether the returning power call was the last one running."""

SCALE_REFUSED: frozenset[ClientState] = CLIENT_ASLEEP
"""Client states in which ``scale`` is refused (a SpecViolation naming the state): a joiner
starts awake, so a sleeping group would be neither asleep nor awake."""

SCALE: Machine[ScaleState, ScaleEvent] = Machine(
    name="scale",
    states=ScaleState,
    events=ScaleEvent,
    initial=ScaleState.IDLE,
    terminal=frozenset(),
    doc="One data-parallel client's group operations: one scale at a time, and never beside "
        "a power call (sleep, wake-up, pause, resume: a joiner starts awake and a sleep "
        "reaches only the engines serving when it is sent, so either race would leave the "
        "group neither asleep nor awake). A BEGIN while SCALING or POWERING, or a "
        "POWER_BEGIN while SCALING, is a SpecViolation and the running operation goes on; "
        "power calls may overlap each other.",
    transitions=(
        Transition(ScaleState.IDLE, ScaleEvent.BEGIN, ScaleState.SCALING,
                   note="scale(n) called; joiners start, leavers drain"),
        Transition(ScaleState.SCALING, ScaleEvent.END, ScaleState.IDLE,
                   note="joiners serving and leavers gone, or the scale failed"),
        Transition(ScaleState.IDLE, ScaleEvent.POWER_BEGIN, ScaleState.POWERING,
                   note="a power call is sent to every serving engine"),
        Transition(ScaleState.POWERING, ScaleEvent.POWER_BEGIN, ScaleState.POWERING,
                   note="another thread's power call"),
        Transition(ScaleState.POWERING, ScaleEvent.POWER_END, ScaleState.IDLE,
                   guard=LAST_POWER_CALL, note="the last power call running returned"),
        Transition(ScaleState.POWERING, ScaleEvent.POWER_END, ScaleState.POWERING,
                   guard=OTHER_POWER_CALLS, note="another power call still runs"),
    ),
)
