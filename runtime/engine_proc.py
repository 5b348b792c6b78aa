"""EngineCoreProc: the engine core in its own process, behind two sockets.

Theory of operation
-------------------
Three threads share the work so that (de)serialization overlaps compute (vLLM's layout):

* the **input thread** owns a DEALER connected to the client's ROUTER. It speaks first (the
  ``ReadyResponse`` handshake: a ROUTER cannot address a peer it has not heard from), and
  again whenever a connection completes its handshake (maybe a new front end: the monitor
  thread wakes the thread's poll through a pipe). It decodes every frame and puts
  ``(kind, payload)`` on the one input queue. Nothing it receives can kill it: a frame that
  does not decode is a logged rejection, or an ERROR output (or a failed utility reply) when
  the request id or call id can be recovered; one that fails the integrity check ends its
  front end's session (the engine serves the next one).
* the **busy loop** on the main thread drains the input queue, blocks on it when the engine
  has nothing to do (no spinning; the wait is sliced at ``IDLE_WAKE_S`` so signals are seen),
  and otherwise calls ``EngineCore.step()``. Aborts share the
  queue with adds, so an abort is never applied before its ADD; the queue is drained before
  every step, so an abort lands at the next step boundary.
* the **output thread** owns a PUSH connected to the client's PULL; it encodes into reused
  buffers, which are only handed back once zmq reports the payload frame sent.

A fatal error in the loop queues the engine-dead sentinel, waits (bounded) for the output
thread to flush it, and the process exits non-zero. SIGTERM/SIGINT shut down cleanly, also
while the engine is still being built. The process exits by itself within 5 s of its parent's
death: ``PR_SET_PDEATHSIG`` where Linux offers it, and a watchdog on the parent's
multiprocessing sentinel (or pid) everywhere.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import enum
import functools
import gc
import itertools
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

import msgspec
import zmq

from ..protocol.codec import (
    _PLAIN_RESULTS,
    DEFAULT_LIMITS,
    ZMQ_NOBLOCK,
    ZMQ_RCVMORE,
    BufferPool,
    Decoder,
    Encoder,
    Limits,
    backend_send,
    decode_input,
    peek_call_id,
    peek_request_id,
    recv_rest,
    send_frames,
    split_input,
    utility_output,
)
from ..protocol.messages import (
    ENGINE_DEAD_SENTINEL,
    PROTOCOL_VERSION,
    AttachRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    ReadyResponse,
    RequestType,
    UtilityOutput,
    UtilityRequest,
)
from ..protocol.utilities import LOOP_THREAD_METHODS
from ..spec.engine import EngineEvent, EngineState
from ..spec.errors import EngineStartupError, ProtocolError
from ..spec.machine import TraceEntry
from . import _mutants
from .faults import ARM_FAULT_UTILITY, FaultInjector, FaultPoint, as_plan
from .integrity import LinkIntegrity
from .security import CurveConfig, TransportGuard, check_transport

__all__ = ["EngineCoreProc", "EngineShutdownRequested", "run_engine_core"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

# Seconds the whole process may take to go once its parent is gone (brief: within 5 s).
PARENT_DEATH_EXIT_S = 3.0
# Bound on waiting for the output thread to flush the dead sentinel or the last outputs.
OUTPUT_FLUSH_S = 4.0
# Longest an idle busy loop waits before it looks at pending signals (see _wait_input).
IDLE_WAKE_S = 0.5
# Bound on the input thread connecting and sending the ready handshake.
HANDSHAKE_SEND_S = 30.0
# How long the input thread blocks in a plain receive before it also watches for a new front
# end (a poll over its DEALER and a wake pipe): a front end's next message comes well within
# this, so the per-message path stays one blocking ``recv()``. It bounds how late the ready
# goes out after a handshake that completes while messages are still coming in.
BUSY_RECV_S = 0.01
# A dropped link is mended by hand only when libzmq has not said within this long that it
# reconnects by itself (it says so at once: a retry event right after the drop).
DROP_GRACE_S = 0.25
# libzmq's reconnect interval for the engine's two connecting sockets, first and longest (ms):
# its default, 100 ms plus up to 100 ms of jitter, was most of a handover once the ready went
# out at the handshake. Retries back off to the longest, as often as the default's.
RECONNECT_IVL_MS = 10
RECONNECT_IVL_MAX_MS = 100
# Batches up to this size are sent by the thread that built them when nothing is queued
# ahead (no hand-off); larger ones are encoded by the output thread while the next step runs,
# if the step leaves it time: a model whose forward never releases the GIL (the null model
# without a delay) has the busy loop send every batch itself, as the output thread could
# only take the GIL from it (measured: 0.47 -> 0.70 of the floor's tokens/s at K=1024).
DIRECT_SEND_MAX_OUTPUTS = 64


class EngineShutdownRequested(SystemExit):
    """A signal asked the engine to stop before its busy loop ran; exits with status 0."""

    def __init__(self) -> None:
        super().__init__(0)


class _Control(enum.Enum):
    # Items of the input queue that do not come from the wire.
    SHUTDOWN = "shutdown"
    OUTPUTS = "outputs"  # an output built by the input thread (a rejection)
    REJECT_ADD = "reject_add"  # (request id, error): a malformed ADD, answered in order
    WAKE = "wake"  # the input thread served a call that left the loop work to do
    END_SESSION = "end_session"  # the front end's link failed the integrity check


_STOP = object()  # output-queue item: flush and exit


_UTILITY_BYTE = RequestType.UTILITY.value
_ATTACH_BYTE = RequestType.ATTACH.value


class _SessionEnded(EngineCoreOutputs, frozen=True):
    """The notice that ends a session whose input failed the integrity check: on the wire
    an ``EngineCoreOutputs`` with ``refusal`` (and the session, if any) like a refused
    attach marker, since the front end reads ``refusal`` after its marker as "ended" and
    before it as "refused". Its own type only tells the sender to seal it as usual (the
    front end opens everything after its marker, and the output direction is intact: the
    notice is checked like any output), where a refusal marker goes out unsealed. No
    fields of its own, so it encodes exactly as its base."""


def _is_marker(item: Any) -> bool:
    """The attach marker, or a session's end: a session's control message, which fault
    points on the output path leave alone (runtime/integrity.py)."""
    return isinstance(item, EngineCoreOutputs) and item.session is not None


def _seal_mode(item: Any) -> bool | None:
    """None: send unsealed (a refusal marker: its front end may not seal); True: seal as
    the first message of a session (the marker); False: seal as usual (a ``_SessionEnded``
    too: not of this exact type)."""
    if type(item) is not EngineCoreOutputs or item.session is None:
        return False
    return None if item.refusal is not None else True


class _Encoded:
    """Output-queue item: a message already encoded (and fault-checked) by a direct sender."""

    __slots__ = ("frames",)

    def __init__(self, frames: list[Any]) -> None:
        self.frames = frames


class _Wakeup:
    """A self-pipe another thread can wake a ``zmq.Poller`` with; any thread may ``set()``,
    even after ``close()`` (then it does nothing: the fd number may belong to a new file)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._closed = False

    def fileno(self) -> int:
        return self._r

    def set(self) -> None:
        with self._lock:
            if not self._closed:
                with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending
                    os.write(self._w, b"\0")

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._r, 4096):
                pass

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._r)
                os.close(self._w)


