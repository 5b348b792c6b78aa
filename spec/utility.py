"""Utility-call lifecycle: one RPC from the client's future to its single outcome.

Theory of operation
-------------------
Rule 1: every utility-call state and transition lives in this table.
Rule 2: a call has exactly one outcome, and the registry entry for it is gone once it has one.

A call is PENDING from the moment its future is registered (before the frame is sent, so a
reply can never find no entry). It ends exactly once: RESOLVED by a successful reply,
FAILED_REMOTE by a failure reply (``UtilityError``), FAILED_DEAD when the engine dies
(``EngineDeadError``; vLLM leaves such futures hanging), FAILED_CLOSED when the owner shuts
the client down (``ClientClosedError``), CANCELLED by the caller, or TIMED_OUT
(``UtilityTimeoutError``). A reply that arrives after cancel or timeout is LATE: it is dropped,
and since the entry was removed at the first outcome it leaves nothing behind.
"""

from __future__ import annotations

from enum import Enum

from .errors import ClientClosedError, EngineDeadError, UtilityError, UtilityTimeoutError
from .machine import Machine, Transition

__all__ = ["UTILITY", "UtilityEvent", "UtilityState", "outcome_of"]


class UtilityState(Enum):
    PENDING = "pending"
    RESOLVED = "resolved"
    FAILED_REMOTE = "failed_remote"
    FAILED_DEAD = "failed_dead"
    FAILED_CLOSED = "failed_closed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


class UtilityEvent(Enum):
    REPLY_OK = "reply_ok"
    REPLY_ERROR = "reply_error"
    ENGINE_DIED = "engine_died"
    CLIENT_SHUTDOWN = "client_shutdown"
    CANCEL = "cancel"
    TIMEOUT = "timeout"


S, E = UtilityState, UtilityEvent
_DONE = (S.RESOLVED, S.FAILED_REMOTE, S.FAILED_DEAD, S.FAILED_CLOSED, S.CANCELLED, S.TIMED_OUT)

UTILITY: Machine[UtilityState, UtilityEvent] = Machine(
    name="utility",
    states=UtilityState,
    events=UtilityEvent,
    initial=S.PENDING,
    terminal=frozenset(_DONE),
    doc=__doc__ or "",
    transitions=(
        Transition(S.PENDING, E.REPLY_OK, S.RESOLVED),
        Transition(S.PENDING, E.REPLY_ERROR, S.FAILED_REMOTE),
        Transition(S.PENDING, E.ENGINE_DIED, S.FAILED_DEAD),
        Transition(S.PENDING, E.CLIENT_SHUTDOWN, S.FAILED_CLOSED),
        Transition(S.PENDING, E.CANCEL, S.CANCELLED),
        Transition(S.PENDING, E.TIMEOUT, S.TIMED_OUT),
        # A late reply after cancel/timeout is dropped: no state change, no entry left.
        *(Transition(s, e, s, note="late reply dropped")
          for s in (S.CANCELLED, S.TIMED_OUT) for e in (E.REPLY_OK, E.REPLY_ERROR)),
    ),
)


# Which event ends a call that raised on the client's side, by the error (the first match in
# this order: a timeout is a UtilityError too). Declared once, here, for every client.
_ERROR_OUTCOMES: tuple[tuple[type[BaseException], UtilityEvent], ...] = (
    (UtilityTimeoutError, UtilityEvent.TIMEOUT),
    (UtilityError, UtilityEvent.REPLY_ERROR),
    (EngineDeadError, UtilityEvent.ENGINE_DIED),
    (ClientClosedError, UtilityEvent.CLIENT_SHUTDOWN),
)


def outcome_of(error: BaseException) -> UtilityEvent | None:
    """The event that ends a call which raised ``error``: the closed family's by its kind; a
    ``BaseException`` that is no ``Exception`` (the caller's task cancelled, Ctrl-C) is the
    caller's CANCEL; anything else (bad arguments, raised before anything was sent) ends
    nothing: None."""
    for kind, event in _ERROR_OUTCOMES:
        if isinstance(error, kind):
            return event
    if not isinstance(error, Exception):
        return UtilityEvent.CANCEL
    return None
