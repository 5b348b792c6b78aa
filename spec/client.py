"""Client lifecycle: what an EngineCoreClient may do, as seen by its owner.

Theory of operation
-------------------
Rule 1: every client state and transition lives in this table; runtime code fires events
and reads ``state``, it never assigns a state.
Rule 2: this machine knows nothing about transports; in-process and multi-process clients
fire the same events.

A client is CONSTRUCTING until the engine's ready handshake arrives (READY), or until
construction fails, in which case every resource is reclaimed and it ends in SHUTDOWN. The
first request moves it to RUNNING. A sleep (or pause) acknowledged by the engine moves it to
SLEEPING; a wake-up that leaves every memory tag resident returns it to RUNNING, a partial one
keeps it SLEEPING. From any live state the engine may die (DEAD) or the owner may shut the
client down (SHUTDOWN). DEAD and SHUTDOWN are sticky: repeated death notices (sentinel and
process monitor both fire) loop in place, and a death notice after shutdown is ignored rather
than reported, so an intentional shutdown never yields a spurious EngineDeadError.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .machine import Machine, Transition

__all__ = [
    "CLIENT",
    "CLIENT_ASLEEP",
    "CLIENT_LIVE",
    "FULLY_AWAKE",
    "PARTIALLY_AWAKE",
    "RESUMED",
    "SLEPT",
    "WOKE",
    "ClientEvent",
    "ClientState",
    "PowerReply",
]


class ClientState(Enum):
    CONSTRUCTING = "constructing"
    READY = "ready"
    RUNNING = "running"
    SLEEPING = "sleeping"
    DEAD = "dead"
    SHUTDOWN = "shutdown"


class ClientEvent(Enum):
    HANDSHAKE_OK = "handshake_ok"
    CONSTRUCTION_FAILED = "construction_failed"
    ADD_REQUEST = "add_request"
    SLEEP_ACKED = "sleep_acked"
    WAKE_ACKED = "wake_acked"
    ENGINE_DIED = "engine_died"
    SHUTDOWN = "shutdown"


S, E = ClientState, ClientEvent
# Guards on WAKE_ACKED: whether every memory tag is resident again.
FULLY_AWAKE, PARTIALLY_AWAKE = "fully_awake", "partially_awake"
_LIVE = (S.READY, S.RUNNING, S.SLEEPING)
CLIENT_LIVE: frozenset[ClientState] = frozenset(_LIVE)
"""Constructed and neither dead nor shut down: calls are served."""
CLIENT_ASLEEP: frozenset[ClientState] = frozenset({S.SLEEPING})
"""The engine is asleep or paused, as far as the client knows. A data-parallel client is in it
while any of its serving engines' clients is (runtime/dp_client.py): until woken, it cannot
serve every request it takes."""

CLIENT: Machine[ClientState, ClientEvent] = Machine(
    name="client",
    states=ClientState,
    events=ClientEvent,
    initial=S.CONSTRUCTING,
    terminal=frozenset({S.DEAD, S.SHUTDOWN}),
    doc=__doc__ or "",
    transitions=(
        Transition(S.CONSTRUCTING, E.HANDSHAKE_OK, S.READY),
        Transition(S.CONSTRUCTING, E.CONSTRUCTION_FAILED, S.SHUTDOWN, note="resources reclaimed"),
        Transition(S.READY, E.ADD_REQUEST, S.RUNNING),
        Transition(S.RUNNING, E.ADD_REQUEST, S.RUNNING),
        # Adds while asleep are queued by the engine and run after wake-up.
        Transition(S.SLEEPING, E.ADD_REQUEST, S.SLEEPING),
        Transition(S.READY, E.SLEEP_ACKED, S.SLEEPING),
        Transition(S.RUNNING, E.SLEEP_ACKED, S.SLEEPING),
        Transition(S.SLEEPING, E.SLEEP_ACKED, S.SLEEPING, note="deeper level or repeated sleep"),
        Transition(S.SLEEPING, E.WAKE_ACKED, S.RUNNING, guard=FULLY_AWAKE),
        Transition(S.SLEEPING, E.WAKE_ACKED, S.SLEEPING, guard=PARTIALLY_AWAKE),
        # Waking an engine that is not asleep is a no-op on the engine; the client stays put.
        Transition(S.READY, E.WAKE_ACKED, S.READY, guard=FULLY_AWAKE),
        Transition(S.RUNNING, E.WAKE_ACKED, S.RUNNING, guard=FULLY_AWAKE),
        *(Transition(s, E.ENGINE_DIED, S.DEAD) for s in (S.CONSTRUCTING, *_LIVE)),
        Transition(S.DEAD, E.ENGINE_DIED, S.DEAD, note="second notice (monitor and sentinel)"),
        Transition(S.SHUTDOWN, E.ENGINE_DIED, S.SHUTDOWN, note="exit after shutdown is expected"),
        *(Transition(s, E.SHUTDOWN, S.SHUTDOWN) for s in (*_LIVE, S.DEAD)),
        Transition(S.SHUTDOWN, E.SHUTDOWN, S.SHUTDOWN, note="shutdown is idempotent"),
    ),
)


@dataclass(frozen=True)
class PowerReply:
    """How a successful reply to a power utility (sleep, pause, wake-up, resume) moves the
    client: it fires ``event`` with ``guard``, or, with ``guard_from_result``, with the guard
    the reply's truth names (a wake-up answers whether every memory tag is resident). A
    utility's declaration names one of these (protocol/utilities.py); no code maps method
    names to events."""

    event: ClientEvent
    guard: str | None = None
    guard_from_result: bool = False

    def resolve(self, result: object) -> tuple[ClientEvent, str | None]:
        if self.guard_from_result:
            return self.event, FULLY_AWAKE if result else PARTIALLY_AWAKE
        return self.event, self.guard


SLEPT = PowerReply(E.SLEEP_ACKED)
"""A sleep or pause was acknowledged: the engine is paused or asleep."""
WOKE = PowerReply(E.WAKE_ACKED, guard_from_result=True)
"""A wake-up: fully awake only if the engine says every tag is resident."""
RESUMED = PowerReply(E.WAKE_ACKED, FULLY_AWAKE)
"""A resume: only a paused (level-0) engine accepts it, so it is then fully awake."""

for _reply in (SLEPT, WOKE, RESUMED):
    if not any(t.event is _reply.event for t in CLIENT.transitions):
        raise ValueError(f"client: power reply {_reply} fires an event with no row")