_SHUTDOWN_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP")
                          if hasattr(signal, name))


class _ShutdownSignals:
    """SIGTERM/SIGINT/SIGHUP handling that is safe both during construction and in the loop.

    Before the loop is armed a signal raises ``EngineShutdownRequested`` in the main thread, so
    a long construction is interrupted at once. Once armed, the handler only sets an event: a
    helper thread puts the shutdown item on the input queue (a handler must not take the
    queue's lock, which the interrupted main thread may hold).
    """

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._armed: queue.Queue[Any] | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        # SIGHUP too: a hang-up (the operator's terminal or ssh session closing) otherwise
        # kills the engine without the last outputs or the word to its front end.
        for sig in _SHUTDOWN_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, prev)
        self._previous.clear()

    def arm(self, input_queue: queue.Queue[Any]) -> None:
        self._armed = input_queue
        threading.Thread(target=self._waker, name="EngineSignalWaker", daemon=True).start()
        if self.requested.is_set():
            raise EngineShutdownRequested()

    def _waker(self) -> None:
        self.requested.wait()
        if self._armed is not None:
            self._armed.put((_Control.SHUTDOWN, None))

    def _handle(self, signum: int, _frame: object) -> None:
        first = not self.requested.is_set()
        self.requested.set()
        if first:
            logger.info("engine core received %s; shutting down", signal.Signals(signum).name)
        if self._armed is None:
            raise EngineShutdownRequested()


