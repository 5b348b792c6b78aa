"""enginewire.spec: the lifecycles as data, and the checks that read them. No I/O here."""

from __future__ import annotations

from .attach import ATTACH, AttachEvent, AttachState
from .client import CLIENT, ClientEvent, ClientState
from .engine import ENGINE, EngineEvent, EngineState
from .errors import (
    ClientClosedError,
    EngineDeadError,
    EngineStartupError,
    EngineWireError,
    ProtocolError,
    SpecViolation,
    UtilityError,
    UtilityTimeoutError,
)
from .machine import Lifecycle, Machine, TraceEntry, Transition, validate_trace
from .membership import MEMBERSHIP, SCALE, MembershipEvent, MembershipState, ScaleEvent, ScaleState
from .request import (
    CLIENT_REQUEST,
    ENGINE_REQUEST,
    ClientRequestEvent,
    ClientRequestState,
    EngineRequestEvent,
    EngineRequestState,
)
from .session import SESSION, SessionEvent, SessionState
from .transitions_export import to_transitions
from .utility import UTILITY, UtilityEvent, UtilityState

# Every machine, in a fixed order (generators iterate this, never a set).
MACHINES: tuple[Machine, ...] = (  # type: ignore[type-arg]
    CLIENT, ENGINE, ENGINE_REQUEST, CLIENT_REQUEST, UTILITY, MEMBERSHIP, SCALE, ATTACH, SESSION,
)

__all__ = [
    "ATTACH",
    "CLIENT",
    "CLIENT_REQUEST",
    "ENGINE",
    "ENGINE_REQUEST",
    "MACHINES",
    "MEMBERSHIP",
    "SCALE",
    "SESSION",
    "UTILITY",
    "AttachEvent",
    "AttachState",
    "ClientClosedError",
    "ClientEvent",
    "ClientRequestEvent",
    "ClientRequestState",
    "ClientState",
    "EngineDeadError",
    "EngineEvent",
    "EngineRequestEvent",
    "EngineRequestState",
    "EngineStartupError",
    "EngineState",
    "EngineWireError",
    "Lifecycle",
    "Machine",
    "MembershipEvent",
    "MembershipState",
    "ProtocolError",
    "ScaleEvent",
    "ScaleState",
    "SessionEvent",
    "SessionState",
    "SpecViolation",
    "TraceEntry",
    "Transition",
    "UtilityError",
    "UtilityEvent",
    "UtilityState",
    "UtilityTimeoutError",
    "to_transitions",
    "validate_trace",
]
