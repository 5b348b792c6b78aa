"""Engine session: which front end an engine core serves on one channel, as its input thread
sees it.

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

Several front ends at once (``client_index``): an engine given K channels (address pairs)
runs one session per channel, the i-th for front end i. An ATTACH whose ``client_index`` is
not its channel's position is MISPLACED: refused, told so, and nobody disturbed. A served
session stays ATTACHED with its work and its heartbeat deadline (if its front end is alive it
attaches again under its own session and goes on; if not, its deadline ends its work), any
other state is kept, and a channel nobody attached yet becomes REFUSED. Outputs, utility replies and
power notices go only to sessions in ``SESSION_SERVED``; request ids are scoped per session.
A served front end that is lost (its heartbeat deadline passed, its connection stayed down
past the bound, or it said goodbye at its shutdown) is GONE: its live requests end in the
engine (aborted, KV freed) and its owed replies are dropped, nobody else's; unless it said
goodbye it is told so (an ended notice on its channel, which a front end only stopped reads
on resuming, instead of waiting on calls its GONE session drops unread); it may attach
again, and the new session sees nothing of the old one's work. An engine-wide power change
(sleep, wake-up, pause, resume) made by one session is sent as a notice to every other
served session, in the engine's order, so every attached client's view converges to the
engine's (``client.py``: a notice fires the event its utility's reply would).
"""

from __future__ import annotations

from enum import Enum

from .machine import Machine, Transition

__all__ = [
    "SESSION",
    "SESSION_DROPS_INPUT",
    "SESSION_SERVED",
    "SessionEvent",
    "SessionState",
]


class SessionState(Enum):
    NO_FRONT_END = "no_front_end"
    ATTACHED = "attached"
    REFUSED = "refused"
    ENDED = "ended"
    GONE = "gone"


class SessionEvent(Enum):
    ATTACH_ACCEPTED = "attach_accepted"
    ATTACH_REFUSED = "attach_refused"
    ATTACH_MISPLACED = "attach_misplaced"
    INTEGRITY_FAILED = "integrity_failed"
    FRONT_END_GONE = "front_end_gone"


S, E = SessionState, SessionEvent

SESSION_DROPS_INPUT: frozenset[SessionState] = frozenset({S.REFUSED, S.ENDED, S.GONE})
"""States in which every message but an ATTACH is dropped unread."""

SESSION_SERVED: frozenset[SessionState] = frozenset({S.ATTACHED})
"""States in which the channel's front end is sent outputs, replies and power notices."""

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
        Transition(S.NO_FRONT_END, E.ATTACH_MISPLACED, S.REFUSED,
                   note="client_index is not the channel's: nobody to disturb"),
        *(Transition(s, E.ATTACH_MISPLACED, s,
                     note="client_index is not the channel's: refused, nothing else changes")
          for s in (S.ATTACHED, S.REFUSED, S.ENDED, S.GONE)),
        Transition(S.ATTACHED, E.INTEGRITY_FAILED, S.ENDED, note="its work dropped, it is told"),
        Transition(S.NO_FRONT_END, E.INTEGRITY_FAILED, S.ENDED,
                   note="a peer that never attached: nothing to drop"),
        Transition(S.ATTACHED, E.FRONT_END_GONE, S.GONE,
                   note="heartbeat deadline, connection lost past the bound, or goodbye:"
                        " its requests end (aborted), its replies are dropped"),
        Transition(S.GONE, E.ATTACH_ACCEPTED, S.ATTACHED,
                   note="it (or its successor) attaches again: a new session"),
        Transition(S.GONE, E.ATTACH_REFUSED, S.REFUSED),
        Transition(S.GONE, E.FRONT_END_GONE, S.GONE, note="a later sign of the same loss"),
    ),
)
