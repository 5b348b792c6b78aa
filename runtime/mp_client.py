"""Multi-process clients: the engine core in a subprocess, behind a ROUTER/PULL socket pair.

Theory of operation
-------------------
``MPClient`` (shared by ``SyncMPClient`` and ``AsyncMPClient``) binds an input ROUTER and an
output PULL on ``ipc://`` paths inside a private 0700 directory, starts the engine process
(spawn: safe with CUDA) and waits for the engine's ``ReadyResponse`` on the ROUTER. That wait
has a deadline (``ready_timeout_s``) and also watches the process sentinel, so an engine that
dies while starting fails construction at once instead of at the deadline. Then the client
attaches under a fresh session (``ATTACH``; the engine answers with a marker on the output
stream): an engine started elsewhere may have served another front end, and the reader drops
what arrives before the marker.

Everything outside Python objects (process, sockets, context, ipc directory, monitor thread)
is held by ``BackgroundResources``, attached with ``weakref.finalize`` *before* anything is
created: a failure anywhere during construction, a dropped client and ``shutdown()`` all run
the same idempotent teardown. The output socket belongs to its reader and is closed by it: in
the sync client, whichever thread is waiting reads it (``_SyncReader``; a background thread
only when nobody has read for a while), in the async client a loop callback on its FD. The
others are closed with linger 0 before the context terminates.

Engine death is seen on every path, within a second:

* the **monitor thread** waits on the process sentinel (and, for attached engines, a
  heartbeat deadline): a SIGKILLed engine sends nothing, yet its exit is seen at once. Until
  the attach marker arrives it also holds the marker's deadline, so an ATTACH that was lost
  is engine death even if the engine then says nothing;
* the **reader** treats the engine-dead sentinel frame, an undecodable frame, or the end of
  its session (the engine's ``refusal`` after the marker: this front end's input failed its
  integrity check), as death;
* on death the client fires ENGINE_DIED, fails *every* pending utility future with
  ``EngineDeadError`` (vLLM leaves them hanging) and wakes every blocked ``get_output``.

Utility calls are futures in a registry keyed by ``call_id``, registered before the frame is
sent. Each has exactly one outcome (spec ``UTILITY``); a reply that arrives after a timeout or
a cancellation finds no entry and is dropped.
"""

from __future__ import annotations

import _signal
import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import stat
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import msgspec
import zmq

from ..protocol.codec import (
    _PLAIN_RESULTS,
    DEFAULT_LIMITS,
    ZMQ_NOBLOCK,
    ZMQ_POLLIN,
    ZMQ_RCVMORE,
    ZMQ_SNDMORE,
    Decoder,
    Encoder,
    Limits,
    backend_send,
    check_no_dataclass,
    check_sendable,
    decode_outputs,
    decode_ready,
    decode_utility_result,
    encode_input,
    is_dead_sentinel,
    recv_rest,
)
from ..protocol.messages import (
    ENGINE_DEAD_SENTINEL,
    SESSION_BYTES,
    AttachRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    UtilityOutput,
    UtilityRequest,
)
from ..protocol.utilities import POWER_METHODS
from ..spec.client import ClientEvent, ClientState
from ..spec.errors import (
    ClientClosedError,
    EngineDeadError,
    EngineStartupError,
    EngineWireError,
    ProtocolError,
    SpecViolation,
    UtilityError,
    UtilityTimeoutError,
)
from ..spec.machine import Lifecycle, TraceEntry
from ..spec.utility import UTILITY, UtilityEvent, UtilityState
from . import _mutants
from ._utilities import AsyncUtilityMethods
from .args import (
    MAX_WAIT_SLICE_S,
    check_method,
    check_option_seconds,
    check_request_ids,
    check_timeout,
)
from .client import EngineCoreClient, SyncClientMixin
from .faults import as_plan
from .integrity import DEFAULT_LOSS_DEADLINE_S, LinkIntegrity
from .ipc import IpcDir
from .security import (
    CurveConfig,
    TransportGuard,
    check_transport,
    local_engine_pair,
    restrict_ipc_socket,
)

__all__ = [
    "DEFAULT_READY_TIMEOUT_S",
    "READY_TIMEOUT_ENV",
    "AsyncMPClient",
    "BackgroundResources",
    "MPClient",
    "SyncMPClient",
]


logger = logging.getLogger(__name__)
# Parts of one engine message the client holds (payload, aux frames, integrity trailer):
# the rest of a longer one is read and released part by part, and the message refused.
_MAX_PARTS = DEFAULT_LIMITS.max_frames + 1

READY_TIMEOUT_ENV = "ENGINEWIRE_ENGINE_READY_TIMEOUT_S"
DEFAULT_READY_TIMEOUT_S = 120.0
# Grace between SIGTERM and SIGKILL when shutting the engine down.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
# How often the monitor polls an engine's exit once its sentinel proved unreliable.
_SENTINEL_POLL_S = 0.1
# Late replies remembered (to record their drop in the trace); bounded, oldest forgotten.
_LATE_MEMORY = 256

_UTILITY_BYTE = RequestType.UTILITY.value
# Longest a shutdown waits for libzmq to hand an attached engine the ABORT of what it runs.
_ABORT_LINGER_MS = 1000
# Interrupts (Ctrl-C) a teardown absorbs before it skips the stage they keep landing in.
_TEARDOWN_RETRIES = 3
# Replies up to this size may take the short decode (``MPClient._on_message``).
_PLAIN_REPLY_BYTES = 1 << 16

_DEAD = object()  # output-queue marker: the engine died
_CLOSED = object()  # output-queue marker: the client was shut down


# The ready handshake is a few hundred bytes; anything near this is not one.
_MAX_HANDSHAKE_BYTES = 1 << 20


def _check_option_types(**options: Any) -> None:
    """A client option of the wrong type is a ValueError naming it (runtime.md), before
    anything starts: a str for a bool used to read as True, and the others failed as an
    AttributeError here or an EngineStartupError from a spawned engine."""
    for name in ("launch_engine", "frame_integrity", "allow_insecure_tcp"):
        if not isinstance(options[name], bool):
            raise ValueError(f"{name}={options[name]!r}: must be True or False")
    for name in ("input_address", "output_address"):
        if options[name] is not None and not isinstance(options[name], str):
            raise ValueError(f"{name}={options[name]!r}: must be an address str or None")
    connect = options["engine_connect"]
    if connect is not None and not (
            isinstance(connect, tuple | list) and len(connect) == 2
            and all(isinstance(a, str) for a in connect)):
        raise ValueError(f"engine_connect={connect!r}: must be an (input, output) pair of"
                         " address strs or None")
    for name in ("curve", "engine_curve"):
        if options[name] is not None and not isinstance(options[name], CurveConfig):
            raise ValueError(f"{name}={options[name]!r}: must be a CurveConfig or None")
    limits = options["engine_limits"]
    if limits is not None and not isinstance(limits, Limits):
        raise ValueError(f"engine_limits={limits!r}: must be a protocol.codec.Limits or None")


def _ready_timeout(option: float | None) -> float:
    if option is not None:
        seconds = check_option_seconds(option, "ready_timeout_s")
        assert seconds is not None
        return seconds
    raw = os.environ.get(READY_TIMEOUT_ENV)
    if raw:
        try:
            seconds = float(raw)
        except ValueError:
            raise ValueError(f"{READY_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"{READY_TIMEOUT_ENV}={raw!r}: must be a finite number of "
                             "seconds > 0")
        return seconds
    return DEFAULT_READY_TIMEOUT_S


def _describe_exit(pid: int | None, code: int | None) -> str:
    if code is None:
        return f"engine core process {pid} stopped responding"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"engine core process {pid} was killed by {name} (exit code {code})"
    return f"engine core process {pid} exited with exit code {code}"


class EngineProcessDied(RuntimeError):
    """Cause attached to ``EngineDeadError`` when the engine process went away."""


# --- utility registry ------------------------------------------------------------------------


class _Pending(Lifecycle[UtilityState, UtilityEvent]):
    """One pending call: its lifecycle (one object per round trip, not two), the future it
    answers and the method it called. Built by ``Lifecycle.__init__`` (the registry sets the
    other two): one constructor call per round trip, not two."""

    __slots__ = ("future", "method")
    future: Any  # concurrent.futures.Future, asyncio.Future or _SyncCall
    method: str