def _watch_parent(parent_pid: int, lifeline: int | None = None) -> None:
    """Exit within a bound once ``parent_pid`` is gone, even if it was SIGKILLed.
    ``lifeline``: an fd whose write end only the parent holds (EOF: it is gone)."""
    if _mutants.active("engine_ignores_parent_death"):
        return
    if sys.platform.startswith("linux"):
        # Delivered when the parent *thread* that spawned us exits, which may happen while the
        # parent process lives on: the handler checks the real parent before acting.
        def on_pdeathsig(_signum: int, _frame: object) -> None:
            if os.getppid() != parent_pid:
                _parent_gone("PR_SET_PDEATHSIG")

        with contextlib.suppress(Exception):
            signal.signal(signal.SIGUSR1, on_pdeathsig)
            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, int(signal.SIGUSR1), 0, 0, 0)

    def watchdog() -> None:
        parent = multiprocessing.parent_process()
        sentinel = lifeline if lifeline is not None else (
            getattr(parent, "sentinel", None) if parent is not None else None)
        while True:
            if sentinel is not None:
                # The spawn parent holds the write end of this pipe: EOF means it is gone.
                if multiprocessing.connection.wait([sentinel], timeout=0.5):
                    break
            elif not _pid_alive(parent_pid):
                break
            else:
                time.sleep(0.5)
            if os.getppid() != parent_pid:
                break
        _parent_gone("watchdog")

    threading.Thread(target=watchdog, name="EngineParentWatchdog", daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        _parent_gone("startup check")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_parent_gone_once = threading.Lock()


def _parent_gone(how: str) -> None:
    if not _parent_gone_once.acquire(blocking=False):
        return
    logger.warning("engine core: parent process is gone (%s); exiting", how)

    def hard_exit() -> None:
        time.sleep(PARENT_DEATH_EXIT_S)
        os._exit(1)

    threading.Thread(target=hard_exit, name="EngineHardExit", daemon=True).start()
    # Route through the SIGTERM handler so a clean shutdown is tried first.
    os.kill(os.getpid(), signal.SIGTERM)


class _Link:
    """Whether a connecting socket's link needs mending by hand (the monitor thread reports,
    the socket's owner asks).

    After a peer left libzmq reconnects by itself (a retry event, later a handshake); after
    a protocol error (a refused handshake, a frame over MAXMSGSIZE) it gives up, and the
    owner must connect again. Not while libzmq retries: its ``disconnect`` leaves the
    pending retry alive (libzmq 4.3.5), so the next peer gets two connections, over which
    messages are split and reordered (a front end with frame integrity saw them as lost).
    """

    __slots__ = ("_dropped_at",)

    def __init__(self) -> None:
        self._dropped_at: float | None = None

    def drop(self) -> None:
        if self._dropped_at is None:
            self._dropped_at = time.monotonic()

    def mend(self) -> None:
        self._dropped_at = None

    def due_in(self) -> float | None:
        """Seconds until ``take_due`` turns true; None while the link is not down."""
        at = self._dropped_at
        return None if at is None else max(0.0, at + DROP_GRACE_S - time.monotonic())

    def take_due(self) -> bool:
        """True (once) when the link dropped DROP_GRACE_S ago and libzmq is not on it."""
        at = self._dropped_at
        if at is None or time.monotonic() - at < DROP_GRACE_S:
            return False
        self._dropped_at = None
        return True


def _reconnect(sock: zmq.Socket[Any], address: str) -> None:
    with contextlib.suppress(zmq.ZMQError):  # already gone: nothing to undo
        sock.disconnect(address)
    sock.connect(address)


class _SendAbandoned(Exception):
    """A send still blocked past the engine's stop deadline: its peer is gone or stalled."""


def _send_reconnecting(
    sock: zmq.Socket[Any], address: str, link: _Link, send: Callable[[], T],
    give_up: Callable[[], bool] | None = None,
) -> T:
    """``send()`` under the socket's SNDTIMEO, connecting again whenever the link dropped
    for good (a peer with no pipe would otherwise block the send for good). ``give_up``
    (asked at each SNDTIMEO) ends the retries with ``_SendAbandoned``: a stopping engine
    must not wait on a peer that no longer reads."""
    while True:
        if link.take_due():
            _reconnect(sock, address)
        try:
            return send()
        except zmq.Again:
            if give_up is not None and give_up():
                raise _SendAbandoned from None
            continue


class EngineCoreProc:
    """The engine core plus its IO threads; ``run_busy_loop()`` runs on the calling thread."""

    def __init__(
        self,
        config: Any,
        *,
        input_address: str,
        output_address: str,
        engine_index: int = 0,
        heartbeat_interval_s: float | None = None,
        startup_delay_s: float = 0.0,
        trace: list[TraceEntry] | None = None,
        signals: _ShutdownSignals | None = None,
        fault: Any = None,
        curve: CurveConfig | None = None,
        allow_insecure_tcp: bool = False,
        limits: Limits = DEFAULT_LIMITS,
        integrity: bool = False,
    ) -> None:
        from .config import EngineConfig
        from .engine import EngineCore  # deferred: keeps this module importable without torch

        # Typed refusals before anything is built: they surfaced as bare AttributeErrors from
        # deep in the start-up (run_engine_core is public; `enginewire engine` checks its own).
        if not isinstance(config, EngineConfig):
            raise TypeError(f"expected an EngineConfig, got {type(config).__name__} "
                            f"{config!r:.80}")
        if not isinstance(limits, Limits):
            raise TypeError(f"limits must be a Limits, got {type(limits).__name__}")
        if curve is not None and not isinstance(curve, CurveConfig):
            raise TypeError(f"curve must be a CurveConfig or None, got {type(curve).__name__}")
        if heartbeat_interval_s is not None and not (
                isinstance(heartbeat_interval_s, (int, float))
                and math.isfinite(heartbeat_interval_s) and heartbeat_interval_s > 0):
            # 0 or nan would make the output thread send beats in a busy loop.
            raise ValueError(f"heartbeat_interval_s={heartbeat_interval_s!r}: must be a finite"
                             " number of seconds > 0, or None")
        if not isinstance(engine_index, int) or not 0 <= engine_index < 1 << 16:
            raise ValueError(f"engine_index={engine_index!r}: must be an integer in [0, 65535]")
        self.engine_index = engine_index
        self.identity = engine_index.to_bytes(2, "little")
        self.input_queue: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.heartbeat_interval_s = heartbeat_interval_s
        self._signals = signals
        check_transport((input_address, output_address), curve, allow_insecure_tcp)
        # Bounds on input, applied by the codec and (frame size) by libzmq before allocating.
        self.limits = limits
        self._ctx = zmq.Context()
        self._guard = TransportGuard(self._ctx, curve, side="engine")
        self._threads: list[threading.Thread] = []
        self._deferred: set[concurrent.futures.Future[Any]] = set()
        self._loop_thread: int | None = None  # the busy loop's thread, once it runs
        # Set by close(): past it a send that still blocks is abandoned (its peer is gone).
        self._stop_by: float | None = None
        self._replies: list[UtilityOutput] = []
        self._input_ready = threading.Event()
        # A front end's connection completed its handshake at least once. Not _input_ready
        # (set once the ready is queued): only a connected peer can take the last outputs, so
        # only then is the exit worth a flush linger (a standalone engine nobody reached,
        # beating into its queue, took 2 s to exit).
        self._peer_seen = threading.Event()
        self._input_error: BaseException | None = None
        # The attached front end's session (protocol/messages.py, "Attaching"); busy loop only.
        self._session: bytes | None = None
        # A front end was refused at its ATTACH, or its session ended on an integrity
        # failure: its messages are dropped until another ATTACH is accepted (input thread
        # only).
        self._refused = False
        self.engine: Any = None
        self._overlap = True  # the output thread can encode while a step runs
        # Fault points (runtime/faults.py); None: no plan, every point is a no-op.
        self.faults: FaultInjector | None = None
        # Optional seq/ack/CRC trailers on every message (runtime/integrity.py).
        self._integrity = LinkIntegrity() if integrity else None
        # The PUSH side: the output thread owns the socket; any thread may send on it while
        # holding ``_out_lock`` and only when no queued item is ahead (``_out_pending``).
        self._out_lock = threading.Lock()
        self._out: tuple[zmq.Socket[Any], str, _Link] | None = None
        self._out_send: Callable[..., Any] = backend_send(zmq.Socket)  # set per socket below
        self._out_pending = 0
        self._out_encoder = Encoder()
        self._out_pool = BufferPool(max_free=4)
        self._reuse_early = _mutants.active("output_buffer_reused_before_send")
        # The idle round-trip path (``_serve_plain``): input thread only.
        self._call_decoder = Decoder(UtilityRequest, limits)
        self._decode_call = self._call_decoder.decode_unchecked
        self._max_call_frame = 1 + limits.max_call_bytes  # the type byte, then the payload
        # Parts held per message: the payload's frames, and the integrity trailer.
        self._max_parts = limits.max_frames + 1
        self._reply_encoder = msgspec.msgpack.Encoder()
        self._fast_calls = not integrity and not self._reuse_early
        self._last_send = 0.0
        # Held by the busy loop except while it idles on the input queue: the input thread
        # may then serve a utility call itself (one thread hop less per round trip).
        self._engine_lock = threading.Lock()
        self._engine_lock.acquire()
        try:
            if startup_delay_s > 0:
                # Test hook: hold the handshake so a test can act "during start-up".
                time.sleep(startup_delay_s)
            self.engine = EngineCore(config, inproc=False, trace=trace, stream_outputs=True)
            self._overlap = bool(getattr(self.engine.executor, "forward_releases_gil", True))
            plan = as_plan(fault)
            if plan is not None:
                self._arm_faults(FaultInjector(plan, device=str(self.engine.device)))
            self._fault(FaultPoint.BEFORE_READY)
            info = self.engine.ready_info()
            ready = ReadyResponse(
                protocol_version=PROTOCOL_VERSION,
                engine_index=engine_index,
                num_gpu_blocks=int(info["num_gpu_blocks"]),
                block_size=int(info["block_size"]),
                max_model_len=int(info["max_model_len"]),
                model=str(info["model"]),
                device=str(info["device"]),
            )
            self._start("EngineCoreOutputThread", self._output_thread, output_address)
            self._start("EngineCoreInputThread", self._input_thread, input_address, ready)
            deadline = time.monotonic() + HANDSHAKE_SEND_S
            while not self._input_ready.wait(0.1):
                if self._input_error is not None or not self._threads[-1].is_alive():
                    raise EngineStartupError(
                        f"engine input thread died during start-up: {self._input_error}"
                    ) from self._input_error
                if time.monotonic() > deadline:
                    raise EngineStartupError(
                        f"no front end took the ready handshake at {input_address} within"
                        f" {HANDSHAKE_SEND_S:g} s (is one bound there, with matching keys?)")
            self.engine.lifecycle.fire(EngineEvent.HANDSHAKE_SENT)
        except BaseException:
            self.close()
            raise

    # -- threads ------------------------------------------------------------------------------

    def _start(self, name: str, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _input_thread(self, address: str, ready: ReadyResponse) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        # libzmq drops the connection on a larger frame before allocating it, and after such
        # a protocol error (or a refused handshake) it does not reconnect: the monitor
        # reports the drop and wakes this thread's poll, which connects again once the
        # drop's grace (DROP_GRACE_S) ended.
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes)
        sock.setsockopt(zmq.RCVTIMEO, int(BUSY_RECV_S * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        # Queue only on a connection whose handshake completed, and drop what is queued when
        # it goes: a ready must reach the front end on the connection it announces. Without
        # this a ready sent while the link was down waited in the pipe and arrived on the
        # next connection ahead of that one's own ready; a front end that took the extra one
        # as the next re-ready sent into a link about to drop (#27: 1 ATTACH in 8 lost).
        sock.setsockopt(zmq.IMMEDIATE, 1)
        link = _Link()
        # Every connection that completes its handshake may be a new front end, which learns
        # of this engine only from a ready (a duplicate to the same front end is ignored).
        # The monitor thread counts handshakes and wakes this thread's poll, so the ready
        # goes out at once (it used to wait for a receive timeout: 0.5 s per attach).
        connects = itertools.count(1)
        connected = [0]  # handshakes so far (counted by the monitor thread)
        readied = [0]  # the handshake count when the ready was last sent (this thread)
        wakeup = _Wakeup()

        def on_connect() -> None:
            link.mend()
            self._peer_seen.set()
            connected[0] = next(connects)
            wakeup.set()

        def on_drop() -> None:
            link.drop()
            wakeup.set()  # the poll then waits only until the link is due for mending

        def send_ready() -> None:
            """One ready per completed handshake, on that connection or not at all: if it
            dropped since (no pipe: not writable), the next handshake brings its own. The
            EVENTS read (unlike a send) processes libzmq's pending commands, the new pipe's
            attachment among them, so it cannot miss a connection that is there."""
            readied[0] = connected[0]
            if int(sock.get(zmq.EVENTS)) & zmq.POLLOUT:
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart(ready_frames, zmq.NOBLOCK, copy=False)
                    self._input_ready.set()

        try:
            self._guard.connect_as_client(sock, "input", on_drop=on_drop,
                                          on_connect=on_connect, on_retry=link.mend)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            wake_fd = wakeup.fileno()  # a poll reports an fd by its number
            poller.register(wake_fd, zmq.POLLIN)
            idle_ms = int(IDLE_WAKE_S * 1000)
            ready_frames = Encoder().encode(ready)
            sock.connect(address)
            if self._guard.curve is None:
                # A plain engine waits for its front end without a deadline; the first ready
                # goes out at the first handshake, as every later one does (a CURVE engine's
                # start-up waits for it: security.md).
                self._input_ready.set()
            recv = sock.recv
            while True:
                if connected[0] != readied[0]:
                    # A handshake while messages keep coming: announce it now, not at the
                    # next idle moment, when that connection may have gone.
                    send_ready()
                # A message's first frame (type byte + payload) is received as plain bytes:
                # 0.4 µs against 2 for a Frame and its more flag. Further parts are read only
                # when the payload refers to them or a trailer follows (``_accept``).
                try:
                    first = recv()
                except zmq.ContextTerminated:
                    return
                except zmq.Again:
                    # Idle for BUSY_RECV_S: wait for a message, a handshake (the ready goes
                    # out at once), IDLE_WAKE_S, or a dropped link's grace to end (it is then
                    # mended).
                    while True:
                        if link.take_due():
                            _reconnect(sock, address)
                        if connected[0] != readied[0]:
                            send_ready()
                        due = link.due_in()
                        wait_ms = idle_ms if due is None else min(idle_ms, int(due * 1000) + 1)
                        events = dict(poller.poll(wait_ms))
                        if wake_fd in events:
                            wakeup.clear()
                        if sock in events:
                            break
                    continue
                try:
                    if not (self._fast_calls and self._serve_plain(first)):
                        self._accept(first, sock)
                except zmq.ContextTerminated:
                    return
                except Exception:
                    if _mutants.active("input_thread_dies_on_malformed_frame"):
                        raise
                    # The input thread must outlive any frame: log and keep serving.
                    logger.exception("engine input thread: dropped a frame it could not handle")
        except zmq.ContextTerminated:
            return
        except BaseException as e:
            self._input_error = e
            logger.exception("engine input thread failed")
            # Without input the engine is useless: make it visible as a fatal error.
            self.input_queue.put((_Control.SHUTDOWN, e))
        finally:
            sock.close(linger=0)
            wakeup.close()  # the monitor may outlive the socket: its set() is then a no-op

    def _serve_plain(self, first: bytes) -> bool:
        """Serve a utility call while the loop idles, in as few steps as the protocol
        allows (the round trip's latency is mostly how much code runs cold after a wake-up);
        False when the message takes the general path (``_accept``), which decodes again
        and reports any error. A call served here is one frame: its payload decoded without
        aux frames (a part its sender added after it is read as a message of its own)."""
        if first[:1] != _UTILITY_BYTE or self._refused:
            return False
        if len(first) > self._max_call_frame:
            return False  # the general path refuses it, naming the bound
        try:
            # libzmq refused any frame over max_frame_bytes, the line above one over
            # max_call_bytes, and a utility call has no post-check.
            call = self._decode_call(memoryview(first)[1:])
        except Exception:
            return False  # e.g. it refers to aux frames that follow
        return self._serve_idle_call(call, plain=True)

    def _accept(self, first: bytes, sock: zmq.Socket[Any]) -> None:
        """Decode and dispatch one message whose first frame was received; read its further
        parts (aux frames, the integrity trailer) when it has them: parts of one message
        arrive together, so that never waits."""
        frames: list[Any] = [first]
        try:
            if (self._refused or first[:1] == _ATTACH_BYTE or self._integrity is not None
                    ) and sock.get(ZMQ_RCVMORE):
                # The whole message (an ATTACH or a refused peer's, whatever it is), or the
                # integrity trailer and the aux frames before it.
                recv_rest(sock, frames, self._max_parts)
        except ProtocolError as e:  # more parts than any message has: read, dropped
            self._reject(first, e)
            return
        if self._refused or first[:1] == _ATTACH_BYTE:
            if first[:1] == _ATTACH_BYTE:
                self._accept_attach(frames)  # unsealed: it starts the counts afresh
            return
        if self._integrity is not None:
            try:
                frames = self._integrity.open(frames)
            except ProtocolError as e:
                # This front end's link is broken (lost, reordered or corrupted input): its
                # session ends, not the engine, which serves the next front end. Nothing
                # more of it is read (its counts no longer line up) until it attaches anew;
                # the busy loop drops its work and tells it, in order behind its input.
                self._refused = True
                self.input_queue.put((_Control.END_SESSION, e))
                return
        try:
            try:
                kind, payload = decode_input(frames, self.limits)
            except ProtocolError:
                # Only now is the more flag read: a payload that refers to aux frames
                # fails alone; with them it may decode. A message without more fails as is.
                if self._integrity is not None or not sock.get(ZMQ_RCVMORE):
                    raise
                frames = recv_rest(sock, frames, self._max_parts)
                kind, payload = decode_input(frames, self.limits)
        except ProtocolError as e:
            if _mutants.active("input_thread_dies_on_malformed_frame"):
                raise
            self._reject(frames[0], e)
            return
        if self.faults is not None:
            try:
                self._fault(FaultPoint.INPUT_DECODED)
            except Exception as e:
                # An injected raise or OOM is this thread failing, not one bad frame.
                self.input_queue.put((_Control.SHUTDOWN, e))
                return
        if kind is RequestType.ABORT and _mutants.active("abort_applied_before_add"):
            with self.input_queue.mutex:  # jumps ahead of queued ADDs
                self.input_queue.queue.appendleft((kind, payload))
                self.input_queue.unfinished_tasks += 1
                self.input_queue.not_empty.notify()
            return
        if kind is RequestType.ABORT:
            # Seen by a step already running; the queued copy keeps the order behind ADDs.
            self.engine.mid_step_aborts.extend(payload)
        elif kind is RequestType.UTILITY and self._serve_idle_call(
                cast(UtilityRequest, payload)):
            return
        self.input_queue.put((kind, payload))

    def _accept_attach(self, frames: list[Any]) -> None:
        """An ATTACH: accepted, or refused when the front end's frame integrity differs from
        this engine's (its messages would fail here, or its outputs there). With integrity,
        the new session's first sealed message is ``seq`` 1: the count restarts here, before
        the next message is opened."""
        try:
            kind, payload = decode_input(frames, self.limits)
        except ProtocolError as e:
            self._reject(frames[0], e)
            return
        attach = cast(AttachRequest, payload)
        ours = self._integrity is not None
        if attach.integrity != ours:
            self._refused = True
            reason = (f"frame integrity is {'on' if attach.integrity else 'off'} at this front"
                      f" end and {'on' if ours else 'off'} at the engine; set the same on both"
                      " (client option frame_integrity, enginewire engine --integrity)")
            logger.error("refused a front end: %s", reason)
            self.input_queue.put((_Control.OUTPUTS, EngineCoreOutputs(
                engine_index=self.engine_index, session=attach.session, refusal=reason,
                timestamp=EngineCoreOutputs.now())))
            return
        self._refused = False
        if self._integrity is not None:
            self._integrity.restart_receiving()
        self.input_queue.put((kind, payload))

    def _serve_idle_call(self, call: UtilityRequest, *, plain: bool = False) -> bool:
        """Run a utility call on the input thread when the busy loop is parked idle with an
        empty queue (so nothing is reordered); False when the loop must take it. ``plain``:
        the short path (``_answer_plain``).

        The bookkeeping comes after the reply: code that runs between receiving a call and
        sending its reply is the round trip's own time (it runs cold, after a wake-up), while
        code after the send overlaps the reply's way to the client. The busy loop, if woken
        here, waits for the engine lock, so nothing it sends can overtake the reply."""
        if call.method in LOOP_THREAD_METHODS:
            return False  # e.g. the profiler: one thread for start, stop and export
        lock = self._engine_lock
        if not lock.acquire(blocking=False):
            return False
        try:
            if self.input_queue.queue:  # something is queued ahead of it: keep the order
                return False
            if plain:
                self._answer_plain(call)
            else:
                self._call_utility(call)
            if self._replies:
                self._flush_replies()
            if self._has_work() or self.engine.lifecycle.state is EngineState.DEAD:
                self.input_queue.put((_Control.WAKE, None))  # the loop has something to do
            return True
        finally:
            lock.release()

    def _answer_plain(self, call: UtilityRequest) -> None:
        """Run ``call`` and reply. A result msgpack carries as itself is encoded plainly and
        sent at once if the pipe takes it (else queued behind what is already there); any
        other outcome takes the general reply builder."""
        try:
            result = self.engine.call_utility(call.method, call.args)
        except Exception as e:
            self._emit_utility(utility_output(call.call_id, call.method, error=e))
            return
        if type(result) in _PLAIN_RESULTS:
            try:
                payload = self._reply_encoder.encode(EngineCoreOutputs(
                    self.engine_index, [], time.monotonic(), None, None,
                    UtilityOutput(call.call_id, None, result)))
            except (TypeError, OverflowError, UnicodeEncodeError, msgspec.EncodeError):
                pass  # e.g. an int beyond 64 bits: the general builder reports it
            else:
                self._send_encoded(payload)
                return
        reply = self._reply_to(call, result)
        if reply is not None:
            self._emit_utility(reply)

    def _send_encoded(self, payload: bytes) -> None:
        """Send a one-frame message now if the pipe takes it, else queue it behind what is
        already there (``_put_output``'s order, for a payload encoded by the caller)."""
        with self._out_lock:
            out = self._out
            if out is not None and self._out_pending == 0:
                try:
                    self._out_send(out[0], payload, ZMQ_NOBLOCK)
                    self._last_send = time.monotonic()
                    return
                except zmq.Again:
                    pass
                except zmq.ContextTerminated:
                    return
                except BaseException as e:
                    self._send_failed(e)
                    return
            self._out_pending += 1
            self.output_queue.put(_Encoded([payload]))

    def _reject(self, first: Any, error: ProtocolError) -> None:
        try:
            type_byte, body = split_input(first)
        except ProtocolError:
            logger.warning("rejected malformed input (an empty first frame): %s", error)
            return
        rest = [body]
        request_id = peek_request_id(rest) if type_byte == RequestType.ADD.value else None
        if type_byte == RequestType.ADD.value and request_id is not None:
            # Answered whatever its length; only the log line is shortened.
            logger.warning("rejected malformed ADD for %.80r: %.500s", request_id, error)
            # The loop answers it, in order behind the input before it: only there is it
            # known whether the id names a live request (then nothing is sent for it).
            self.input_queue.put((_Control.REJECT_ADD, (request_id, f"malformed request: {error}")))
            return
        call_id = peek_call_id(rest) if type_byte == RequestType.UTILITY.value else None
        if type_byte == RequestType.UTILITY.value and call_id is not None:
            logger.warning("rejected malformed utility call %r: %s", call_id, error)
            reply = UtilityOutput(call_id=call_id, failure_message=f"malformed call: {error}")
            self.input_queue.put((_Control.OUTPUTS, EngineCoreOutputs(utility_output=reply)))
            return
        logger.warning("rejected malformed input (type byte %r): %s", type_byte, error)

    def _output_thread(self, address: str) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, int(OUTPUT_FLUSH_S * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sock.setsockopt(zmq.SNDTIMEO, int(IDLE_WAKE_S * 1000))
        link = _Link()  # reconnect after a protocol error only (see _Link)
        peer = threading.Event()  # a front end's connection is up (the monitor says)

        def dropped() -> None:
            peer.clear()
            link.drop()

        def connected() -> None:
            peer.set()
            link.mend()

        self._guard.connect_as_client(sock, "output", on_drop=dropped,
                                      on_connect=connected, on_retry=link.mend)
        hb = self.heartbeat_interval_s
        try:
            sock.connect(address)
            with self._out_lock:
                self._out = (sock, address, link)
                self._out_send = backend_send(type(sock))
            while True:
                wait = None if hb is None else max(0.0, hb - (time.monotonic() - self._last_send))
                try:
                    item = self.output_queue.get(timeout=wait)
                except queue.Empty:
                    # Idle heartbeat: lets an attached client tell "idle" from "gone". Direct
                    # sends count as traffic, so a busy link carries no extra heartbeats.
                    # Only to a connected peer whose pipe has room: a beat queued for nobody
                    # is stale when it arrives, and a standalone engine alone for long filled
                    # its pipe with them until a send blocked for good (SIGTERM then wedged).
                    with self._out_lock:
                        if self._out_pending == 0 and (
                            hb is None or time.monotonic() - self._last_send >= hb
                        ):
                            if peer.is_set() and sock.poll(0, zmq.POLLOUT):
                                self._send_locked(EngineCoreOutputs(
                                    engine_index=self.engine_index,
                                    timestamp=EngineCoreOutputs.now()))
                            else:
                                self._last_send = time.monotonic()  # next beat: an interval on
                    continue
                if item is _STOP:
                    return
                with self._out_lock:
                    self._out_pending -= 1
                    self._send_locked(item)
                if isinstance(item, bytes):  # the engine-dead sentinel: nothing follows it
                    return
        except zmq.ContextTerminated:
            return
        except _SendAbandoned:
            logger.warning("engine stopping: its front end stopped reading; outputs still"
                           " queued for it are dropped")
            return
        except BaseException:
            logger.exception("engine output thread failed")
            # Nothing can reach the client any more; make the engine stop.
            self.input_queue.put((_Control.SHUTDOWN, RuntimeError("output thread failed")))
        finally:
            with self._out_lock:
                self._out = None
            # Linger to flush the last outputs only if a front end ever connected: with none,
            # nothing can be delivered and the linger would only delay the exit.
            sock.close(linger=None if self._peer_seen.is_set() else 0)

    def _send_locked(self, item: Any) -> None:
        """Encode and send one item on the PUSH socket; the caller holds ``_out_lock``."""
        out = self._out
        if out is None:
            return
        sock, address, link = out
        give_up = self._past_stop
        if isinstance(item, bytes):  # the engine-dead sentinel
            _send_reconnecting(sock, address, link, functools.partial(sock.send, item), give_up)
            return
        if type(item) is _Encoded:  # a direct send that found the pipe full
            _send_reconnecting(sock, address, link, functools.partial(
                send_frames, sock, item.frames), give_up)
            self._last_send = time.monotonic()
            return
        if self.faults is not None and not _is_marker(item):  # the marker is the handshake's
            self.faults(FaultPoint.OUTPUT_SEND)
        pool = self._out_pool
        buf = pool.acquire()
        frames = self._out_encoder.encode_into(item, buf)
        if self._integrity is not None and (mode := _seal_mode(item)) is not None:
            frames = [*frames, self._integrity.seal(frames, restart=mode)]
        # The payload's own tracker decides when ``buf`` may be reused.
        tracker = _send_reconnecting(sock, address, link, functools.partial(
            send_frames, sock, frames, track=True), give_up)
        if self._reuse_early:
            sock.copy_threshold, tracker = 0, None  # zero-copy, reused at once
        pool.release(buf, tracker)
        self._last_send = time.monotonic()

    def _put_output(self, item: Any, *, direct: bool) -> None:
        """Hand ``item`` to the client, in order with everything handed over before it.

        ``direct`` sends on the calling thread when nothing is queued ahead of it: a reply
        that does not wait for the output thread saves a thread wake-up per round trip. Big
        batches during a busy step go through the queue, so encoding overlaps the next step.
        """
        with self._out_lock:
            out = self._out
            if direct and self._out_pending == 0 and out is not None:
                try:
                    item = self._send_direct(out[0], item)
                except zmq.ContextTerminated:
                    return
                except BaseException as e:
                    self._send_failed(e)
                    return
                if item is None:
                    return
            self._out_pending += 1
            self.output_queue.put(item)

    def _past_stop(self) -> bool:
        stop_by = self._stop_by
        return stop_by is not None and time.monotonic() > stop_by

    def _send_failed(self, error: BaseException) -> None:
        """A direct send raised: nothing more can reach the client, so the engine stops."""
        logger.exception("engine: sending outputs failed")
        self.input_queue.put((_Control.SHUTDOWN, RuntimeError(f"output send failed: {error!r}")))

    def _send_direct(self, sock: zmq.Socket[Any], item: Any) -> _Encoded | None:
        """Send ``item`` now if the socket takes it without blocking (None), else return it
        encoded for the output thread. A direct sender must never block: a gone or slow
        client fills the pipe, and then only the output thread waits on it while the busy
        loop still sees a shutdown. Caller holds ``_out_lock``."""
        if self._reuse_early:  # the mutant reuses pooled buffers on every path
            self._send_locked(item)
            return None
        if self.faults is not None and not _is_marker(item):  # the marker is the handshake's
            self.faults(FaultPoint.OUTPUT_SEND)
        # A fresh bytes payload, no pool: the send copies it (below copy_threshold) or keeps
        # a reference to it until libzmq is done (above), and nothing else writes to it.
        frames = self._out_encoder.encode(item)
        if self._integrity is not None and (mode := _seal_mode(item)) is not None:
            frames = [*frames, self._integrity.seal(frames, restart=mode)]
        try:
            # NOBLOCK on the first frame decides for the whole message: once libzmq has
            # taken the first part of a multipart message, it takes the rest.
            send_frames(sock, frames, flags=ZMQ_NOBLOCK)
        except zmq.Again:
            return _Encoded(frames)
        self._last_send = time.monotonic()
        return None

    # -- main loop ----------------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        self.engine.lifecycle.fire(EngineEvent.LOOP_STARTED)
        if self._signals is not None:
            self._signals.arm(self.input_queue)
        self._loop_thread = threading.get_ident()
        idle_rounds = 0
        while True:
            if not self._drain_input(block=not self._has_work(), idle_rounds=idle_rounds):
                return
            if not self._has_work():
                self._flush_replies()  # a deferred reply whose future just completed
                continue
            outputs = self.engine.step()
            progressed = self._emit(outputs) | self._flush_replies()
            idle_rounds = 0 if progressed else idle_rounds + 1

    def _flush_replies(self) -> bool:
        if not self._replies:
            return False
        replies, self._replies = self._replies, []
        for out in replies:
            self._emit_utility(out)
        return True

    def _has_work(self) -> bool:
        e = self.engine
        return bool(e.has_unfinished_requests() or e.has_pending_outputs() or self._deferred)

    def _drain_input(self, *, block: bool, idle_rounds: int) -> bool:
        """Handle queued input; False once shutdown was requested."""
        try:
            if block:
                item = self._wait_input()
                if item is None:
                    return not self._stop_requested()
            elif idle_rounds > 2:
                # Work exists but steps produce nothing (e.g. parked requests): back off
                # instead of spinning, while still reacting to input at once.
                item = self.input_queue.get(timeout=min(0.05, 0.001 * idle_rounds))
            else:
                item = self.input_queue.get_nowait()
        except queue.Empty:
            return True
        while True:
            if not self._handle(*item):
                return False
            self._flush_replies()
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return True

    def _wait_input(self) -> tuple[Any, Any] | None:
        # Idle: block on the queue. The wait is sliced because CPython runs signal handlers
        # only on the main thread, and a signal the kernel hands to another thread (zmq's,
        # torch's) does not interrupt this wait: every IDLE_WAKE_S the main thread looks.
        lock = self._engine_lock
        lock.release()  # the input thread may serve calls while we wait
        try:
            return self.input_queue.get(timeout=IDLE_WAKE_S)
        except queue.Empty:
            return None
        finally:
            lock.acquire()

    def _stop_requested(self) -> bool:
        return self._signals is not None and self._signals.requested.is_set()

    def _handle(self, kind: Any, payload: Any) -> bool:
        if kind is _Control.SHUTDOWN:
            if isinstance(payload, BaseException):
                raise RuntimeError("engine IO thread failed") from payload
            return False
        if kind is _Control.WAKE:
            pass
        elif kind is _Control.END_SESSION:
            self._end_session(payload)
        elif kind is _Control.REJECT_ADD:
            self.engine.reject_request(*payload)  # its ERROR goes out with the next step
        elif kind is _Control.OUTPUTS:
            if _is_marker(payload):  # a refusal: nothing else in it, sent all the same
                self._put_output(payload, direct=True)
            else:
                self._emit(payload)
        elif kind is RequestType.ADD:
            try:
                self.engine.add_request(payload)
            except Exception as e:
                if self.engine.lifecycle.state is EngineState.DEAD:
                    raise
                # Request-scoped: this request fails, the engine serves on.
                logger.exception("engine refused request %.80r", payload.request_id)
                self._emit(EngineCoreOutputs(outputs=[EngineCoreOutput(
                    payload.request_id, [], FinishReason.ERROR, error=f"{type(e).__name__}: {e}")]))
        elif kind is RequestType.ABORT:
            self.engine.abort_requests(list(payload))
            # The input thread put these ids there too, for a step that might be running;
            # none is (this is the loop), so they are stale: an idle engine that takes
            # millions of aborts must not keep them until its next step.
            self.engine.mid_step_aborts.clear()
        elif kind is RequestType.UTILITY:
            self._call_utility(payload)
        elif kind is RequestType.ATTACH:
            self._attach(payload.session)
        else:
            logger.error("engine: unknown input kind %r dropped", kind)
        return True

    def _attach(self, session: bytes) -> None:
        """A front end attaches: a new session ends what came before it; then the marker,
        after which the front end reads everything as its own."""
        # The handshake is complete here: an ATTACH proves the front end has the ready. A
        # fault any earlier could take the ready with it, unsent (os._exit drops libzmq's
        # queue), and leave the front end's view racing the death.
        self._fault(FaultPoint.AFTER_READY)
        if session != self._session:
            dropped = self._drop_session()
            if self._session is not None or dropped:
                logger.info("a new front end attached; %d request(s) of the previous one were"
                            " dropped", dropped)
            else:
                logger.info("a front end attached")
            self._session = session
        self._put_output(EngineCoreOutputs(engine_index=self.engine_index, session=session,
                                           timestamp=EngineCoreOutputs.now()), direct=True)

    def _drop_session(self) -> int:
        """End what the current front end started; how many requests were dropped."""
        dropped = int(self.engine.start_session())
        self._replies.clear()  # replies owed to that front end (or failed above)
        return dropped

    def _end_session(self, error: ProtocolError) -> None:
        """The current front end's input failed the integrity check: drop its work and tell
        it why; the next ATTACH (any session) starts afresh. Its calls and requests then fail
        at the front end (engine dead to it); they need no outputs of their own."""
        dropped = self._drop_session()
        reason = (f"this front end's input failed the frame integrity check ({error}); the"
                  f" engine dropped its {dropped} request(s) and ignores it until it attaches"
                  " again")
        logger.error("ended a front end's session: %s", reason)
        self._put_output(_SessionEnded(engine_index=self.engine_index, session=self._session,
                                       refusal=reason, timestamp=EngineCoreOutputs.now()),
                         direct=True)
        self._session = None

    def _call_utility(self, call: UtilityRequest) -> None:
        reply = self._run_utility(call)
        if reply is not None:
            self._emit_utility(reply)

    def _run_utility(self, call: UtilityRequest) -> UtilityOutput | None:
        """Run ``call``; its reply, or None when the reply is deferred (sent on resolution)."""
        try:
            result = self.engine.call_utility(call.method, call.args)
        except Exception as e:
            return utility_output(call.call_id, call.method, error=e)
        return self._reply_to(call, result)

    def _reply_to(self, call: UtilityRequest, result: Any) -> UtilityOutput | None:
        """The reply for ``result``; None when it is a Future (sent once it resolves)."""
        if isinstance(result, concurrent.futures.Future):
            # Deferred reply (pause/sleep in "wait" mode): sent when the engine resolves it.
            self._deferred.add(result)

            def done(fut: concurrent.futures.Future[Any]) -> None:
                exc = fut.exception()
                if exc is not None:
                    out = utility_output(call.call_id, call.method, error=exc)
                else:
                    out = utility_output(call.call_id, call.method, result=fut.result())
                # Completed inside step(): held until that step's outputs are queued, so a
                # "wait" reply follows the last outputs it waited for. Queued before the
                # future leaves _deferred: the loop, seeing no work left, flushes it then.
                self._replies.append(out)
                self._deferred.discard(fut)
                if threading.get_ident() != self._loop_thread:
                    # Completed by another thread (a user's utility resolving later): an
                    # idle loop is parked on its input queue, and would send it only after
                    # the next input; wake it to send it now.
                    self.input_queue.put((_Control.WAKE, None))

            result.add_done_callback(done)
            return None
        return utility_output(call.call_id, call.method, result=result)

    def _emit_utility(self, out: UtilityOutput) -> None:
        self._put_output(
            EngineCoreOutputs(engine_index=self.engine_index, utility_output=out,
                              timestamp=EngineCoreOutputs.now()),
            direct=True,
        )

    def _emit(self, outputs: EngineCoreOutputs | None) -> bool:
        if outputs is None:
            return False
        if not (outputs.outputs or outputs.stream_ids or outputs.finished_requests
                or outputs.utility_output):
            return False
        if outputs.engine_index != self.engine_index:
            outputs = msgspec.structs.replace(outputs, engine_index=self.engine_index)
        size = len(outputs.outputs) + len(outputs.stream_ids)
        self._put_output(outputs, direct=size <= DIRECT_SEND_MAX_OUTPUTS or not self._overlap)
        return True

    # -- teardown -----------------------------------------------------------------------------

    def send_engine_dead(self) -> None:
        """Queue the sentinel and give the output thread a bounded time to flush it."""
        if self.engine is not None and self.engine.lifecycle.can(EngineEvent.FATAL_ERROR):
            self.engine.lifecycle.fire(EngineEvent.FATAL_ERROR)
        if self._stop_by is None:  # a send blocked on a gone peer must not hold the exit
            self._stop_by = time.monotonic() + OUTPUT_FLUSH_S
        self._put_output(ENGINE_DEAD_SENTINEL, direct=False)
        for t in self._threads:
            if t.name == "EngineCoreOutputThread":
                t.join(OUTPUT_FLUSH_S)
                if t.is_alive():
                    logger.critical("engine-dead sentinel could not be flushed in time")

    def close(self, *, say_gone: bool = False) -> None:
        """Shut the engine down, flush its last outputs, stop the IO threads; bounded.
        ``say_gone``: end with the engine-dead sentinel if a front end is attached."""
        # The last outputs get OUTPUT_FLUSH_S to leave, if a front end ever connected; a
        # send blocked past that is abandoned, so no stop waits on a peer that stopped reading.
        self._stop_by = time.monotonic() + (
            OUTPUT_FLUSH_S if self._peer_seen.is_set() else 0.1)
        if self.engine is not None:
            try:
                self._fault(FaultPoint.SHUTDOWN)
                self._flush_replies()  # calls that completed before the shutdown
                self.engine.shutdown()
                # Live requests end with ABORT on shutdown: let their owners know.
                while (final := self.engine.take_final_outputs()) is not None:
                    self._emit(final)
                if say_gone and self._session is not None:
                    # An attached front end has no process to watch: without this it learns
                    # of the exit only from its heartbeat deadline, or never without one.
                    self._put_output(ENGINE_DEAD_SENTINEL, direct=False)
                # Deferred calls the shutdown failed get no reply: to the front end the
                # engine went away under them, and it says so (EngineDeadError) once it sees
                # the exit; a UtilityError would blame the method. After the front end's own
                # shutdown nobody waits for them anyway.
                self._replies.clear()
            except Exception:
                logger.exception("engine shutdown raised")
        self.output_queue.put(_STOP)
        # Time to flush the last outputs, if a front end ever connected. Without one a send
        # only waits for a peer that never comes: terminating the context below ends it at
        # once.
        flush_s = OUTPUT_FLUSH_S if self._peer_seen.is_set() else 0.1
        for t in self._threads:
            if t.name == "EngineCoreOutputThread":
                t.join(flush_s)
        # Terminating the context wakes the input thread's blocking recv; it closes its
        # socket and term() returns. Bounded by a helper thread in case a socket is stuck.
        ctx = self._ctx
        t = threading.Thread(target=ctx.term, name="EngineCtxTerm", daemon=True)
        t.start()
        t.join(2.0)
        self._guard.close()  # its monitors exit on the context's termination
        for th in self._threads:
            th.join(1.0)
        self._threads.clear()


    # -- fault points (runtime/faults.py) -----------------------------------------------------

    def _arm_faults(self, injector: FaultInjector) -> None:
        self.faults = injector
        self._fast_calls = False  # every fault point lies on the general path
        self.engine.fault_hook = injector
        if injector.allow_arm:
            # Testing only: the plan asked for run-time arming, so this engine (and no other)
            # gets the utility; the class allow-list is left untouched.
            self.engine.UTILITY_METHODS = self.engine.UTILITY_METHODS | {ARM_FAULT_UTILITY}
            setattr(self.engine, ARM_FAULT_UTILITY, injector.arm)

    def _fault(self, point: FaultPoint) -> None:
        if self.faults is not None:
            self.faults(point)


def run_engine_core(
    config: Any,
    *,
    input_address: str,
    output_address: str,
    engine_index: int = 0,
    parent_pid: int | None = None,
    heartbeat_interval_s: float | None = None,
    startup_delay_s: float = 0.0,
    trace: list[TraceEntry] | None = None,
    fault: Any = None,
    curve: CurveConfig | None = None,
    allow_insecure_tcp: bool = False,
    limits: Limits = DEFAULT_LIMITS,
    integrity: bool = False,
    raise_startup_errors: bool = False,
    parent_lifeline: int | None = None,
) -> int:
    """Build the engine, handshake with the client at the given addresses, serve until told
    to stop. Returns the process exit status (0 clean, 1 fatal); with
    ``raise_startup_errors`` a failure to start is raised instead (after cleanup), so a
    command line can say it in one line. ``parent_pid`` turns on the
    parent-death watch; engines started by ``enginewire engine`` pass None. ``fault`` is a
    test hook: a ``FaultPlan``, ``Fault`` or spec string (``runtime/faults.py``). ``curve``
    makes both sockets CURVE clients of the front end (plain tcp needs
    ``allow_insecure_tcp=True``); ``limits`` bounds the input (docs/security.md).
    ``parent_lifeline``: an fd that reads EOF once the parent is gone (runtime/engine_launch.py)."""
    signals = _ShutdownSignals()
    signals.install()
    if parent_pid is not None:
        _watch_parent(parent_pid, parent_lifeline)
    proc: EngineCoreProc | None = None
    constructed = stopped = False
    try:
        proc = EngineCoreProc(
            config,
            input_address=input_address,
            output_address=output_address,
            engine_index=engine_index,
            heartbeat_interval_s=heartbeat_interval_s,
            startup_delay_s=startup_delay_s,
            trace=trace,
            signals=signals,
            fault=fault,
            curve=curve,
            allow_insecure_tcp=allow_insecure_tcp,
            limits=limits,
            integrity=integrity,
        )
        constructed = True
        logger.info("engine core up (model %s); serving the front end at %s and %s",
                    getattr(config, "model", "?"), input_address, output_address)
        # The model and its imports are built: move them out of the collector's reach so
        # full collections do not stall steps (vLLM's freeze_gc_heap).
        gc.collect()
        gc.freeze()
        proc.run_busy_loop()
        stopped = True
        return 0
    except EngineShutdownRequested:
        logger.info("engine core shut down by signal")
        return 0
    except Exception:
        if not constructed:
            if raise_startup_errors:
                raise
            logger.exception("engine core failed to start")
        else:
            logger.exception("engine core hit a fatal error")
            assert proc is not None
            proc.send_engine_dead()
        return 1
    finally:
        signals.restore()
        if proc is not None:
            # Stopped by a signal: a launched engine's client sees its process exit; one
            # started on its own tells its attached front end (a supervisor's stop, restart).
            proc.close(say_gone=stopped and parent_pid is None)


# A launched engine logs to this file instead of stderr when set (a campaign keeps its
# terminal for its summary); and a harness that injects faults of these kinds (comma-separated,
# e.g. "malformed_frame") says so, so the engine's lines about them read as expected.
ENGINE_LOG_FILE_ENV = "ENGINEWIRE_ENGINE_LOG_FILE"
INJECTED_FAULTS_ENV = "ENGINEWIRE_INJECTED_FAULTS"
# The log lines each injected fault kind causes, by the start of their message.
_INJECTED_LINES = {"malformed_frame": ("rejected malformed", "engine input thread: dropped")}


class _InjectedNote(logging.Filter):
    """Appends "(injected by the harness: KIND)" to the lines an injected fault causes."""

    def __init__(self, kinds: list[str]) -> None:
        super().__init__()
        self._prefixes = [(k, p) for k in kinds for p in _INJECTED_LINES.get(k, ())]

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            for kind, prefix in self._prefixes:
                if record.msg.startswith(prefix):
                    record.msg += f" (expected: the harness injects {kind} faults in this run)"
                    break
        return True


def _configure_logging() -> None:
    log_file = os.environ.get(ENGINE_LOG_FILE_ENV) or None
    logging.basicConfig(
        level=os.environ.get("ENGINEWIRE_ENGINE_LOG_LEVEL", "WARNING"),
        format="%(asctime)s engine[%(process)d] %(levelname)s %(message)s",
        filename=log_file,
    )
    kinds = [k for k in os.environ.get(INJECTED_FAULTS_ENV, "").split(",") if k]
    if kinds:
        note = _InjectedNote(kinds)
        for handler in logging.getLogger().handlers:
            handler.addFilter(note)


def _process_main(config_type: type, config_bytes: bytes, kwargs: dict[str, Any]) -> None:
    """A ``multiprocessing`` target for an engine (tests, a Ray actor's own child): the
    clients start theirs as a program of its own (runtime/engine_launch.py)."""
    config: Any = msgspec.msgpack.decode(config_bytes, type=config_type)
    report = kwargs.pop("startup_report", None)
    serve_launched(config, kwargs, report=None if report is None else report.send)


def serve_launched(config: Any, kwargs: dict[str, Any], *,
                   report: Callable[[str], None] | None,
                   lifeline: int | None = None) -> NoReturn:
    """Serve a launched engine until it stops, then exit the process. ``report`` takes a
    start-up failure's reason back to the launching client (which otherwise sees only an exit
    code; the traceback is in this log)."""
    _configure_logging()
    threads = os.environ.get("ENGINEWIRE_ENGINE_THREADS")
    if threads and getattr(config, "model", None) != "null":
        # CPU engines on a shared machine (CI) oversubscribe cores with torch's default; a
        # null-model engine never loads torch, so it is not imported for this either.
        import torch

        torch.set_num_threads(int(threads))
    try:
        code = run_engine_core(config, **kwargs, raise_startup_errors=report is not None,
                               parent_lifeline=lifeline)
    except Exception as e:
        # The client raises this reason; the traceback is for whoever debugs the engine.
        logger.error("engine core failed to start: %s: %s", type(e).__name__, e)
        logger.debug("engine core start-up failure", exc_info=True)
        if report is not None:
            with contextlib.suppress(Exception):
                report(f"{type(e).__name__}: {e}")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit skips interpreter teardown, which could block on a stuck daemon thread.
    os._exit(code)
