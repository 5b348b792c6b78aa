"""The one closed error family of enginewire.

Every error a user can see says whose fault it is (trio's ClosedResourceError /
BrokenResourceError split, h11's Local/RemoteProtocolError):

- ``ClientClosedError``: *you* shut the client down; calls after ``shutdown()`` raise it.
- ``EngineDeadError``: the engine broke (crash, kill, fatal error); ``__cause__`` says why.
- ``EngineStartupError``: the engine never became ready (failed, died or missed the deadline).
- ``UtilityError``: a remote utility method raised; carries the method and remote message.
  ``UtilityTimeoutError`` is the subclass for a call that outlived its deadline.
- ``ProtocolError``: bytes on the wire did not decode to a valid message.
- ``SpecViolation``: an event was fired that the spec's tables do not allow.

The family lives in ``spec/`` because it is the bottom layer: protocol and runtime import it,
and it does no I/O.
"""

from __future__ import annotations

__all__ = [
    "ClientClosedError",
    "EngineDeadError",
    "EngineStartupError",
    "EngineWireError",
    "ProtocolError",
    "SpecViolation",
    "UtilityError",
    "UtilityTimeoutError",
]


class EngineWireError(Exception):
    """Base of every error enginewire raises on purpose."""


class ClientClosedError(EngineWireError):
    """The client was shut down by its owner; nothing more can be sent or received."""


_DEAD_MESSAGE = "engine core is dead; see __cause__ and the engine log"


class EngineDeadError(EngineWireError):
    """The engine died or hit a fatal error; ``__cause__`` carries the reason when known."""

    def __init__(self, message: str = _DEAD_MESSAGE) -> None:
        super().__init__(message)


class EngineStartupError(EngineWireError):
    """The engine failed to start, died during start-up, or missed the ready deadline."""


class UtilityError(EngineWireError):
    """A utility call failed on the engine; ``method`` and ``remote_message`` say how."""

    def __init__(self, method: str, remote_message: str) -> None:
        super().__init__(f"call to {method!r} failed: {remote_message}")
        self.method = method
        self.remote_message = remote_message


class UtilityTimeoutError(UtilityError):
    """A utility call got no reply within its timeout; a late reply is dropped."""

    def __init__(self, method: str, timeout: float) -> None:
        super().__init__(method, f"no reply within {timeout:g} s")
        self.timeout = timeout


class ProtocolError(EngineWireError):
    """A frame or message did not decode to what the protocol expects."""


class SpecViolation(EngineWireError):
    """An event the spec forbids in the current state; the state is left unchanged."""

    def __init__(self, machine: str, state: str, event: str, guard: str | None = None) -> None:
        where = f" (guard {guard!r})" if guard is not None else ""
        super().__init__(
            f"{machine}: event {event} is not allowed in state {state}{where}; state unchanged"
        )
        self.machine = machine
        self.state = state
        self.event = event
        self.guard = guard