class _UtilityRegistry:
    """call_id -> pending future. Entries leave at their first (and only) outcome."""

    def __init__(self, trace: list[TraceEntry] | None) -> None:
        self._trace = trace
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._late: collections.OrderedDict[int, Lifecycle[UtilityState, UtilityEvent]] = (
            collections.OrderedDict()
        )
        self._refused: BaseException | None = None
        # The client's ``_on_power_reply``, weakly (the client owns this registry): replies to
        # POWER_METHODS move its lifecycle here, where replies are routed in arrival order.
        self.power: weakref.WeakMethod[Callable[[str, Any], None]] | None = None
        # One call's lifecycle is made per round trip: the machine's parts, looked up once.
        self._machine = (UTILITY.name, UTILITY.initial, UTILITY.compiled())

    def __len__(self) -> int:
        return len(self._pending)

    def new_id(self) -> int:
        return next(self._ids)  # one C call: atomic under the GIL

    def register(self, call_id: int, future: Any, method: str) -> None:
        """Enter a call under an id from ``new_id``: the caller holds the id before the entry
        exists, so it can always withdraw it (Ctrl-C may land as this returns)."""
        with self._lock:
            if self._refused is not None:
                raise self._refused
            entry = _Pending(*self._machine, self._trace)
            entry.future, entry.method = future, method
            self._pending[call_id] = entry

    def _forget(self, call_id: int, entry: _Pending, event: UtilityEvent) -> None:
        entry.fire(event)
        self._late[call_id] = entry
        while len(self._late) > _LATE_MEMORY:
            self._late.popitem(last=False)

    def give_up(self, call_id: int, event: UtilityEvent) -> bool:
        """Timeout or cancel: remove the entry; False if an outcome already arrived."""
        with self._lock:
            if _mutants.active("timed_out_call_left_registered"):
                entry = self._pending.get(call_id)
            else:
                entry = self._pending.pop(call_id, None)
            if entry is None:
                return False
            self._forget(call_id, entry, event)
            return True

    def withdraw(self, call_id: int, event: UtilityEvent) -> None:
        """The frame never left: remove the entry with the given outcome."""
        with self._lock:
            entry = self._pending.pop(call_id, None)
            if entry is not None:
                entry.fire(event)

    def _follow(self, method: str, result: Any) -> SpecViolation | None:
        """Move the client's lifecycle after a successful ``method`` reply (a POWER_METHODS
        one); the ``SpecViolation`` if the spec forbids it. Called outside the lock."""
        power = self.power() if self.power is not None else None
        if power is None:
            return None
        try:
            power(method, result)
        except SpecViolation as e:
            return e
        return None

    def resolve(self, reply: UtilityOutput) -> tuple[Any, BaseException | None, Any] | None:
        """Match a reply to its entry: ``(future, error, result)``, or None if dropped."""
        ok = reply.failure_message is None
        event = UtilityEvent.REPLY_OK if ok else UtilityEvent.REPLY_ERROR
        unheard: str | None = None  # a power method whose caller stopped waiting
        with self._lock:
            entry = self._pending.pop(reply.call_id, None)
            if entry is None:
                late = self._late.pop(reply.call_id, None)
                if late is not None:
                    late.fire(event)  # loops in CANCELLED / TIMED_OUT: dropped
                    if ok and isinstance(late, _Pending):
                        unheard = late.method
                else:
                    logger.debug("utility reply for unknown call id %s dropped", reply.call_id)
            elif entry.future.done():
                # Cancelled by its caller before it could withdraw the entry.
                entry.fire(UtilityEvent.CANCEL)
                entry.fire(event)
                if ok:
                    unheard = entry.method
            elif not ok:
                entry.fire(event)
                return entry.future, UtilityError(entry.method, reply.failure_message or ""), None
            else:
                result = reply.result
                try:
                    if type(result) not in _PLAIN_RESULTS:
                        result = decode_utility_result(result)
                except ProtocolError as e:
                    entry.fire(UtilityEvent.REPLY_ERROR)
                    return entry.future, UtilityError(entry.method, str(e)), None
                entry.fire(event)
                method = entry.method
        if unheard is not None:
            # Nobody waits for this reply, but the engine did sleep or wake.
            if unheard in POWER_METHODS:
                violation = self._follow(unheard, reply.result)
                if violation is not None:
                    logger.error("late %s reply: %s", unheard, violation)
            return None
        if entry is None or entry.future.done():
            return None
        if method in POWER_METHODS:
            violation = self._follow(method, result)
            if violation is not None:
                return entry.future, violation, None
        return entry.future, None, result

    def settle(self, reply: UtilityOutput) -> None:
        """``resolve`` and set the future's outcome (after the lock: a future's callbacks may
        run at once). A plain successful reply, the round trip's common case, takes the
        fewest steps."""
        if reply.failure_message is None and type(reply.result) in _PLAIN_RESULTS:
            with self._lock:
                entry = self._pending.get(reply.call_id)
                if entry is not None and not entry.future.done():
                    del self._pending[reply.call_id]
                    entry.fire(UtilityEvent.REPLY_OK)
                    fut, method = entry.future, entry.method
                else:
                    fut = None  # late, unknown or cancelled: ``resolve`` records each case
            if fut is not None:
                if method in POWER_METHODS:
                    violation = self._follow(method, reply.result)
                    if violation is not None:
                        _set_future(fut, violation, None)
                        return
                try:
                    fut.set_result(reply.result)
                except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
                    pass  # cancelled in between: the reply is dropped
                return
        hit = self.resolve(reply)
        if hit is not None:
            _set_future(*hit)

    def fail_all(self, error: BaseException, event: UtilityEvent) -> list[Any]:
        """Fire ``event`` on every pending call and refuse new ones; return their futures."""
        with self._lock:
            if self._refused is None:
                self._refused = error
            entries = list(self._pending.values())
            self._pending.clear()
            for entry in entries:
                entry.fire(event)
            return [e.future for e in entries]


def _drain(q: asyncio.Queue[Any]) -> list[Any]:
    """Everything in ``q``, taken without blocking."""
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except asyncio.QueueEmpty:
            return out


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def _set_future(fut: Any, error: BaseException | None, result: Any) -> None:
    if fut.done():
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
        pass  # cancelled in between: the reply is dropped


# --- background resources --------------------------------------------------------------------


@dataclass
class BackgroundResources:
    """What a client owns outside Python objects. Calling it tears everything down, once.

    It holds no reference to the client, so ``weakref.finalize(client, resources)`` runs it
    when the client is dropped, at interpreter exit, or explicitly from ``shutdown()``.
    """

    ctx: zmq.Context[Any] | None = None
    ipc_dir: IpcDir | None = None
    proc: Any = None  # multiprocessing.Process
    input_socket: zmq.Socket[Any] | None = None
    # Owned by the reader once it runs (then None here).
    output_socket: zmq.Socket[Any] | None = None
    sync_reader: _SyncReader | None = None
    reader_loop: asyncio.AbstractEventLoop | None = None
    # The async client's PULL socket, read by a loop callback (add_reader on its FD).
    async_output_socket: zmq.Socket[Any] | None = None
    reader_fd: int | None = None
    monitor_thread: threading.Thread | None = None
    monitor_pipe: tuple[int, int] | None = None
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    shutdown_timeout: float | None = None
    # Kept above 0 only to deliver the ABORT a front end sends an attached engine at shutdown.
    input_linger_ms: int = 0
    guard: TransportGuard | None = None  # ZAP handler and socket monitors (security.py)
    last_seen: list[float] = field(default_factory=lambda: [time.monotonic()])
    # When the attach marker is overdue (monotonic); inf once the reader has accepted it.
    # Shared like ``last_seen``: the monitor wakes at it, the reader disarms it.
    attach_deadline: list[float] = field(default_factory=lambda: [math.inf])
    # ipc socket files bound at addresses the caller gave (ours live in ipc_dir), with what
    # identifies the file (``_file_id``): removed once the context is gone, so a later bind
    # there is not refused or confused, unless another front end bound the path since (a
    # handover to it).
    bound_ipc_paths: list[tuple[str, tuple[int, int, int]]] = field(default_factory=list)
    done: bool = False
    # Set when a teardown has run to its end; ``torn_by`` is the thread running it.
    finished: threading.Event = field(default_factory=threading.Event)
    torn_by: int = 0
    # The reader loop's thread is blocked in ``wait_finished`` (a sync shutdown() there while
    # a shutdown_async() tears down): the teardown then cannot hand the socket's close to
    # the loop and does it itself. ``loop_gate`` wakes a teardown already waiting for the loop.
    loop_blocked: bool = False
    loop_gate: threading.Event | None = None

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        self.torn_by = threading.get_ident()
        try:
            self._tear_down()
        finally:
            self.finished.set()

    def wait_finished(self, timeout: float) -> None:
        """Return once the teardown another thread started has ended (bounded); at once on
        the tearing thread itself (a signal handler there must not wait for itself)."""
        if self.torn_by == threading.get_ident():
            return
        loop = self.reader_loop
        try:
            on_loop = loop is not None and asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if not on_loop:
            self.finished.wait(timeout)
            return
        self.loop_blocked = True  # before reading the gate: see _close_async
        gate = self.loop_gate
        if gate is not None:
            gate.set()
        try:
            self.finished.wait(timeout)
        finally:
            self.loop_blocked = False

    def _tear_down(self) -> None:
        stages: list[Callable[[], None]] = [self._stop_monitor, self._stop_process]
        if _mutants.active("context_term_before_close"):
            stages.append(self._term_context)
        stages += [self._close_sockets, self._close_guard, self._term_context,
                   self._remove_ipc_dir]
        # Every stage runs whatever an earlier one raised: a failure in one must not leak
        # what the others hold. The first failure is raised once all ran.
        first: Exception | None = None
        interrupt: BaseException | None = None
        retries = 0
        i = 0
        while i < len(stages):
            try:
                stages[i]()
            except Exception as e:
                logger.exception("client teardown: %s failed", stages[i].__name__)
                first = first or e
            except BaseException as e:
                # Ctrl-C, most likely while waiting out the grace for a hung engine: the
                # caller wants to stop waiting, not to leak the engine, sockets and threads
                # (a later shutdown() finds the teardown done). End the grace (SIGKILL now),
                # run this stage again and the rest, then raise the interrupt. Each stage is
                # bounded and can be run again; a few interrupts at most, so it ends.
                interrupt = interrupt or e
                self.shutdown_timeout = 0.0
                retries += 1
                if retries <= _TEARDOWN_RETRIES:
                    continue
                logger.warning("client teardown: %s interrupted; skipped", stages[i].__name__)
            i += 1
        if interrupt is not None:
            raise interrupt
        if first is not None:
            raise first

    def _close_guard(self) -> None:
        if self.guard is not None:  # before term(): its authenticator holds a socket
            guard, self.guard = self.guard, None
            guard.close()

    def _remove_ipc_dir(self) -> None:
        if self.ipc_dir is not None:
            self.ipc_dir.remove()  # idempotent: cleared after, so an interrupted one reruns
            self.ipc_dir = None
        while self.bound_ipc_paths:  # one at a time: an interrupted teardown resumes here
            path, ours = self.bound_ipc_paths[-1]
            with contextlib.suppress(OSError):  # already gone
                st = os.lstat(path)
                if stat.S_ISSOCK(st.st_mode) and _file_id(st) == ours:
                    os.unlink(path)
            self.bound_ipc_paths.pop()

    def _stop_monitor(self) -> None:
        if self.monitor_pipe is not None:
            try:
                os.write(self.monitor_pipe[1], b"x")
            except OSError:
                pass
        monitor = self.monitor_thread
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(2.0)
        if self.monitor_pipe is not None:
            # Forgotten before they are closed: an interrupted teardown runs this again, and
            # a second close could hit a number reused by another file.
            fds, self.monitor_pipe = self.monitor_pipe, None
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _stop_process(self) -> None:
        proc = self.proc
        if proc is None:
            return
        timeout = self.shutdown_timeout
        if timeout is None:
            timeout = DEFAULT_SHUTDOWN_TIMEOUT_S
        try:
            if proc.is_alive():
                proc.terminate()
                # A stopped engine (SIGSTOP, a debugger) would hold SIGTERM pending and cost
                # the whole grace: let it run to handle it (only a pid on this host).
                if getattr(proc, "local", True) and proc.pid is not None:
                    with contextlib.suppress(OSError):
                        os.kill(proc.pid, signal.SIGCONT)
                proc.join(None if math.isinf(timeout) else timeout)
            if proc.is_alive():
                logger.warning("engine core did not stop within %.1f s; killing it", timeout)
                proc.kill()
                proc.join(5.0)
            proc.join(0)
            proc.close()
        except ValueError:
            pass  # already closed
        # Only now: an interrupted join leaves it here for the teardown to run this again.
        self.proc = None

    def _close_sockets(self) -> None:
        with self.send_lock:
            if self.input_socket is not None:
                self.input_socket.close(linger=self.input_linger_ms)
                self.input_socket = None
        if self.output_socket is not None:  # never handed to a reader
            self.output_socket.close(linger=0)
            self.output_socket = None
        if self.sync_reader is not None:
            self.sync_reader.close()  # runs again if interrupted: cleared only after
            self.sync_reader = None
        if self.async_output_socket is not None:
            self._close_async()

    def _close_async(self) -> None:
        sock, fd, loop = self.async_output_socket, self.reader_fd, self.reader_loop
        self.async_output_socket = None
        self.reader_fd = None
        assert sock is not None

        once = threading.Lock()
        closed = False

        def close() -> None:
            # Once only: a second remove_reader could hit the fd reused by another socket.
            nonlocal closed
            with once:
                if closed:
                    return
                closed = True
            if fd is not None and loop is not None and not loop.is_closed():
                loop.remove_reader(fd)
            sock.close(linger=0)

        on_loop = False
        try:
            on_loop = loop is not None and asyncio.get_running_loop() is loop
        except RuntimeError:
            pass
        if loop is None or on_loop or loop.is_closed() or not loop.is_running():
            close()
            return
        done = self.loop_gate = threading.Event()
        if self.loop_blocked:  # after setting the gate: see wait_finished
            close()  # the loop's thread waits for this teardown: it cannot run a callback
            return

        def close_and_signal() -> None:
            try:
                close()
            finally:
                done.set()

        try:
            loop.call_soon_threadsafe(close_and_signal)
        except RuntimeError:  # loop closed in between
            close()
            return
        if not done.wait(5.0):
            logger.warning("event loop did not close the output socket; closing it here")
        close()  # a no-op once the loop did; else the loop's thread is blocked (or stuck)

    def _term_context(self) -> None:
        ctx = self.ctx
        self.ctx = None
        if ctx is None:
            return
        # term() blocks until every socket is closed; bound it so a stuck reader cannot
        # hang shutdown (the context then leaks, which is logged).
        t = threading.Thread(target=ctx.term, name="EngineClientCtxTerm", daemon=True)
        t.start()
        t.join(5.0)
        if t.is_alive():
            logger.warning("zmq context did not terminate; a socket was left open")


