"""Request lifecycles: one on the engine (scheduling) and one on the client (delivery).

Theory of operation
-------------------
Rule 1: every request state and transition lives in these two tables.
Rule 2: a request id names one machine instance at a time. A finished instance is forgotten
(``forgets``: the finished states have no transition): both sides drop it, and the id is
UNKNOWN again, so reusing it starts a new instance while reusing a live one is a
SpecViolation, and an abort of a finished id is the no-op abort of an unknown one.

Engine side. ADD puts a valid request in WAITING (an invalid one is REJECTED straight into
FINISHED_ERROR with a message). The scheduler moves it to RUNNING, may PREEMPT it back when KV
blocks run out (recompute), and finishes it by STOP (EOS or a stop token), LENGTH (max_tokens
or max_model_len), ABORT (client abort, pause/sleep in abort mode, shutdown) or ERROR. Abort of
an unknown (or finished, so forgotten) id is a no-op: UNKNOWN loops on ABORT.

Client side. A sent request is SENT until its first output arrives (STREAMING). An abort moves
it to ABORTING; outputs may still arrive (they were in flight) until the engine's finishing
output, which for an abort is an ABORT output: enginewire always answers an abort of a live
request, so a front end can always free its state. Any output after a finishing one is a
violation ("no output after an acknowledged abort"). If the engine dies, every live request
ends in FINISHED_ERROR; a death changes nothing for an id that is not live.
"""

from __future__ import annotations

from enum import Enum

from .machine import Machine, Transition

__all__ = [
    "CLIENT_REQUEST",
    "CLIENT_REQUEST_LIVE",
    "ENGINE_REQUEST",
    "ENGINE_REQUEST_LIVE",
    "ENGINE_REQUEST_QUEUED",
    "ClientRequestEvent",
    "ClientRequestState",
    "EngineRequestEvent",
    "EngineRequestState",
]


class EngineRequestState(Enum):
    UNKNOWN = "unknown"
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"


class EngineRequestEvent(Enum):
    ADD = "add"
    REJECT = "reject"
    SCHEDULE = "schedule"
    PREEMPT = "preempt"
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


S, E = EngineRequestState, EngineRequestEvent
_E_LIVE = (S.WAITING, S.RUNNING, S.PREEMPTED)
ENGINE_REQUEST_LIVE: frozenset[EngineRequestState] = frozenset(_E_LIVE)
"""Admitted and not finished: it holds a place in a scheduler queue."""
ENGINE_REQUEST_QUEUED: frozenset[EngineRequestState] = frozenset({S.WAITING, S.PREEMPTED})
"""Waiting to be scheduled (again)."""
_E_FINISHED = (S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.FINISHED_ABORTED, S.FINISHED_ERROR)

ENGINE_REQUEST: Machine[EngineRequestState, EngineRequestEvent] = Machine(
    name="engine_request",
    states=EngineRequestState,
    events=EngineRequestEvent,
    initial=S.UNKNOWN,
    forgets=frozenset(_E_FINISHED),
    doc=__doc__ or "",
    transitions=(
        Transition(S.UNKNOWN, E.ADD, S.WAITING),
        Transition(S.UNKNOWN, E.REJECT, S.FINISHED_ERROR, note="invalid request"),
        Transition(S.WAITING, E.SCHEDULE, S.RUNNING),
        Transition(S.PREEMPTED, E.SCHEDULE, S.RUNNING),
        Transition(S.RUNNING, E.PREEMPT, S.PREEMPTED, note="KV blocks exhausted: recompute"),
        Transition(S.RUNNING, E.STOP, S.FINISHED_STOPPED),
        Transition(S.RUNNING, E.LENGTH, S.FINISHED_LENGTH),
        *(Transition(s, E.ABORT, S.FINISHED_ABORTED) for s in _E_LIVE),
        *(Transition(s, E.ERROR, S.FINISHED_ERROR) for s in _E_LIVE),
        # Abort of an unknown (or finished, so forgotten) id is a no-op.
        Transition(S.UNKNOWN, E.ABORT, S.UNKNOWN, note="no-op"),
    ),
)


class ClientRequestState(Enum):
    UNKNOWN = "unknown"
    SENT = "sent"
    STREAMING = "streaming"
    ABORTING = "aborting"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"


class ClientRequestEvent(Enum):
    SEND = "send"
    OUTPUT = "output"
    ABORT_SENT = "abort_sent"
    FINISH_STOP = "finish_stop"
    FINISH_LENGTH = "finish_length"
    FINISH_ABORT = "finish_abort"
    FINISH_ERROR = "finish_error"
    ENGINE_DIED = "engine_died"


CS, CE = ClientRequestState, ClientRequestEvent
_C_LIVE = (CS.SENT, CS.STREAMING, CS.ABORTING)
CLIENT_REQUEST_LIVE: frozenset[ClientRequestState] = frozenset(_C_LIVE)
"""Sent and not finished: the client tracks it, and an abort must still end it."""
_C_FINISHED = (CS.FINISHED_STOPPED, CS.FINISHED_LENGTH, CS.FINISHED_ABORTED, CS.FINISHED_ERROR)

CLIENT_REQUEST: Machine[ClientRequestState, ClientRequestEvent] = Machine(
    name="client_request",
    states=ClientRequestState,
    events=ClientRequestEvent,
    initial=CS.UNKNOWN,
    forgets=frozenset(_C_FINISHED),
    doc=__doc__ or "",
    transitions=(
        Transition(CS.UNKNOWN, CE.SEND, CS.SENT),
        Transition(CS.SENT, CE.OUTPUT, CS.STREAMING),
        Transition(CS.STREAMING, CE.OUTPUT, CS.STREAMING),
        Transition(CS.ABORTING, CE.OUTPUT, CS.ABORTING, note="tokens already in flight"),
        Transition(CS.SENT, CE.ABORT_SENT, CS.ABORTING),
        Transition(CS.STREAMING, CE.ABORT_SENT, CS.ABORTING),
        Transition(CS.ABORTING, CE.ABORT_SENT, CS.ABORTING),
        # An abort of an unknown (or finished, so forgotten) id is a no-op on both sides.
        Transition(CS.UNKNOWN, CE.ABORT_SENT, CS.UNKNOWN, note="no-op"),
        *(Transition(s, CE.FINISH_STOP, CS.FINISHED_STOPPED) for s in _C_LIVE),
        *(Transition(s, CE.FINISH_LENGTH, CS.FINISHED_LENGTH) for s in _C_LIVE),
        *(Transition(s, CE.FINISH_ABORT, CS.FINISHED_ABORTED) for s in _C_LIVE),
        *(Transition(s, CE.FINISH_ERROR, CS.FINISHED_ERROR) for s in _C_LIVE),
        *(Transition(s, CE.ENGINE_DIED, CS.FINISHED_ERROR) for s in _C_LIVE),
    ),
)
