"""Engine session: which front end an engine core serves, as its input thread sees it.

Theory of operation
-------------------
Rule 1: every session state and transition lives in this table; the engine's input thread
fires events and reads ``state`` through the named set below, it keeps no flag of its own.
Rule 2: the input thread owns this machine (it sees every ATTACH and every integrity failure
first, in arrival order); the busy loop acts on what the thread queues behind them (dropping
the previous front end's requests, the marker, the refusal), so the two never disagree about
which messages came before a change.

An engine starts with NO_FRONT_END. An accepted ATTACH makes it ATTACHED to that front end's
session, from any state: a new session replaces the previous one (whose requests and owed
replies the loop drops), the same session again is answered with a marker only. An ATTACH
whose frame-integrity setting differs from the engine's is REFUSED: the refusal goes back as
its marker and every further message is dropped unread until an ATTACH is accepted. A front
end (or a peer that never attached) whose input fails the integrity check (lost, reordered
or corrupted frames) has its session ENDED: its work is dropped, it is told why, and it too
is ignored until it or another front end attaches. The engine's exit is its process's
business (``engine.py``), not a state here.
"""

from __future__ import annotations

from enum import Enum

from .machine import Machine, Transition

__all__ = ["SESSION", "SESSION_DROPS_INPUT", "SessionEvent", "SessionState"]


class SessionState(Enum):
    NO_FRONT_END = "no_front_end"
    ATTACHED = "attached"
    REFUSED = "refused"
    ENDED = "ended"


class SessionEvent(Enum):
    ATTACH_ACCEPTED = "attach_accepted"
    ATTACH_REFUSED = "attach_refused"
    INTEGRITY_FAILED = "integrity_failed"


S, E = SessionState, SessionEvent

SESSION_DROPS_INPUT: frozenset[SessionState] = frozenset({S.REFUSED, S.ENDED})
"""States in which every message but an ATTACH is dropped unread."""

SESSION: Machine[SessionState, SessionEvent] = Machine(
    name="session",
    states=SessionState,
    events=SessionEvent,
    initial=S.NO_FRONT_END,
    terminal=frozenset(),
    doc=__doc__ or "",
    transitions=(
        Transition(S.NO_FRONT_END, E.ATTACH_ACCEPTED, S.ATTACHED, note="the first front end"),
        Transition(S.ATTACHED, E.ATTACH_ACCEPTED, S.ATTACHED,
                   note="a new session drops the old one's work; the same one: a marker"),
        Transition(S.REFUSED, E.ATTACH_ACCEPTED, S.ATTACHED),
        Transition(S.ENDED, E.ATTACH_ACCEPTED, S.ATTACHED),
        *(Transition(s, E.ATTACH_REFUSED, S.REFUSED, note="frame integrity differs")
          for s in (S.NO_FRONT_END, S.ATTACHED, S.REFUSED, S.ENDED)),
        Transition(S.ATTACHED, E.INTEGRITY_FAILED, S.ENDED, note="its work dropped, it is told"),
        Transition(S.NO_FRONT_END, E.INTEGRITY_FAILED, S.ENDED,
                   note="a peer that never attached: nothing to drop"),
    ),
)
