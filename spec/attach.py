"""Attach phase: a front end taking an engine over, from its ATTACH to the engine's marker.

Theory of operation
-------------------
Rule 1: every attach-phase state and transition lives in this table; the client fires events
and reads ``state`` (and the named set below), it never keeps the phase as a flag.
Rule 2: this machine knows nothing of the client's own lifecycle (``client.py``): a refusal,
an overdue marker or an ended session is the client's death there, by its own event.

Every multi-process client attaches (protocol/messages.py, "Attaching"): once the ready
handshake is in, it sends ATTACH under a fresh random session and AWAITS the marker, the
engine's answer naming that session. Until then whatever arrives is a previous front end's
(an engine started on its own outlives its front ends, and what it sent them may still be in
its pipe): it is dropped unread, and the phase loops. The marker makes the front end ATTACHED;
from then on it reads everything as its own. A marker that carries a refusal (the two sides'
frame integrity settings differ) leaves it REFUSED; no marker within ``ready_timeout_s`` leaves
it OVERDUE (the ATTACH was lost, or the engine hangs). An attached front end whose input later
fails the engine's integrity check is told so: its session ENDED. The three ends are final:
a client attaches once (a new front end is a new client).
"""

from __future__ import annotations

from enum import Enum

from .machine import Machine, Transition

__all__ = ["ATTACH", "ATTACH_DROPS_MESSAGES", "AttachEvent", "AttachState"]


class AttachState(Enum):
    DETACHED = "detached"
    AWAITING_MARKER = "awaiting_marker"
    ATTACHED = "attached"
    REFUSED = "refused"
    OVERDUE = "overdue"
    ENDED = "ended"


class AttachEvent(Enum):
    SEND_ATTACH = "send_attach"
    FOREIGN_MESSAGE = "foreign_message"
    MARKER = "marker"
    REFUSAL = "refusal"
    DEADLINE = "deadline"
    SESSION_ENDED = "session_ended"


S, E = AttachState, AttachEvent

ATTACH_DROPS_MESSAGES: frozenset[AttachState] = frozenset({S.AWAITING_MARKER})
"""Phases in which an arriving message is not this front end's: read, dropped unchecked."""

ATTACH: Machine[AttachState, AttachEvent] = Machine(
    name="attach",
    states=AttachState,
    events=AttachEvent,
    initial=S.DETACHED,
    terminal=frozenset({S.REFUSED, S.OVERDUE, S.ENDED}),
    doc=__doc__ or "",
    transitions=(
        Transition(S.DETACHED, E.SEND_ATTACH, S.AWAITING_MARKER, note="after the ready"),
        Transition(S.AWAITING_MARKER, E.FOREIGN_MESSAGE, S.AWAITING_MARKER,
                   note="a previous front end's: dropped unread"),
        Transition(S.AWAITING_MARKER, E.MARKER, S.ATTACHED, note="its own session named"),
        Transition(S.AWAITING_MARKER, E.REFUSAL, S.REFUSED, note="frame integrity differs"),
        Transition(S.AWAITING_MARKER, E.DEADLINE, S.OVERDUE, note="ready_timeout_s passed"),
        Transition(S.ATTACHED, E.SESSION_ENDED, S.ENDED,
                   note="its input failed the integrity check"),
    ),
)
