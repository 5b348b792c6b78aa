"""What EngineCoreProc's three threads share (runtime/engine_proc.py): the input queue's
control items, the idle bound every wait is sliced by, and the state the input and output
halves (``InputSide``, ``OutputSide``) read on the one ``EngineCoreProc`` that owns them.

Separate so that the halves, the lifeline and the busy loop each import it without importing
one another: it names the state, ``EngineCoreProc.__init__`` sets it.
"""

from __future__ import annotations

import enum
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from ..protocol.codec import Encoder, Limits
from ..protocol.messages import EngineCoreRequest, UtilityOutput, UtilityRequest
from ..spec.machine import Lifecycle
from ..spec.session import SessionEvent, SessionState
from .faults import FaultInjector, FaultPoint
from .integrity import LinkIntegrity
from .security import TransportGuard
from .zmq_io import BufferPool

if TYPE_CHECKING:
    from ._engine_link import Link

# Longest an idle busy loop waits before it looks at pending signals (see _wait_input).
# The input thread's idle poll and the output socket's blocking send are sliced by it too;
# each module reads its own binding of it, so a test patches it in the reader's module.
IDLE_WAKE_S = 0.5


class Control(enum.Enum):
    # Items of the input queue that do not come from the wire.
    SHUTDOWN = "shutdown"
    OUTPUTS = "outputs"  # an output built by the input thread (a rejection)
    REJECT_ADD = "reject_add"  # (request id, error): a malformed ADD, answered in order
    WAKE = "wake"  # the input thread served a call that left the loop work to do
    END_SESSION = "end_session"  # the front end's link failed the integrity check
    FATAL = "fatal"  # an error the input thread met running the engine: the loop raises it


class EngineProcState:
    """The attributes and methods the input and output halves use across the class (set and
    defined by ``EngineCoreProc``; runtime/engine_proc.py documents each where it is set)."""

    engine_index: int
    identity: bytes
    input_queue: queue.SimpleQueue[tuple[Any, Any]]
    output_queue: queue.SimpleQueue[Any]
    heartbeat_interval_s: float | None
    limits: Limits
    engine: Any
    faults: FaultInjector | None
    _ctx: zmq.Context[Any]
    _guard: TransportGuard
    _integrity: LinkIntegrity | None
    _stop_by: float | None
    _replies: list[UtilityOutput]
    _input_ready: threading.Event
    _peer_seen: threading.Event
    _input_error: BaseException | None
    session_phase: Lifecycle[SessionState, SessionEvent]
    _refused: bool
    _overlap: bool
    _engine_lock: threading.Lock
    # the output path
    _out_lock: threading.Lock
    _out: tuple[zmq.Socket[Any], str, Link] | None
    _out_send: Callable[..., Any]
    _out_pending: int
    _out_encoder: Encoder
    _out_pool: BufferPool
    _last_send: float
    # the idle round-trip path
    _decode_call: Callable[..., Any]
    _max_call_frame: int
    _max_parts: int
    _reply_encoder: msgspec.msgpack.Encoder
    _fast_calls: bool
    _vocab_size: int | None

    if TYPE_CHECKING:
        # The busy loop's (EngineCoreProc) and the output half's, called by the input half.
        def _fault(self, point: FaultPoint) -> None: ...
        def _has_work(self) -> bool: ...
        def _flush_replies(self) -> bool: ...
        def _call_utility(self, call: UtilityRequest) -> None: ...
        def _add(self, request: EngineCoreRequest) -> None: ...
        def _reply_to(self, call: UtilityRequest, result: Any) -> UtilityOutput | None: ...
        def _emit_utility(self, out: UtilityOutput) -> None: ...
        def _send_encoded(self, payload: bytes) -> None: ...