class _MarkerOverdue(Exception):
    """What ``_watch_engine`` returns when the attach marker is overdue: the client words
    the cause (``MPClient._marker_overdue``, which knows what it dropped meanwhile)."""


def _monitor_engine(
    client_ref: weakref.ReferenceType[MPClient],
    proc: Any,
    stop_fd: int,
    heartbeat_timeout_s: float | None,
    last_seen: list[float],
    attach_deadline: Sequence[float] = (math.inf,),
) -> None:
    """Wait for the engine process to exit (or go silent, or leave the ATTACH unanswered)
    and report it to the client.

    If the watch itself fails, death could no longer be seen and every wait on the engine
    could hang: the client is told the engine is dead, with the failure as the cause."""
    try:
        cause = _watch_engine(proc, stop_fd, heartbeat_timeout_s, last_seen, attach_deadline)
    except Exception as e:
        logger.exception("engine monitor failed")
        cause = EngineProcessDied(f"the engine monitor failed ({e!r}): death can no longer"
                                  " be detected, so the engine is treated as dead")
    if cause is None:
        return
    client = client_ref()
    if client is not None:
        if isinstance(cause, _MarkerOverdue):
            cause = client._marker_overdue()
        client._on_engine_dead(cause)


def _watch_engine(
    proc: Any,
    stop_fd: int,
    heartbeat_timeout_s: float | None,
    last_seen: list[float],
    attach_deadline: Sequence[float],
) -> BaseException | None:
    """Block until the engine exits or goes silent or its attach marker is overdue (the
    cause), or the client stops or nothing is left to watch (None)."""
    waitables: list[Any] = [stop_fd]
    if proc is not None:
        waitables.append(proc.sentinel)
    # Set when the sentinel proved unreliable (readable, process alive): it stays readable,
    # so waiting on it again would spin; the exit is then polled instead.
    poll_exit_s: float | None = None
    while True:
        # Wake at the deadlines themselves rather than on a polling grid: a silent engine is
        # then declared dead at its last message + heartbeat_timeout_s (plus scheduling), not
        # up to a poll period later (timeout/4 polling measured 0.8-1.25 s with a 1 s
        # deadline). The reader disarms the marker's deadline without waking this thread:
        # it wakes once more at the old deadline, finds it gone, and goes on.
        now = time.monotonic()
        wait_s = attach_deadline[0] - now
        if heartbeat_timeout_s:
            wait_s = min(wait_s, last_seen[0] + heartbeat_timeout_s - now)
        if math.isinf(wait_s) and proc is None:
            return None  # an attached engine without a heartbeat: only the marker was due
        if poll_exit_s is not None:
            wait_s = min(wait_s, poll_exit_s)
        ready = multiprocessing.connection.wait(
            waitables, timeout=None if math.isinf(wait_s) else max(0.0, wait_s))
        if stop_fd in ready:
            return None
        if proc is not None and (proc.sentinel in ready or poll_exit_s is not None):
            # A readable sentinel with a live process would be a false alarm (vLLM #54184):
            # require a real exit code.
            if poll_exit_s is None:
                proc.join(1.0)
            if proc.exitcode is not None:
                return EngineProcessDied(_describe_exit(proc.pid, proc.exitcode))
            if poll_exit_s is None:
                logger.warning("engine process %s: its sentinel is readable but it has not "
                               "exited; polling its exit instead", proc.pid)
                waitables.remove(proc.sentinel)
                poll_exit_s = _SENTINEL_POLL_S
        if time.monotonic() >= attach_deadline[0]:  # inf once the reader took the marker
            return _MarkerOverdue()
        if heartbeat_timeout_s and time.monotonic() - last_seen[0] >= heartbeat_timeout_s:
            return EngineProcessDied(
                f"no message from the engine for {heartbeat_timeout_s:g} s"
                " (engine_heartbeat_timeout_s)"
            )


class _SigintHold:
    """Hold a Ctrl-C (SIGINT with Python's default handler, main thread) until the block
    ends, then raise it. For an ADD's send: interrupted right after its last part went, the
    request was forgotten while the engine ran it, and its outputs were SpecViolations in
    every later get_output (losing the batches they came in). Held, the ADD goes out whole
    and the caller gets its KeyboardInterrupt with the request live and tracked. The C-level
    _signal calls cost ~0.3 us each (signal's enum wrappers: ~4.5 us, per add_request)."""

    __slots__ = ("held", "previous")

    def __enter__(self) -> None:
        self.previous: Any = None
        if (_signal.getsignal(_SIGINT) is not _signal.default_int_handler
                or threading.current_thread() is not _MAIN_THREAD):
            return  # another handler is the application's to honour; threads get no signal
        self.held = False
        self.previous = _signal.signal(_SIGINT, self._hold)

    def _hold(self, _signum: int, _frame: Any) -> None:
        self.held = True

    def __exit__(self, *exc: object) -> None:
        if self.previous is None:
            return
        _signal.signal(_SIGINT, self.previous)
        if self.held:
            raise KeyboardInterrupt


_SIGINT = int(signal.SIGINT)
_MAIN_THREAD = threading.main_thread()


def _end_message(sock: zmq.Socket[Any]) -> None:
    """A send interrupted part-way (Ctrl-C is raised inside a send, possibly after the part
    went): end the message with an empty part, so the next message is not read as its
    continuation. The engine rejects the stub as malformed and nothing else is lost; if no
    message was open, the empty part names no peer and the ROUTER drops it."""
    with contextlib.suppress(Exception):
        sock.send(b"")


def _file_id(st: os.stat_result) -> tuple[int, int, int]:
    """A file's identity: the inode of an unlinked file is soon reused, its ctime is not."""
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _bind(sock: zmq.Socket[Any], address: str, option: str) -> None:
    try:
        sock.bind(address)
    except zmq.ZMQError as e:  # a typo, a port in use: the option is what to fix
        raise ValueError(f"{option}={address!r}: cannot bind: {e}") from e


# Every multi-process client of this process, for the fork hook below.
class EngineProcess(Protocol):
    """What the client needs of a started engine: ``multiprocessing.Process``'s subset. A
    handle for an engine elsewhere (a Ray actor) answers the same; its ``local`` is False,
    so no signal is sent to its pid on this host."""

    @property
    def pid(self) -> int | None: ...
    @property
    def exitcode(self) -> int | None: ...
    @property
    def sentinel(self) -> int: ...

    def is_alive(self) -> bool: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def close(self) -> None: ...


EngineLauncher = Callable[[type, bytes, dict[str, Any], str], EngineProcess]


def _spawn_engine(config_type: type, config: bytes, kwargs: dict[str, Any], name: str
                  ) -> EngineProcess:
    """The default launcher: a spawned subprocess on this host."""
    from .engine_proc import _process_main

    mp = multiprocessing.get_context("spawn")  # fork is unsafe once CUDA is up
    proc = mp.Process(target=_process_main, args=(config_type, config, kwargs), name=name,
                      daemon=True)
    proc.start()
    return proc


_CLIENTS: weakref.WeakSet[MPClient] = weakref.WeakSet()


def _fork_child_hook() -> None:
    parent = os.getppid()
    for client in list(_CLIENTS):
        client._after_fork_in_child(parent)


os.register_at_fork(after_in_child=_fork_child_hook)


# --- MPClient --------------------------------------------------------------------------------


