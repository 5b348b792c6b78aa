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
"""

from __future__ import annotations

from enum import Enum

from .machine import Machine, Transition

__all__ = [
    "MEMBERSHIP",
    "MEMBER_LEFT",
    "MEMBER_ROUTABLE",
    "MembershipEvent",
    "MembershipState",
]


class MembershipState(Enum):
    STARTING = "starting"
    SERVING = "serving"
    DEAD = "dead"
    RESTARTING = "restarting"
    SHUT_DOWN = "shut_down"


class MembershipEvent(Enum):
    HANDSHAKE_OK = "handshake_ok"
    DIED = "died"
    RESTART = "restart"
    SHUTDOWN = "shutdown"


S, E = MembershipState, MembershipEvent

MEMBER_ROUTABLE: frozenset[MembershipState] = frozenset({S.SERVING})
"""Requests, aborts and utility calls go only to an engine in one of these states."""
MEMBER_LEFT: frozenset[MembershipState] = frozenset({S.STARTING, S.SERVING, S.RESTARTING})
"""An engine still counts: the client is DEAD only when none of its members is in one."""

MEMBERSHIP: Machine[MembershipState, MembershipEvent] = Machine(
    name="membership",
    states=MembershipState,
    events=MembershipEvent,
    initial=S.STARTING,
    terminal=frozenset({S.SHUT_DOWN}),
    doc=__doc__ or "",
    transitions=(
        Transition(S.STARTING, E.HANDSHAKE_OK, S.SERVING),
        Transition(S.STARTING, E.DIED, S.DEAD, note="failed to start"),
        Transition(S.SERVING, E.DIED, S.DEAD, note="its live requests end with ERROR"),
        Transition(S.DEAD, E.DIED, S.DEAD, note="second notice"),
        Transition(S.DEAD, E.RESTART, S.RESTARTING,
                   note="only with restart_dead_engines, within restart_limit"),
        Transition(S.RESTARTING, E.HANDSHAKE_OK, S.SERVING, note="same index, a new channel"),
        Transition(S.RESTARTING, E.DIED, S.DEAD, note="the replacement failed to start"),
        *(Transition(s, E.SHUTDOWN, S.SHUT_DOWN)
          for s in (S.STARTING, S.SERVING, S.DEAD, S.RESTARTING)),
        Transition(S.SHUT_DOWN, E.SHUTDOWN, S.SHUT_DOWN, note="idempotent"),
        Transition(S.SHUT_DOWN, E.DIED, S.SHUT_DOWN, note="exit after shutdown is expected"),
    ),
)