class MPClient(EngineCoreClient):
    """Shared by the sync and async clients: launch, handshake, monitor, registry, teardown."""

    multiprocess = True
    # Set by the owner of a client still being built (a data-parallel client shutting down
    # while it restarts an engine): the ready wait gives up within a poll slice.
    _abandon: threading.Event | None = None

    def __init__(
        self,
        config: Any,
        *,
        trace: list[TraceEntry] | None = None,
        ready_timeout_s: float | None = None,
        engine_index: int = 0,
        client_index: int = 0,
        input_address: str | None = None,
        output_address: str | None = None,
        launch_engine: bool = True,
        engine_heartbeat_timeout_s: float | None = None,
        engine_heartbeat_interval_s: float | None = None,
        engine_startup_delay_s: float = 0.0,
        engine_fault: Any = None,  # str | Fault | FaultPlan (runtime/faults.py)
        # (input, output) the launched engine connects to instead of the client's own
        # addresses: a proxy in between (model_tests/interposer.py) binds these.
        engine_connect: tuple[str, str] | None = None,
        # seq/ack/CRC trailer on every message; a launched engine is told (runtime/integrity.py)
        frame_integrity: bool = False,
        shutdown_timeout_s: float | None = None,
        transport: str = "ipc",
        curve: CurveConfig | None = None,
        engine_curve: CurveConfig | None = None,
        allow_insecure_tcp: bool = False,
        engine_limits: Any = None,  # protocol.codec.Limits for the launched engine's input
        # Starts the engine instead of a local spawn: (config type, encoded config, the
        # engine's keyword arguments, process name) -> a started process-like handle (see
        # ``EngineLauncher``). The Ray backend places engines with one (ray_backend.py).
        engine_launcher: EngineLauncher | None = None,
    ) -> None:
        # Refused before anything is created: a deadline the waits cannot hold (inf, nan, a
        # negative one) would otherwise surface later as a dead monitor or a hang.
        engine_heartbeat_timeout_s = check_option_seconds(
            engine_heartbeat_timeout_s, "engine_heartbeat_timeout_s")
        engine_heartbeat_interval_s = check_option_seconds(
            engine_heartbeat_interval_s, "engine_heartbeat_interval_s")
        shutdown_timeout_s = check_option_seconds(
            shutdown_timeout_s, "shutdown_timeout_s", allow_zero=True)
        engine_startup_delay_s = check_option_seconds(
            engine_startup_delay_s, "engine_startup_delay_s", allow_zero=True) or 0.0
        ready_timeout = _ready_timeout(ready_timeout_s)
        self._ready_timeout = ready_timeout
        # A fault spec is parsed here, not first in the spawned engine: a typo is a ValueError
        # from the constructor instead of an engine that dies while starting.
        engine_fault = as_plan(engine_fault)
        _check_option_types(
            launch_engine=launch_engine, frame_integrity=frame_integrity,
            allow_insecure_tcp=allow_insecure_tcp, input_address=input_address,
            output_address=output_address, engine_connect=engine_connect, curve=curve,
            engine_curve=engine_curve, engine_limits=engine_limits)
        for name, index in (("engine_index", engine_index), ("client_index", client_index)):
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 1 << 16:
                raise ValueError(f"{name}={index!r}: must be an integer in [0, 65535]")
        if engine_launcher is not None and not callable(engine_launcher):
            raise ValueError(f"engine_launcher={engine_launcher!r}: must be callable")
        self._launcher = engine_launcher
        super().__init__(config, trace=trace)
        # Read by _start (security.py): transport, keys, and the engine's input bounds.
        self._security = (transport, curve, engine_curve, allow_insecure_tcp, engine_limits)
        # The largest utility call the plain path sends (the type byte and its payload); a
        # larger one takes the general path, which refuses it naming the bound.
        limits = engine_limits or DEFAULT_LIMITS
        self._call_limit: int = min(limits.max_frame_bytes, 1 + limits.max_call_bytes)
        self.resources = BackgroundResources(shutdown_timeout=shutdown_timeout_s)
        # First thing: whatever fails below, the finalizer reclaims what was created.
        self._finalizer = weakref.finalize(self, self.resources)
        self._forked_off = False
        _CLIENTS.add(self)  # a fork's child must not run this client's teardown
        self.engine_index = engine_index
        self.client_index = client_index
        self.identity = engine_index.to_bytes(2, "little")
        self._utilities = _UtilityRegistry(trace)
        self._utilities.power = weakref.WeakMethod(self._on_power_reply)
        # Only a heartbeat deadline reads when the engine was last heard from.
        self._stamp_seen = bool(engine_heartbeat_timeout_s)
        # This front end's session until the engine's attach marker arrives, then None.
        self._attaching: bytes | None = None
        self._stale = 0  # messages dropped before the marker
        self._encoder = Encoder()
        # Round-trip paths: a utility call is encoded plainly when it can be (no arrays), and
        # a one-frame reply is decoded by this client's own decoder. Each is used under the
        # send lock or by the one thread that holds the output socket.
        self._call_encoder = msgspec.msgpack.Encoder()
        self._sock_send: Callable[..., Any] = backend_send(zmq.Socket)  # set per socket
        self._out_decoder: Decoder[EngineCoreOutputs] = Decoder(EngineCoreOutputs)
        self._decode_reply = self._out_decoder.decode_unchecked
        self._pending_sends: collections.deque[tuple[list[Any], list[Any]]] = collections.deque()
        self.engine_pid: int | None = None
        self.ready_response: Any = None
        self._startup_report: Any = None  # multiprocessing Connection while starting
        self._integrity = (
            LinkIntegrity(loss_deadline_s=DEFAULT_LOSS_DEADLINE_S) if frame_integrity else None)
        try:
            self._start(
                ready_timeout=ready_timeout,
                input_address=input_address,
                output_address=output_address,
                launch_engine=launch_engine,
                heartbeat_timeout_s=engine_heartbeat_timeout_s,
                heartbeat_interval_s=engine_heartbeat_interval_s,
                startup_delay_s=engine_startup_delay_s,
                fault=engine_fault,
                connect=engine_connect,
            )
        except BaseException:
            self._close_startup_report()
            self._mark_closed()
            self._finalizer()
            raise

    def _start(
        self,
        *,
        ready_timeout: float,
        input_address: str | None,
        output_address: str | None,
        launch_engine: bool,
        heartbeat_timeout_s: float | None,
        heartbeat_interval_s: float | None,
        startup_delay_s: float,
        fault: Any,
        connect: tuple[str, str] | None = None,
    ) -> None:
        res = self.resources
        res.ctx = zmq.Context(io_threads=1)
        input_address, output_address, curve, engine_kwargs = self._secure_transport(
            input_address, output_address, launch_engine)
        res.guard = TransportGuard(res.ctx, curve, side="client")
        if input_address is None or output_address is None:
            res.ipc_dir = IpcDir()
            input_address = input_address or res.ipc_dir.address("input")
            output_address = output_address or res.ipc_dir.address("output")
        inp = res.ctx.socket(zmq.ROUTER)
        res.input_socket = inp
        self._sock_send = backend_send(type(inp))
        inp.setsockopt(zmq.LINGER, 0)
        inp.setsockopt(zmq.SNDHWM, 0)  # a full ROUTER drops silently: never drop a request
        inp.setsockopt(zmq.RCVHWM, 0)
        # An engine that reconnects (e.g. after refusing an oversized frame) keeps its
        # identity; without handover the stale pipe would keep it unreachable.
        inp.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # What an engine sends is bounded too (a peer with a stolen engine key): libzmq
        # refuses a larger frame from its header, before allocating it. Only the ready
        # handshake arrives here; outputs may be as large as the engine's own frame bound.
        inp.setsockopt(zmq.MAXMSGSIZE, _MAX_HANDSHAKE_BYTES)
        res.guard.serve(inp, "input")
        _bind(inp, input_address, "input_address")
        self.input_address = inp.getsockopt_string(zmq.LAST_ENDPOINT)
        out = self._make_output_socket(res.ctx)
        out.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.RCVHWM, 0)
        out.setsockopt(zmq.MAXMSGSIZE, DEFAULT_LIMITS.max_frame_bytes)  # what decode_outputs takes
        res.guard.serve(out, "output")
        _bind(out, output_address, "output_address")
        self.output_address = out.getsockopt_string(zmq.LAST_ENDPOINT)
        restrict_ipc_socket(self.input_address)
        restrict_ipc_socket(self.output_address)
        for address in (self.input_address, self.output_address):
            if address.startswith("ipc://") and (
                    res.ipc_dir is None or not address.startswith(f"ipc://{res.ipc_dir.path}/")):
                path = address.removeprefix("ipc://")
                with contextlib.suppress(OSError):  # gone already: nothing to remove later
                    res.bound_ipc_paths.append((path, _file_id(os.lstat(path))))

        if launch_engine:
            if heartbeat_timeout_s and heartbeat_interval_s is None:
                # A deadline without beats would declare every idle engine dead.
                heartbeat_interval_s = heartbeat_timeout_s / 4

            mp = multiprocessing.get_context("spawn")  # fork is unsafe once CUDA is up
            # The engine writes why it failed to start here (EngineStartupError says it).
            report_r, report_w = mp.Pipe(duplex=False)
            self._startup_report = report_r
            kwargs = {
                "startup_report": report_w,
                "input_address": connect[0] if connect else self.input_address,
                "output_address": connect[1] if connect else self.output_address,
                "engine_index": self.engine_index,
                "parent_pid": os.getpid(),
                "heartbeat_interval_s": heartbeat_interval_s,
                "startup_delay_s": startup_delay_s,
                "fault": fault,
                "integrity": self._integrity is not None,
                **engine_kwargs,
            }
            launcher = self._launcher or _spawn_engine
            try:
                proc = launcher(type(self.config), msgspec.msgpack.encode(self.config), kwargs,
                                f"EngineCore_{self.engine_index}")
            finally:
                report_w.close()  # the child has its own copy: EOF once it exits
            res.proc = proc
            self.engine_pid = proc.pid
        elif heartbeat_timeout_s is None:
            logger.info("attached engine without a heartbeat: only its sentinel reports death")

        try:
            ready = self._wait_ready(ready_timeout)
        finally:
            self._close_startup_report()
        self.ready_response = ready
        self._apply_ready(ready)
        self._attach()
        res.last_seen[0] = time.monotonic()

        stop_r, stop_w = os.pipe()
        res.monitor_pipe = (stop_r, stop_w)
        # Always started: the marker's deadline is watched even for an attached engine
        # without a heartbeat, whose monitor, with nothing else to watch, ends at that
        # deadline once the marker is in (waking it sooner would take another pipe).
        res.monitor_thread = threading.Thread(
            target=_monitor_engine,
            args=(weakref.ref(self), res.proc, stop_r, heartbeat_timeout_s, res.last_seen,
                  res.attach_deadline),
            name="EngineCoreMonitor",
            daemon=True,
        )
        res.monitor_thread.start()
        self._start_reader()
        with self._state_lock:
            if self.lifecycle.state is ClientState.DEAD:
                # The monitor saw the engine go (or go silent) before the handshake ended.
                raise EngineStartupError(
                    f"the engine core died during start-up: {self._dead_cause}"
                ) from self._dead_cause
            self.lifecycle.fire(ClientEvent.HANDSHAKE_OK)

    def _secure_transport(
        self, input_address: str | None, output_address: str | None, launch_engine: bool
    ) -> tuple[str | None, str | None, CurveConfig | None, dict[str, Any]]:
        """Addresses, this side's CURVE config and the launched engine's security kwargs.

        tcp binds to loopback unless an address is given. A launched engine over tcp gets a
        fresh key pair (the client admits only it) unless insecure tcp was asked for.
        """
        transport, curve, engine_curve, allow_insecure_tcp, limits = self._security
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport={transport!r}: must be 'ipc' or 'tcp'")
        if transport == "tcp":
            input_address = input_address or "tcp://127.0.0.1:*"
            output_address = output_address or "tcp://127.0.0.1:*"
        if launch_engine and engine_curve is None and (
                curve is not None or (transport == "tcp" and not allow_insecure_tcp)):
            curve, engine_curve = local_engine_pair(curve)
        check_transport([a for a in (input_address, output_address) if a], curve,
                        allow_insecure_tcp)
        kwargs: dict[str, Any] = {"curve": engine_curve, "allow_insecure_tcp": allow_insecure_tcp}
        if limits is not None:
            kwargs["limits"] = limits
        return input_address, output_address, curve, kwargs

    def _make_output_socket(self, ctx: zmq.Context[Any]) -> Any:
        sock = ctx.socket(zmq.PULL)
        self.resources.output_socket = sock
        return sock

    def _start_reader(self) -> None:
        raise NotImplementedError

    def _wait_ready(self, timeout: float) -> Any:
        """The engine speaks first: wait for its ReadyResponse, its death, or the deadline."""
        res = self.resources
        assert res.input_socket is not None
        poller = zmq.Poller()
        poller.register(res.input_socket, zmq.POLLIN)
        sentinel = res.proc.sentinel if res.proc is not None else None
        if sentinel is not None:
            poller.register(sentinel, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        strangers: set[int] = set()  # engine indexes heard from that are not ours
        while True:
            remaining = deadline - time.monotonic()
            if self._abandon is not None and self._abandon.is_set():
                raise EngineStartupError("start-up abandoned: the client is shutting down")
            if remaining <= 0:
                if strangers:
                    raise EngineStartupError(
                        f"timed out after {timeout:g} s: the engine that answered has"
                        f" engine_index {sorted(strangers)}, this client expects"
                        f" {self.engine_index} (set the same index on both sides)")
                refused = list(res.guard.refusals) if res.guard is not None else []
                if refused:  # the engine may well be up: its handshake was turned away
                    raise EngineStartupError(
                        f"timed out after {timeout:g} s waiting for the engine core's"
                        f" handshake; the transport refused {len(refused)} peer(s), the"
                        f" last: {refused[-1]} (check the CURVE keys on both sides)")
                raise EngineStartupError(
                    f"timed out after {timeout:g} s waiting for the engine core to start"
                    " (slow weight loading is a common cause); raise the deadline with the"
                    f" ready_timeout_s option or the {READY_TIMEOUT_ENV} environment variable"
                )
            events = dict(poller.poll(max(1, int(min(remaining, 1.0) * 1000))))
            if res.input_socket in events:
                identity, *frames = res.input_socket.recv_multipart()
                if identity != self.identity:
                    logger.warning("ignoring a message from unknown engine %r", identity)
                    strangers.add(int.from_bytes(identity, "little") if len(identity) == 2
                                  else -1)
                    continue
                try:
                    return decode_ready(frames)
                except ProtocolError as e:
                    raise EngineStartupError(f"engine handshake refused: {e}") from e
            if sentinel is not None and (sentinel in events or not res.proc.is_alive()):
                raise self._startup_exit()

    def _startup_exit(self) -> EngineStartupError:
        """The error for a launched engine that exited during start-up."""
        proc = self.resources.proc
        assert proc is not None
        proc.join(1.0)
        how = _describe_exit(proc.pid, proc.exitcode)
        reason = self._startup_reason()
        if reason is None:
            return EngineStartupError(
                f"engine core initialization failed; see the engine's log: {how}")
        err = EngineStartupError(f"engine core initialization failed: {reason} ({how})")
        err.__cause__ = EngineProcessDied(reason)
        return err

    def _attach(self) -> None:
        """Take the engine over under a fresh session (protocol/messages.py, "Attaching"):
        ATTACH goes out first, and the reader drops whatever arrives before the engine's
        marker (a previous front end's outputs) unread."""
        res = self.resources
        assert res.input_socket is not None
        session = os.urandom(SESSION_BYTES)
        self._attaching = session
        res.attach_deadline[0] = time.monotonic() + self._ready_timeout
        # Unsealed even with frame integrity: it starts the engine's counts afresh.
        attach = AttachRequest(session, integrity=self._integrity is not None)
        res.input_socket.send_multipart(
            [self.identity, *encode_input(self._encoder, RequestType.ATTACH, attach)])

    def _before_marker(self, first: bytes, sock: zmq.Socket[Any]) -> None:
        """``_on_message`` until the attach marker: only the marker and the sentinel count."""
        frames = recv_rest(sock, [first], _MAX_PARTS) if sock.get(ZMQ_RCVMORE) else [first]
        if self._stamp_seen:
            self.resources.last_seen[0] = time.monotonic()  # a message: the engine is alive
        if is_dead_sentinel(frames):
            raise EngineProcessDied(
                "the engine said it is gone (engine-dead sentinel: a fatal error, or an engine"
                " started on its own stopped by a signal); see the engine's log")
        session = self._attaching
        if session is not None and self._is_marker(frames, session):
            self._attaching = None
            self.resources.attach_deadline[0] = math.inf  # the monitor stops watching it
            if self._stale:
                logger.info("dropped %d message(s) sent before this front end attached",
                            self._stale)
            return
        self._stale += 1
        if time.monotonic() > self.resources.attach_deadline[0]:
            # Seen here at once when the engine speaks; the monitor sees it when it does not.
            raise self._marker_overdue()

    def _marker_overdue(self) -> ProtocolError:
        """The cause of death when the marker has not come within ``ready_timeout_s``: the
        ATTACH was lost (a link that dropped just then) or the engine ignores it or hangs.
        Everything would be dropped (or awaited) for good."""
        said = (f"though the engine sent {self._stale} other message(s)" if self._stale
                else "and the engine sent nothing else")
        return ProtocolError(
            f"no attach marker within {self._ready_timeout:g} s (ready_timeout_s) of this"
            f" front end's ATTACH, {said}")

    def _is_marker(self, frames: list[bytes], session: bytes) -> bool:
        """Whether ``frames`` is the attach marker for ``session``; anything else before it
        is not this front end's, so it is neither checked nor read further."""
        integrity = self._integrity
        body = frames[:-1] if integrity is not None and len(frames) > 1 else frames
        try:
            marker = decode_outputs(body)
        except ProtocolError:
            return False
        if marker.session != session and not _mutants.active("attach_marker_session_not_checked"):
            return False
        if marker.refusal is not None:  # never sealed: read whatever this side's setting
            raise ProtocolError(f"the engine refused this front end: {marker.refusal}")
        if integrity is not None:
            integrity.open(frames)  # the session's first sealed message: seq 1
        return True

    def _close_startup_report(self) -> None:
        conn, self._startup_report = self._startup_report, None
        if conn is not None:
            conn.close()

    def _startup_reason(self) -> str | None:
        """What the launched engine reported before exiting during start-up, if anything."""
        conn = self._startup_report
        if conn is None:
            return None
        try:
            if conn.poll(0.5):
                return str(conn.recv())
        except (EOFError, OSError):
            pass
        return None

    # -- death and shutdown -------------------------------------------------------------------

    def _on_engine_dead(self, cause: BaseException) -> None:
        """Called from the monitor or the reader; safe to call more than once."""
        if not self._mark_dead(cause):
            return
        logger.warning("engine core died: %s", cause)
        err = self._dead_error()
        if not _mutants.active("pending_utility_not_failed_on_death"):
            self._deliver_failures(self._utilities.fail_all(err, UtilityEvent.ENGINE_DIED), err)
        self._wake_waiters(_DEAD)

    def _deliver_failures(self, futures: list[Any], err: BaseException) -> None:
        for fut in futures:
            _set_future(fut, err, None)

    def _wake_waiters(self, marker: object) -> None:
        raise NotImplementedError

    def pending_utility_calls(self) -> int:
        """Registry entries still waiting for an outcome (0 once all calls ended)."""
        return len(self._utilities)

    def queued_outputs(self) -> int:
        """Batches received and not yet taken by ``get_output``: nothing throttles the
        engine, so a front end that reads slower than it produces sees this grow."""
        q: queue.Queue[Any] | asyncio.Queue[Any] | None = getattr(self, "_outputs", None)
        n = 0 if q is None else q.qsize()
        if n and (self.is_dead or self.is_closed):
            n -= 1  # the death or shutdown marker that wakes readers
        return n + len(self._redeliver)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine (SIGTERM, then SIGKILL after ``timeout`` s; ``inf`` never kills)
        and free everything."""
        if timeout is not None:  # checked before anything changes: a bad one leaks nothing
            checked = check_timeout(timeout)
            timeout = math.inf if checked is None else checked
        if self._forked_off:
            return  # the engine, sockets and files are the parent's (see _after_fork_in_child)
        self._abort_left_behind()
        if not self._mark_closed():
            # A second caller returns when the first one's teardown has ended, not before:
            # "shutdown returned" means the engine is gone, for every caller.
            grace = self.resources.shutdown_timeout
            grace = DEFAULT_SHUTDOWN_TIMEOUT_S if grace is None or math.isinf(grace) else grace
            self.resources.wait_finished(grace + 30.0)
            return
        err: EngineWireError = ClientClosedError(self._closed_message)
        if _mutants.active("spurious_dead_on_clean_shutdown"):
            err = EngineDeadError()
        self._deliver_failures(self._utilities.fail_all(err, UtilityEvent.CLIENT_SHUTDOWN), err)
        self._wake_waiters(_CLOSED)
        if timeout is not None:
            self.resources.shutdown_timeout = timeout
        try:
            self._finalizer()
        finally:  # also after an interrupt (Ctrl-C), which the teardown raises once done
            self._pending_sends.clear()  # the sockets are closed: libzmq holds what it needs
            self._drop_backlog()

    def _after_fork_in_child(self, parent_pid: int) -> None:
        """This process is a fork's child and this client is its copy of the parent's.

        Everything the client holds is the parent's: the engine process, the ZMQ context
        (libzmq is not fork-safe: a send from here reaches the parent's I/O thread), the
        monitor's pipe, the IPC files. Left as it was, the child's exit ran the teardown
        (stopping the parent's monitor, unlinking its files) and multiprocessing's exit hook
        SIGTERMed the parent's engine, a daemon child it thought its own. So the copy lets
        go of all of it without touching any, and refuses every call. Runs in the child
        with one thread: a lock another thread held at the fork stays held for good, so the
        copy gets a fresh one and nothing else is waited for."""
        self._forked_off = True
        self._finalizer.detach()
        self._state_lock = threading.RLock()
        self._closed_message = (
            f"this client belongs to process {parent_pid}; a forked child cannot use it "
            "(make a new client in the child)")
        if self.lifecycle.state is ClientState.CONSTRUCTING:
            self.lifecycle.fire(ClientEvent.CONSTRUCTION_FAILED)
        elif self.lifecycle.state is not ClientState.SHUTDOWN:
            self.lifecycle.fire(ClientEvent.SHUTDOWN)
        self._requests.clear()
        self._streaming.clear()
        proc = self.resources.proc
        if proc is not None:
            children = getattr(multiprocessing.process, "_children", None)
            if isinstance(children, set):
                children.discard(proc)

    def _abort_left_behind(self) -> None:
        """An attached engine outlives this front end: abort what it still runs for us, so it
        stops spending steps on that before the next front end attaches (which would drop
        it). A launched engine is stopped instead."""
        res = self.resources
        if res.proc is not None or self.is_closed or self.is_dead:
            return
        live = self.live_requests()
        if not live:
            return
        try:
            self._send_abort(live)
        except EngineWireError:  # closed or dead in between: nothing left to stop
            return
        # A close with linger 0 would discard the ABORT if it is still queued; with no
        # engine connected the ROUTER has already dropped it, and nothing waits.
        res.input_linger_ms = _ABORT_LINGER_MS

    def _drop_backlog(self) -> None:
        """After teardown (nothing arrives any more): let go of batches nobody can read now
        (``get_output`` raises once closed), not when the client object goes: an unread
        backlog can be hundreds of MB. The markers that wake readers stay."""
        raise NotImplementedError

    # -- sending ------------------------------------------------------------------------------

    def _send(self, kind: RequestType, obj: object) -> None:
        self.ensure_alive()
        res = self.resources
        with res.send_lock:
            sock = res.input_socket
            if sock is None:
                raise ClientClosedError(self._closed_message)
            frames = encode_input(self._encoder, kind, obj)
            # The engine refuses a frame over its max_frame_bytes by dropping the connection
            # (security.py), which loses what else was in flight: refuse it here instead.
            check_sendable(kind, frames, self._security[4] or DEFAULT_LIMITS)
            if self._integrity is not None:
                frames = [*frames, self._integrity.seal(frames)]
            if len(frames) == 1 or (len(frames) == 2 and self._integrity is not None):
                # Plain copying sends (the message, or it and its trailer): cheaper than
                # send_multipart for these small frames.
                send = self._sock_send
                try:
                    send(sock, self.identity, ZMQ_SNDMORE)
                    if len(frames) == 2:
                        send(sock, frames[0], ZMQ_SNDMORE)
                    send(sock, frames[-1])
                except BaseException:
                    _end_message(sock)
                    raise
                return
            # Aux frames are zero-copy views of the caller's arrays: keep them (and their
            # trackers) until libzmq is done, so the memory outlives the send.
            pending = self._pending_sends
            self._reclaim_sends()
            trackers = []
            last = len(frames) - 1
            try:
                sock.send(self.identity, zmq.SNDMORE)
                for i, frame in enumerate(frames):
                    flags = zmq.SNDMORE if i < last else 0
                    trackers.append(sock.send(frame, flags, copy=False, track=True))
            except BaseException:
                _end_message(sock)
                raise
            pending.append((trackers, frames))

    def _reclaim_sends(self) -> None:
        """Drop the arrays of multi-frame sends libzmq is done with. Also run when reading
        outputs, so the last big request's memory is not pinned until the next one."""
        pending = self._pending_sends
        while pending and all(t.done for t in pending[0][0]):
            pending.popleft()

    def _send_call(self, request: UtilityRequest) -> bool:
        """``_send`` of a utility call in fewer steps; False (nothing sent) when the call
        needs the general path: arrays or values only the full encoder handles, a frame over
        the engine's limit, frame integrity."""
        if self._integrity is not None:
            return False
        try:
            payload = _UTILITY_BYTE + self._call_encoder.encode(request)
        except Exception:
            return False
        if len(payload) > self._call_limit:
            return False
        res = self.resources
        with res.send_lock:
            sock = res.input_socket
            if sock is None:
                raise ClientClosedError(self._closed_message)
            send = self._sock_send
            try:
                send(sock, self.identity, ZMQ_SNDMORE)
                send(sock, payload)
            except BaseException:
                _end_message(sock)
                raise
        return True

    def send_raw_frames(self, frames: list[bytes]) -> None:
        """Send ``[identity, *frames]`` unchecked: for conformance tests that inject
        malformed input on the wire."""
        self.ensure_alive()
        with self.resources.send_lock:
            sock = self.resources.input_socket
            if sock is None:
                raise ClientClosedError(self._closed_message)
            sock.send_multipart([self.identity, *frames])

    def _send_add(self, request: EngineCoreRequest) -> None:
        if not isinstance(request, EngineCoreRequest):
            raise TypeError(f"add_request expects an EngineCoreRequest, got {type(request)!r}")
        if request.client_index != self.client_index:
            request = msgspec.structs.replace(request, client_index=self.client_index)
        self._track_add(request)
        with _SigintHold():  # raised after the except below: the ADD went out whole
            try:
                self._send(RequestType.ADD, request)
            except BaseException:
                self._untrack_add(request.request_id)
                raise

    def _send_abort(self, request_ids: list[str]) -> None:
        ids = check_request_ids(request_ids)
        if self.is_closed:
            raise ClientClosedError(self._closed_message)
        # On a dead engine an abort is a silent no-op: error paths must not raise twice.
        if not ids or self.is_dead:
            return
        ids = self._track_abort(ids)
        # In messages the engine takes (Limits.max_batch ids each): a longer list used to be
        # refused whole by the engine, so a live request in it never got its ABORT.
        step = (self._security[4] or DEFAULT_LIMITS).max_batch
        try:
            for i in range(0, len(ids), step):
                self._send(RequestType.ABORT, ids[i:i + step])
        except EngineDeadError:
            pass

    def _register_call(self, future: Any, method: str, args: tuple[Any, ...]) -> int:
        check_method(method)
        check_no_dataclass(args)
        self.ensure_alive()
        call_id = self._utilities.new_id()
        try:
            self._utilities.register(call_id, future, method)
            request = UtilityRequest(self.client_index, call_id, method, list(args))
            if not self._send_call(request):
                self._send(RequestType.UTILITY, request)
        except BaseException:
            event = UtilityEvent.ENGINE_DIED if self.is_dead else UtilityEvent.CLIENT_SHUTDOWN
            self._utilities.withdraw(call_id, event)
            raise
        return call_id

    # -- receiving (shared by the thread and the task) -----------------------------------------

    def _on_frames(self, frames: list[Any]) -> EngineCoreOutputs | None:
        """Decode one message; route utility replies; return a batch worth queueing."""
        if self._stamp_seen:
            self.resources.last_seen[0] = time.monotonic()
        # One frame and no integrity trailer is the common shape (every reply, every batch
        # without arrays): it is checked and decoded in fewer steps.
        single = len(frames) == 1 and self._integrity is None
        if frames[0] == ENGINE_DEAD_SENTINEL if single else is_dead_sentinel(frames):
            raise EngineProcessDied(
                "the engine said it is gone (engine-dead sentinel: a fatal error, or an engine"
                " started on its own stopped by a signal); see the engine's log")
        if single:
            outputs = self._out_decoder.decode_payload(frames[0])
        else:
            if self._integrity is not None:
                frames = self._integrity.open(frames)
            outputs = decode_outputs(frames)
        if outputs.utility_output is not None:
            self._utilities.settle(outputs.utility_output)
            return None
        if (outputs.outputs or outputs.stream_ids or outputs.finished_requests
                or outputs.scheduler_stats):
            return outputs
        if outputs.refusal is not None:
            # After the marker a refusal ends the session (its input failed the engine's
            # integrity check): the engine dropped this front end's work and ignores it, so
            # taking it for a heartbeat would leave every call waiting. Tested only on a
            # message with nothing else in it: no cost to batches and replies.
            raise ProtocolError(f"the engine ended this session: {outputs.refusal}")
        return None  # heartbeat

    def _on_message(self, first: bytes, sock: zmq.Socket[Any]) -> EngineCoreOutputs | None:
        """``_on_frames`` for a message whose first frame was received as plain bytes.

        A plain receive costs 1.6 µs less than one that yields a ``Frame`` and its more
        flag, and nearly every message is one frame. So the rest of a message is read only
        when there is a rest: when a one-frame decode fails (it referenced aux frames) and
        libzmq's more flag says parts follow, or under frame integrity, whose trailer always
        follows. A part that a one-frame message should not have arrives as a message of its
        own and fails to decode there: the engine is then declared dead, as for any frame
        that does not decode."""
        if self._attaching is not None:
            self._before_marker(first, sock)
            return None
        if self._integrity is None:
            if len(first) <= _PLAIN_REPLY_BYTES:
                # A utility reply, the round trip's own message, in the fewest steps: it
                # carries nothing for the post-check to bound (no outputs, stream ids or
                # finished ids). Anything else (a batch, the sentinel, a frame that does not
                # decode) takes the general path.
                try:
                    outputs = self._decode_reply(first)
                except Exception:
                    outputs = None
                if (outputs is not None and outputs.utility_output is not None
                        and not outputs.outputs and not outputs.stream_ids
                        and not outputs.finished_requests):
                    if self._stamp_seen:
                        self.resources.last_seen[0] = time.monotonic()
                    self._utilities.settle(outputs.utility_output)
                    return None
            try:
                return self._on_frames([first])
            except ProtocolError:
                if not sock.get(ZMQ_RCVMORE):
                    raise
        elif not sock.get(ZMQ_RCVMORE):
            return self._on_frames([first])  # no trailer: integrity reports it
        return self._on_frames(recv_rest(sock, [first], _MAX_PARTS))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} engine pid={self.engine_pid} {self.lifecycle.state.name}>"


# --- sync ------------------------------------------------------------------------------------


def _route(
    first: bytes,
    sock: zmq.Socket[Any],
    client_ref: weakref.ReferenceType[Any],
    put: Callable[[Any], None],
) -> bool:
    """Route one message (its first frame received; a utility reply resolved, a batch
    ``put``); False once nothing more should be read (engine death seen, client gone)."""
    client = client_ref()
    if client is None:
        return False
    try:
        batch = client._on_message(first, sock)
    except Exception as e:  # sentinel or undecodable frame: the engine is unusable
        client._on_engine_dead(e)
        return False
    if batch is not None:
        put(batch)
    return True


class _SyncCall:
    """The outcome of one blocking utility call on a ``SyncMPClient``.

    What a ``concurrent.futures.Future`` would do, without its lock and condition: the caller
    waits through the ``_SyncReader`` (its ``cv`` is notified after everything it routes, and
    on death or close), and the registry hands each entry to exactly one setter (the entry
    leaves the registry under its lock first). Saves a few microseconds per round trip.
    """

    __slots__ = ("_done", "_error", "_result")

    def __init__(self) -> None:
        self._done = False
        self._error: BaseException | None = None
        self._result: Any = None

    def done(self) -> bool:
        return self._done

    def set_result(self, result: Any) -> None:
        if self._done:
            raise concurrent.futures.InvalidStateError("outcome already set")
        self._result = result
        self._done = True  # last: a reader that sees it done sees the outcome

    def set_exception(self, error: BaseException) -> None:
        if self._done:
            raise concurrent.futures.InvalidStateError("outcome already set")
        self._error = error
        self._done = True

    def result(self) -> Any:
        if not self._done:
            raise RuntimeError("utility call outcome read before it was set")
        if self._error is not None:
            raise self._error
        return self._result


class _SyncReader:
    """Reads the output socket of a ``SyncMPClient``; whoever is waiting does the reading.

    A caller blocked in ``get_output`` or ``call_utility`` receives on the PULL socket itself,
    so a reply reaches the thread that wants it without a hand-off through another thread (one
    wake-up less per round trip). Replies for other waiters are routed on the way (utility
    futures resolved, batches queued) and the waiters woken. When no caller has read for one
    to two ``IDLE_TAKEOVER_S``, the background thread takes the socket so heartbeats, the
    dead sentinel and unread batches are still consumed. The socket changes hands only under
    ``cv`` (zmq needs a full memory barrier between users).

    A reader blocks in a plain receive, not a poll: a poll and the readiness check after it
    cost more than the receive itself, and the round trip runs that code cold. To interrupt a
    receive (a caller wants the socket, death, close), a local PUSH connected to the same PULL
    sends a wake token: 16 random bytes per reader, which nothing the engine sends can equal
    by chance.
    """

    IDLE_TAKEOVER_S = 0.05

    def __init__(self, client: SyncMPClient, out: zmq.Socket[Any], ctx: zmq.Context[Any]
                 ) -> None:
        self._client_ref = weakref.ref(client)
        self._outputs = client._outputs
        self._out = out
        # ``with self._lock`` where a round trip takes it: a Condition's own ``with`` runs two
        # Python-level methods around the lock's (0.8 µs against 0.3 warm).
        self._lock = threading.RLock()
        self.cv = threading.Condition(self._lock)
        # The background thread waits on its own condition (same lock): callers coming and
        # going must not wake it on every call; it re-checks on its idle timer instead.
        self._bg_cv = threading.Condition(self._lock)
        self._reading = False  # someone holds the socket (guarded by cv)
        self._holder = 0  # that thread's ident
        self._bg_reading = False
        self._kicked = False
        self._callers = 0
        self._waiting: set[int] = set()  # the threads counted in _callers
        self._bg_idle_checks = 0  # background's idle looks in a row with callers but no reads
        # Counts callers' reads (a counter, not a clock: this is on the round trip's path).
        self._caller_reads = 0
        self._closing = False
        self._stopped = False  # death seen on the wire: nothing more is read
        self._rcvtimeo = -1  # the socket's RCVTIMEO as last set (ms; -1 blocks)
        self._token = os.urandom(16)
        address = f"inproc://enginewire-wake-{self._token.hex()}"
        out.bind(address)
        # Used only under ``cv``: that serializes the sends of every thread that wakes.
        self._waker: zmq.Socket[Any] | None = ctx.socket(zmq.PUSH)
        self._waker.setsockopt(zmq.LINGER, 0)
        self._waker.connect(address)
        self.thread = threading.Thread(target=self._background, name="EngineCoreOutputReader",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    # -- waking -------------------------------------------------------------------------------

    def _kick_locked(self) -> None:
        if self._waker is not None:
            try:
                self._waker.send(self._token, ZMQ_NOBLOCK)
            except zmq.Again:
                pass  # the pipe is full: a wake-up is already pending

    def wake(self) -> None:
        """Interrupt a receive and wake every waiter (death, close, new marker)."""
        with self.cv:
            self._kick_locked()
            self.cv.notify_all()

    # -- reading ------------------------------------------------------------------------------

    def _pump(self, timeout_ms: int | None) -> None:
        """Receive one message within ``timeout_ms`` and route it (a wake token is dropped).
        The caller holds the socket (``_reading``), not ``cv``."""
        out = self._out
        ms = -1 if timeout_ms is None else timeout_ms
        if ms != self._rcvtimeo:
            out.setsockopt(zmq.RCVTIMEO, ms)
            self._rcvtimeo = ms
        try:
            first = out.recv()
        except zmq.Again:
            return
        if first == self._token:
            return
        client = self._client_ref()
        if client is None:
            self._stopped = True
            return
        try:
            batch = client._on_message(first, out)
        except Exception as e:  # sentinel or undecodable frame: the engine is unusable
            self._stopped = True
            client._on_engine_dead(e)
            return
        if batch is not None:
            self._outputs.put(batch)

    def wait_for(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Read (or wait for whoever reads) until ``ready()`` or ``timeout``; ``ready()``.

        Even with no time left, a caller reads once if the socket is free, so polling with
        ``timeout=0`` sees what has already arrived. ``cv`` is held except while polling:
        giving the socket back and checking ``ready()`` is one acquisition, not three.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        cv = self.cv
        pumped = holding = False
        counted = False
        self._drop_leaked_levels()
        # Acquired inside the try: an exception raised into this thread (Ctrl-C) can land as
        # soon as acquire() returns, and the finally must then release what it took.
        try:
            cv.acquire()
            self._reclaim_stale()
            self._callers += 1
            self._waiting.add(threading.get_ident())
            counted = True
            while True:
                if holding:
                    holding = False
                    self._give_back(caller=True)
                if ready():
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                expired = remaining is not None and remaining <= 0
                if expired and (pumped or self._reading or self._closing or self._stopped):
                    return False
                if self._closing or self._stopped:
                    # Nothing more is read; the death/close path resolves and notifies.
                    cv.wait(0.1 if remaining is None else min(remaining, 0.1))
                    continue
                if self._reading:
                    if self._bg_reading and not self._kicked:
                        self._kicked = True
                        self._kick_locked()
                    cv.wait(None if remaining is None else min(remaining, MAX_WAIT_SLICE_S))
                    continue
                self._reading = holding = True
                self._holder = threading.get_ident()
                if remaining is None:
                    timeout_ms: int | None = None
                else:
                    timeout_ms = 0 if expired else max(
                        1, int(min(remaining, MAX_WAIT_SLICE_S) * 1000 + 0.999))
                cv.release()
                try:
                    self._pump(timeout_ms)
                    pumped = True
                finally:
                    cv.acquire()
        finally:
            # An exception raised into this thread (Ctrl-C) can leave Condition.wait before
            # it took the lock back: take it, the bookkeeping below needs it.
            if not self._lock._is_owned():  # type: ignore[attr-defined]
                cv.acquire()
            try:
                # Plain stores first: such an exception lands at Python calls, and must not
                # leave the socket marked as held.
                if holding:
                    self._reading = self._bg_reading = False
                if counted:
                    self._callers -= 1
                    self._waiting.discard(threading.get_ident())
                if holding:
                    self._give_back(caller=True)
                if cv._waiters:  # type: ignore[attr-defined]
                    cv.notify_all()
            finally:
                cv.release()  # even if the wake-ups above were interrupted

    def wait_call(self, call: _SyncCall) -> None:
        """``wait_for(call.done, None)`` in fewer steps for the common case: the socket is
        free and nobody else waits, so this caller reads until its outcome is set. Any other
        case (a reader or waiter already there or arriving, close, death) takes
        ``wait_for``."""
        cv, lock = self.cv, self._lock
        me = threading.get_ident()
        self._drop_leaked_levels()
        with lock:
            self._reclaim_stale()
            if self._reading or self._callers or self._closing or self._stopped:
                solo = False
            else:
                solo = True
                self._callers = 1
                self._waiting.add(me)
                self._reading = True
                self._holder = me
        if not solo:
            self.wait_for(call.done, None)
            return
        waiters = cv._waiters  # type: ignore[attr-defined]
        try:
            while not call._done and not self._closing and not self._stopped:
                self._pump(None)
                if waiters:
                    break  # another thread waits: share the socket as ``wait_for`` does
        finally:
            with lock:
                self._reading = self._bg_reading = False  # plain stores first (see wait_for)
                self._callers -= 1
                self._waiting.discard(me)
                self._give_back(caller=True)
        if not call._done:
            self.wait_for(call.done, None)  # shared, closing or dead: wait there

    def _drop_leaked_levels(self) -> None:
        """A caller never holds ``cv`` between calls: levels this thread holds on entry were
        left by a call that an exception (Ctrl-C) interrupted right after an acquire, and
        they would lock the background reader out. Release them. Python cannot mask such
        exceptions, so the reader repairs what they leave at the next call and at close."""
        lock = self._lock
        while lock._is_owned():  # type: ignore[attr-defined]
            lock.release()

    def _reclaim_stale(self) -> None:
        """A thread starting a wait cannot already hold the socket: if the socket is marked
        as held by it, an exception (Ctrl-C) interrupted its last call before the mark was
        cleared; clear it. Caller holds ``cv``."""
        me = threading.get_ident()
        if self._reading and self._holder == me:
            self._reading = self._bg_reading = False
        if me in self._waiting:  # counted by a call that never got to uncount itself
            self._waiting.discard(me)
            self._callers -= 1

    def _give_back(self, *, caller: bool) -> None:
        """The reader is done with the socket; wake whoever waits (their outcome may have
        been routed). Caller holds ``cv``."""
        self._reading = False
        self._bg_reading = False
        if caller:
            self._caller_reads += 1
        if self.cv._waiters:  # type: ignore[attr-defined]
            self.cv.notify_all()

    def _background(self) -> None:
        cv = self.cv
        seen = 0  # callers' reads as of the last look: none since means idle
        try:
            while True:
                with cv:
                    while True:
                        if self._closing or self._stopped:
                            return
                        # Callers that read keep the socket; none read for a whole idle
                        # period means none will (a caller count left behind by an
                        # interrupted call must not stop the reading for good).
                        if not self._reading and self._caller_reads == seen and (
                                not self._callers or self._bg_idle_checks >= 2):
                            self._bg_idle_checks = 0
                            break
                        if self._caller_reads == seen and not self._reading:
                            self._bg_idle_checks += 1
                        else:
                            self._bg_idle_checks = 0
                        seen = self._caller_reads
                        self._bg_cv.wait(self.IDLE_TAKEOVER_S)
                    self._reading = self._bg_reading = True
                    self._holder = threading.get_ident()
                    self._kicked = False
                try:
                    self._pump(None)
                finally:
                    with cv:
                        self._give_back(caller=False)
        except Exception as e:
            self._stopped = True
            client = self._client_ref()
            if client is not None:
                client._on_engine_dead(e)

    def close(self, timeout: float = 5.0) -> None:
        """Stop reading, wait (bounded) for the socket to be free, close it and the pipe."""
        self._drop_leaked_levels()
        with self.cv:
            self._reclaim_stale()
            self._closing = True
            self._kick_locked()
            self.cv.notify_all()
            self._bg_cv.notify_all()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)
            if self.thread.is_alive():
                logger.warning("output reader thread did not exit")
        deadline = time.monotonic() + timeout
        with self.cv:
            me = threading.get_ident()
            while self._reading and self._holder != me and time.monotonic() < deadline:
                self._kick_locked()
                self.cv.wait(0.05)
            if self._reading and self._holder != me:
                logger.warning("a caller still reads the output socket; closing it anyway")
            self._out.close(linger=0)
            if self._waker is not None:
                self._waker.close(linger=0)
                self._waker = None


class SyncMPClient(SyncClientMixin, MPClient):
    """Blocking client: a reader thread feeds a ``queue.Queue`` that ``get_output`` reads."""

    def __init__(self, config: Any, **options: Any) -> None:
        self._outputs: queue.Queue[Any] = self._new_output_queue()
        self._reader: _SyncReader | None = None
        super().__init__(config, **options)

    def _new_output_queue(self) -> queue.Queue[Any]:
        """The queue batches and markers go to (a data-parallel member's also wakes the
        client that reads every member: dp_client.py)."""
        return queue.Queue()

    def _start_reader(self) -> None:
        res = self.resources
        assert res.ctx is not None and res.output_socket is not None
        out, res.output_socket = res.output_socket, None  # ownership moves to the reader
        reader = _SyncReader(self, out, res.ctx)
        res.sync_reader = self._reader = reader
        reader.start()

    def _wake_waiters(self, marker: object) -> None:
        if marker is _DEAD and _mutants.active("sync_get_output_not_woken_on_kill"):
            return
        self._outputs.put(marker)
        reader = self._reader
        if reader is not None:
            reader.wake()

    def _drop_backlog(self) -> None:
        q = self._outputs
        with q.mutex:  # atomically: a reader never finds it empty in between
            kept = [x for x in q.queue if x is _DEAD or x is _CLOSED]
            q.queue.clear()
            q.queue.extend(kept)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send_add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send_abort(request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """Next batch; an empty batch if ``timeout`` passes first. Outputs queued before a
        death are still delivered, then ``EngineDeadError``."""
        timeout = check_timeout(timeout)
        if self.is_closed:
            raise ClientClosedError(self._closed_message)
        if self._pending_sends:
            with self.resources.send_lock:
                self._reclaim_sends()
        outputs = self._outputs
        if self._redeliver:
            with self._state_lock:
                if self._redeliver:
                    return self._redeliver.popleft()
        reader = self._reader
        if reader is not None and not self.is_dead and outputs.empty():
            reader.wait_for(lambda: not outputs.empty(), timeout)
        # A Ctrl-C between taking a batch and returning it would lose the batch and leave
        # its requests live for good: held past the return value, then the batch is kept
        # for the next call.
        hold = _SigintHold()
        hold.__enter__()
        out = None
        try:
            out = self._take_output()
        finally:
            try:
                hold.__exit__()
            except KeyboardInterrupt:
                if out is not None:  # an empty one too: the caller sees what it missed
                    self._redeliver.append(out)
                raise
        return out

    def _take_output(self) -> EngineCoreOutputs:
        outputs = self._outputs
        # Dequeue and track as one step: concurrent callers then track batches in queue
        # order (tracking batch N+1 before batch N would break the request lifecycles).
        with self._state_lock:
            try:
                item = outputs.get_nowait()
            except queue.Empty:
                item = None
            else:
                if item is not _DEAD and item is not _CLOSED:
                    self._track_outputs(item)
        if item is None:
            if self.is_dead:
                raise self._dead_error()
            return EngineCoreOutputs()
        if item is _DEAD or item is _CLOSED:
            self._outputs.put(item)  # wake the next waiter too
            if item is _CLOSED or self.is_closed:
                raise ClientClosedError(self._closed_message)
            raise self._dead_error()
        out: EngineCoreOutputs = item.expanded()
        return out

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        timeout = check_timeout(timeout)
        reader = self._reader
        if reader is None:  # construction has not reached the reader: nothing would answer
            raise ClientClosedError("the client is not running (its construction did not"
                                    " complete)")
        call = _SyncCall()
        call_id = self._register_call(call, method, args)
        try:
            if timeout is None:
                reader.wait_call(call)
            elif not reader.wait_for(call.done, timeout):
                if self._utilities.give_up(call_id, UtilityEvent.TIMEOUT):
                    assert timeout is not None
                    raise UtilityTimeoutError(method, timeout) from None
                # The outcome won the race: its entry is gone and its setter is about to set
                # it (and then wakes the reader's waiters).
                reader.wait_for(call.done, None)
        except BaseException:
            # Interrupted (Ctrl-C): nobody waits for this call any more; its entry goes, and a
            # late reply is dropped like any late reply.
            self._utilities.give_up(call_id, UtilityEvent.CANCEL)
            raise
        return call.result()


# --- async -----------------------------------------------------------------------------------


class AsyncMPClient(AsyncUtilityMethods, MPClient):
    """asyncio client: a reader task feeds an ``asyncio.Queue``; utilities are asyncio futures.

    It may be built outside a running loop: the reader task then starts on first use.
    """

    def __init__(self, config: Any, **options: Any) -> None:
        self._outputs: asyncio.Queue[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        super().__init__(config, **options)

    def _make_output_socket(self, ctx: zmq.Context[Any]) -> Any:
        # A plain socket read from a loop callback on its FD: no zmq.asyncio futures and no
        # reader task between a reply and the coroutine awaiting it.
        sock = ctx.socket(zmq.PULL)
        self.resources.async_output_socket = sock
        return sock

    def _start_reader(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # lazily, on first use inside a loop
        self._ensure_reader()

    def _ensure_reader(self) -> None:
        loop = asyncio.get_running_loop()
        bound = self._loop
        if bound is loop:
            return
        if self._forked_off:  # its socket is the parent's: reading it here spins for good
            raise ClientClosedError(self._closed_message)
        if bound is not None:
            if not bound.is_closed():
                self.ensure_alive()  # a closed or dead client says so, whatever the loop
                raise RuntimeError(
                    "an AsyncMPClient is bound to the event loop it first ran on (its reader"
                    " and futures live there) while that loop is open; make one client per"
                    " event loop")
            if self.is_closed:
                raise ClientClosedError(self._closed_message)
            # Its loop is closed (an ``asyncio.run`` ended): nothing can run or wait there
            # any more, so the client moves to this one (a second ``asyncio.run``, a test
            # framework's loop per test). A dead client moves too: the batches that came
            # before the death are still read, then EngineDeadError, as on one loop.
            self._leave_closed_loop()
        self._bind(loop)

    def _leave_closed_loop(self) -> None:
        # A call still registered belongs to a task that can never resume: given up, so its
        # reply is dropped here instead of being set on a future of the closed loop (which
        # raises, and the reader would take that for a broken engine).
        utilities = self._utilities
        for call_id in list(utilities._pending):
            utilities.give_up(call_id, UtilityEvent.CANCEL)
        self._loop = None

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        res = self.resources
        sock = res.async_output_socket
        if sock is None:
            raise ClientClosedError(self._closed_message)
        # Batches and markers queued on a closed loop's queue are carried over unread.
        kept = _drain(self._outputs) if self._outputs is not None else []
        outputs = self._outputs = self._new_output_queue()
        for x in kept:
            outputs.put_nowait(x)
        self._loop = loop
        res.reader_loop = loop
        fd = res.reader_fd = cast(int, sock.get(zmq.FD))
        ref, put = weakref.ref(self), outputs.put_nowait

        def on_readable() -> None:
            # One message per callback. The FD is edge-triggered, so the socket must be
            # read until it is empty before the loop waits again; the next read is a
            # callback of its own, queued after whatever this message woke (the caller
            # of a reply runs first and sends its next request before it).
            if res.async_output_socket is not sock:
                return  # closed
            try:
                first = sock.recv(ZMQ_NOBLOCK)
            except zmq.Again:
                return  # empty: the FD is re-armed
            except Exception as e:  # the socket itself failed: the link is unusable
                more = False
                client = ref()
                if client is not None:
                    client._on_engine_dead(e)
            else:
                more = _route(first, sock, ref, put)
            if more:
                loop.call_soon(drain)
            else:
                loop.remove_reader(fd)

        poll, items = zmq.zmq_poll, [(sock, ZMQ_POLLIN)]

        def drain() -> None:
            # Is another message waiting? Usually not: a poll answers that for a fifth of
            # a receive that fails with zmq.Again (that exception costs about 9 µs).
            if res.async_output_socket is not sock:
                return
            try:
                ready = bool(poll(items, 0))
            except Exception:
                ready = True  # let the receive meet the failure and report it
            if ready:
                on_readable()

        # Drain what arrived before the reader existed.
        loop.add_reader(fd, on_readable)
        on_readable()
        if self.is_dead and not any(x is _DEAD for x in kept):
            outputs.put_nowait(_DEAD)

    def _new_output_queue(self) -> asyncio.Queue[Any]:
        """See ``SyncMPClient._new_output_queue``; made on the loop the reader binds to."""
        return asyncio.Queue()

    def _wake_waiters(self, marker: object) -> None:
        self._call_on_loop(lambda: self._outputs.put_nowait(marker) if self._outputs else None)

    def _drop_backlog(self) -> None:
        q = self._outputs
        if q is None:
            return

        def drop() -> None:  # on the loop: an asyncio.Queue is not thread-safe
            kept = [x for x in _drain(q) if x is _DEAD or x is _CLOSED]
            for x in kept:
                q.put_nowait(x)

        loop = self._loop
        if loop is not None and loop.is_running():
            self._call_on_loop(drop)
        else:
            drop()  # no loop runs it: nothing else touches the queue

    def _deliver_failures(self, futures: list[Any], err: BaseException) -> None:
        if futures:
            def fail() -> None:
                for f in futures:
                    _set_future(f, err, None)

            self._call_on_loop(fail)

    def _call_on_loop(self, fn: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            fn()
            return
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:
            pass  # loop closed: nobody is waiting on it any more

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_reader()
        self._send_add(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._send_abort(request_ids)

    async def get_output_async(self, timeout: float | None = None) -> EngineCoreOutputs:
        """Next batch; an empty batch if ``timeout`` passes first (see ``SyncMPClient``)."""
        timeout = check_timeout(timeout)
        out = self._output_nowait()
        if out is not None:
            return out
        q = self._outputs
        assert q is not None
        # The wait runs in this task (asyncio.timeout, not wait_for's inner task): the batch
        # this caller dequeues is the one it tracks next, so concurrent callers track batches
        # in queue order, and a zero timeout still takes what is already queued.
        if timeout is None:
            item = await q.get()
        elif timeout <= 0:
            return EngineCoreOutputs()
        else:
            try:
                async with asyncio.timeout(timeout):
                    item = await q.get()
            except TimeoutError:
                return EngineCoreOutputs()
        return self._accept(item)

    def _output_nowait(self) -> EngineCoreOutputs | None:
        """What ``get_output_async`` returns without waiting: a batch already queued (or
        tracked for redelivery), the error of a closed or dead client, or None. On the loop."""
        if self.is_closed:
            raise ClientClosedError(self._closed_message)
        if self._pending_sends:
            with self.resources.send_lock:
                self._reclaim_sends()
        self._ensure_reader()
        q = self._outputs
        assert q is not None
        if self._redeliver:  # tracked already (see _track_outputs), and before any death
            return self._redeliver.popleft()
        if q.empty():
            if self.is_dead:
                raise self._dead_error()
            return None
        return self._accept(q.get_nowait())

    def _accept(self, item: Any) -> EngineCoreOutputs:
        """A dequeued item as ``get_output_async`` returns it: a batch tracked, or a marker's
        error (the marker stays queued for the next waiter)."""
        if item is _DEAD or item is _CLOSED:
            assert self._outputs is not None
            self._outputs.put_nowait(item)
            if item is _CLOSED or self.is_closed:
                raise ClientClosedError(self._closed_message)
            raise self._dead_error()
        self._track_outputs(item)
        out: EngineCoreOutputs = item.expanded()
        return out

    async def call_utility_async(
        self, method: str, *args: Any, timeout: float | None = None
    ) -> Any:
        timeout = check_timeout(timeout)
        self._ensure_reader()
        assert self._loop is not None
        fut: asyncio.Future[Any] = self._loop.create_future()
        call_id = self._register_call(fut, method, args)
        try:
            if timeout is None:
                return await fut
            # Shielded: a reply that races the deadline must still land in ``fut``. The
            # deadline runs in this task (asyncio.timeout, not wait_for): Python 3.11's
            # wait_for returns a result that is in when its task is cancelled, and the
            # cancellation (a TaskGroup's, an outer timeout's) is lost.
            async with asyncio.timeout(timeout):
                return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not self._utilities.give_up(call_id, UtilityEvent.CANCEL):
                # Its outcome (a reply, a death, a shutdown) is already on its way to ``fut``,
                # which nobody awaits now: retrieve it so asyncio does not log it as lost.
                fut.add_done_callback(_retrieve)
            raise
        except TimeoutError:
            if self._utilities.give_up(call_id, UtilityEvent.TIMEOUT):
                assert timeout is not None
                raise UtilityTimeoutError(method, timeout) from None
        # The outcome won the race: its entry is gone and its setter is about to set it.
        return await fut

    async def call_utility_all_async(
        self, method: str, *args: Any, timeout: float | None = None
    ) -> list[Any]:
        """See ``SyncClientMixin.call_utility_all``: this client has one engine."""
        return [await self.call_utility_async(method, *args, timeout=timeout)]

    async def shutdown_async(self, timeout: float | None = None) -> None:
        """``shutdown`` off the event loop's thread: the engine's grace period (and the joins)
        must not stall every other task on the loop."""
        await asyncio.to_thread(self.shutdown, timeout)

    async def __aenter__(self) -> AsyncMPClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown_async()  # the teardown must not stall the loop's other tasks
