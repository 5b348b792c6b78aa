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

The two clients differ only in how a caller waits: ``SyncMPClient`` (sync_mp_client.py) blocks
its thread on the reader, ``AsyncMPClient`` (async_mp_client.py) awaits an asyncio queue or
future. Every other step of ``get_output`` (the closed error, redelivery, a marker's error) and
of ``call_utility`` (the checks, the registration, the timeout and its race with a reply, the
cancel) is written once, here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import zmq

from ..protocol.codec import (
    DEFAULT_LIMITS,
    Decoder,
    Encoder,
    check_no_dataclass,
    check_sendable,
    decode_outputs,
    decode_ready,
    encode_input,
    is_dead_sentinel,
)
from ..protocol.messages import (
    ENGINE_DEAD_SENTINEL,
    AttachRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    UtilityRequest,
)
from ..spec.attach import ATTACH, AttachEvent, AttachState
from ..spec.client import ClientEvent, ClientState
from ..spec.errors import (
    ClientClosedError,
    EngineDeadError,
    EngineStartupError,
    EngineWireError,
    ProtocolError,
    UtilityTimeoutError,
)
from ..spec.machine import Lifecycle, TraceEntry
from ..spec.utility import UtilityEvent
from ._attach_side import MAX_PARTS, AttachSide
from ._background import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    BackgroundResources,
    EngineProcessDied,
    SigintHold,
    describe_exit,
    end_message,
    file_id,
    monitor_engine,
)
from ._registry import UtilityRegistry, set_future
from .args import (
    check_method,
    check_request_ids,
    check_timeout,
)
from .client import EngineCoreClient
from .engine_launch import EngineSubprocess, StartupReport, launch_engine_process
from .integrity import DEFAULT_LOSS_DEADLINE_S, LinkIntegrity
from .ipc import IpcDir
from .options import DEFAULT_READY_TIMEOUT_S, READY_TIMEOUT_ENV, ClientOptions
from .security import (
    CurveConfig,
    TransportGuard,
    check_transport,
    local_engine_pair,
    restrict_ipc_socket,
)
from .zmq_io import ZMQ_RCVMORE, ZMQ_SNDMORE, backend_send, recv_rest

__all__ = [
    "DEFAULT_READY_TIMEOUT_S",
    "READY_TIMEOUT_ENV",
    "BackgroundResources",
    "MPClient",
]


logger = logging.getLogger(__name__)

_UTILITY_BYTE = RequestType.UTILITY.value
# Longest a shutdown waits for libzmq to hand an attached engine the ABORT of what it runs.
_ABORT_LINGER_MS = 1000


# Messages up to this size take one unchecked decode first (``MPClient._short_decodes``).
_PLAIN_REPLY_BYTES = 1 << 16
DEAD_MARKER = object()  # output-queue marker: the engine died
CLOSED_MARKER = object()  # output-queue marker: the client was shut down


def _said_gone() -> EngineProcessDied:
    return EngineProcessDied(
        "the engine said it is gone (engine-dead sentinel: a fatal error, or an engine"
        " started on its own stopped by a signal); see the engine's log")


def only_markers(items: Any) -> list[Any]:
    """What a backlog keeps once nobody can read its batches (``_drop_backlog``): the
    markers, which still wake readers."""
    return [x for x in items if x is DEAD_MARKER or x is CLOSED_MARKER]


# The ready handshake is a few hundred bytes; anything near this is not one.
_MAX_HANDSHAKE_BYTES = 1 << 20


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
    """The default launcher: the engine as a program of its own on this host (not a fork:
    unsafe once CUDA is up; not multiprocessing's spawn: it re-imports the user's script)."""
    return launch_engine_process(config_type, config, kwargs, name)


_CLIENTS: weakref.WeakSet[MPClient] = weakref.WeakSet()


def _fork_child_hook() -> None:
    parent = os.getppid()
    for client in list(_CLIENTS):
        client._after_fork_in_child(parent)


os.register_at_fork(after_in_child=_fork_child_hook)


# --- MPClient --------------------------------------------------------------------------------


class MPClient(AttachSide, EngineCoreClient):
    """Shared by the sync and async clients: launch, handshake, monitor, registry, teardown,
    and every step of ``get_output`` and ``call_utility`` but the wait (see "the two clients'
    calls" below)."""

    multiprocess = True
    # Batches and the two markers, as the reader routes them: a ``queue.Queue`` (sync) or an
    # ``asyncio.Queue`` made on the loop the reader binds to (async; None until then).
    _outputs: Any
    # Set by the owner of a client still being built (a data-parallel client shutting down
    # while it restarts an engine): the ready wait gives up within a poll slice.
    _abandon: threading.Event | None = None

    def __init__(
        self,
        config: Any,
        *,
        trace: list[TraceEntry] | None = None,
        options: ClientOptions | None = None,
        **kwargs: Any,
    ) -> None:
        """``options`` (runtime/options.py), each of its fields also a keyword (keywords
        override it); all checked before anything is created."""
        opts = ClientOptions.of(options, kwargs)
        self.options = opts
        self._columnar = opts.columnar_outputs
        ready_timeout = opts.ready_timeout
        self._ready_timeout = ready_timeout
        engine_index, client_index = opts.engine_index, opts.client_index
        engine_heartbeat_timeout_s = opts.engine_heartbeat_timeout_s
        engine_limits = opts.engine_limits
        self._launcher = opts.engine_launcher
        super().__init__(config, trace=trace)
        # Read by _start (security.py): transport, keys, and the engine's input bounds.
        self._security = (opts.transport, opts.curve, opts.engine_curve,
                          opts.allow_insecure_tcp, engine_limits)
        # The largest utility call the plain path sends (the type byte and its payload); a
        # larger one takes the general path, which refuses it naming the bound.
        limits = engine_limits or DEFAULT_LIMITS
        self._call_limit: int = min(limits.max_frame_bytes, 1 + limits.max_call_bytes)
        self.resources = BackgroundResources(shutdown_timeout=opts.shutdown_timeout_s)
        # First thing: whatever fails below, the finalizer reclaims what was created.
        self._finalizer = weakref.finalize(self, self.resources)
        self._forked_off = False
        _CLIENTS.add(self)  # a fork's child must not run this client's teardown
        self.engine_index = engine_index
        self.client_index = client_index
        self.identity = engine_index.to_bytes(2, "little")
        self._utilities = UtilityRegistry(trace)
        self._utilities.power = weakref.WeakMethod(self._on_power_reply)
        # Only a heartbeat deadline reads when the engine was last heard from.
        self._stamp_seen = bool(engine_heartbeat_timeout_s)
        # The attach phase (spec/attach.py), advanced by the reader and, for the deadline,
        # the monitor: both under the lock. ``_attaching`` is the session awaited while the
        # phase drops messages (ATTACH_DROPS_MESSAGES), else None: the reader's one test.
        self.attach_phase: Lifecycle[AttachState, AttachEvent] = ATTACH.lifecycle(trace=trace)
        self._attach_lock = threading.Lock()
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
        self._startup_report: StartupReport | None = None  # while starting
        self._integrity = (
            LinkIntegrity(loss_deadline_s=DEFAULT_LOSS_DEADLINE_S) if opts.frame_integrity
            else None)
        try:
            self._start(
                ready_timeout=ready_timeout,
                input_address=opts.input_address,
                output_address=opts.output_address,
                launch_engine=opts.launch_engine,
                heartbeat_timeout_s=engine_heartbeat_timeout_s,
                heartbeat_interval_s=opts.engine_heartbeat_interval_s,
                startup_delay_s=opts.engine_startup_delay_s,
                fault=opts.engine_fault,
                connect=opts.engine_connect,
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
                    res.bound_ipc_paths.append((path, file_id(os.lstat(path))))

        if launch_engine:
            if heartbeat_timeout_s and heartbeat_interval_s is None:
                # A deadline without beats would declare every idle engine dead.
                heartbeat_interval_s = heartbeat_timeout_s / 4

            # The engine writes why it failed to start here (EngineStartupError says it).
            report_r, report_w = os.pipe()
            self._startup_report = StartupReport(report_r)
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
                os.close(report_w)  # the child has its own copy: EOF once it exits
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
        # Ready once the engine's handshake is in and the ATTACH is out: the watchers start
        # after, so a death they see is a ready client's (DEAD), never a race with the end of
        # construction. A death before the handshake was _wait_ready's (a startup error).
        with self._state_lock:
            self.lifecycle.fire(ClientEvent.HANDSHAKE_OK)

        stop_r, stop_w = os.pipe()
        res.monitor_pipe = (stop_r, stop_w)
        # Always started: the marker's deadline is watched even for an attached engine
        # without a heartbeat, whose monitor, with nothing else to watch, ends at that
        # deadline once the marker is in (waking it sooner would take another pipe).
        res.monitor_thread = threading.Thread(
            target=monitor_engine,
            args=(weakref.ref(self), res.proc, stop_r, heartbeat_timeout_s, res.last_seen,
                  res.attach_deadline, self._front_end_beat_s(ready)),
            name="EngineCoreMonitor",
            daemon=True,
        )
        res.monitor_thread.start()
        self._start_reader()

    def _secure_transport(
        self, input_address: str | None, output_address: str | None, launch_engine: bool
    ) -> tuple[str | None, str | None, CurveConfig | None, dict[str, Any]]:
        """Addresses, this side's CURVE config and the launched engine's security kwargs.

        tcp binds to loopback unless an address is given. A launched engine over tcp gets a
        fresh key pair (the client admits only it) unless insecure tcp was asked for.
        """
        transport, curve, engine_curve, allow_insecure_tcp, limits = self._security
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
        how = describe_exit(proc.pid, proc.exitcode)
        reason = self._startup_reason()
        if reason is None:
            return EngineStartupError(
                f"engine core initialization failed; see the engine's log: {how}")
        err = EngineStartupError(f"engine core initialization failed: {reason} ({how})")
        err.__cause__ = EngineProcessDied(reason)
        return err

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
        logger.log(logging.INFO if self._death_expected() else logging.WARNING,
                   "engine core died: %s", cause)
        err = self._dead_error()
        self._deliver_failures(self._utilities.fail_all(err, UtilityEvent.ENGINE_DIED), err)
        self._wake_waiters(DEAD_MARKER)

    def _death_expected(self) -> bool:
        """The owner stopped this engine on purpose (a data-parallel scale-down)."""
        return False

    def _deliver_failures(self, futures: list[Any], err: BaseException) -> None:
        for fut in futures:
            set_future(fut, err, None)

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
        self.abort_left_behind(self.live_requests())
        self._say_goodbye()
        if not self._mark_closed():
            # A second caller returns when the first one's teardown has ended, not before:
            # "shutdown returned" means the engine is gone, for every caller.
            grace = self.resources.shutdown_timeout
            grace = DEFAULT_SHUTDOWN_TIMEOUT_S if grace is None or math.isinf(grace) else grace
            self.resources.wait_finished(grace + 30.0)
            return
        err: EngineWireError = ClientClosedError(self._closed_message)
        self._deliver_failures(self._utilities.fail_all(err, UtilityEvent.CLIENT_SHUTDOWN), err)
        self._wake_waiters(CLOSED_MARKER)
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
        if isinstance(proc, EngineSubprocess):
            # The copies of the engine's lifeline and sentinel only: had this child kept
            # them, the engine would not see its real parent go (the watch falls back to
            # polling the parent's pid).
            proc.forget()

    # -- several front ends on one engine (spec/session.py) -----------------------------------

    def _front_end_beat_s(self, ready: Any) -> float | None:
        """How often the monitor sends this front end's heartbeat: a quarter of the engine's
        ``front_end_timeout_s`` when it has one (an engine serving several front ends), else
        never."""
        timeout = getattr(ready, "front_end_timeout_s", None)
        if self.resources.proc is not None or not timeout:
            return None
        beat_s: float = timeout / 4
        return beat_s

    def _send_front_end_beat(self) -> None:
        """The heartbeat: an empty ABORT (a no-op to any engine). On the monitor thread."""
        with contextlib.suppress(EngineWireError, zmq.ZMQError):
            self._send(RequestType.ABORT, [])

    def _say_goodbye(self) -> None:
        """At shutdown, to an engine serving several front ends: this session ends now, its
        requests with it, not at the heartbeat deadline."""
        res = self.resources
        session = getattr(self, "_session", None)
        if (res.proc is not None or session is None or self.is_closed or self.is_dead
                or not getattr(self.ready_response, "front_end_timeout_s", None)):
            return
        goodbye = AttachRequest(session, integrity=self._integrity is not None,
                                client_index=self.client_index, goodbye=True)
        with contextlib.suppress(EngineWireError, zmq.ZMQError), res.send_lock:
            sock = res.input_socket
            if sock is None:
                return
            sock.send_multipart(
                [self.identity, *encode_input(self._encoder, RequestType.ATTACH, goodbye)])
            res.input_linger_ms = _ABORT_LINGER_MS

    def abort_left_behind(self, request_ids: list[str]) -> None:
        """Before a shutdown: an attached engine outlives this front end, so abort what it
        still runs for us (``request_ids``), and it stops spending steps on that before the
        next front end attaches (which would drop it). A launched engine is stopped instead.
        The member surface: a data-parallel owner names the requests it tracks."""
        res = self.resources
        if res.proc is not None or self.is_closed or self.is_dead or not request_ids:
            return
        try:
            self.send_abort(request_ids)
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
        """Send one message to the engine: encoded (arrays as zero-copy aux frames), checked
        against the engine's bounds, sealed with frame integrity. The general path of every
        send; a utility call takes ``_send_call``'s short send where ``_plain_call`` holds.
        Where ``_copied_send`` holds, the parts are copied out by plain sends; else (aux
        frames) they go zero-copy and tracked, kept until libzmq is done with them."""
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
            if self._copied_send(frames):
                send = self._sock_send
                try:
                    send(sock, self.identity, ZMQ_SNDMORE)
                    if len(frames) == 2:
                        send(sock, frames[0], ZMQ_SNDMORE)
                    send(sock, frames[-1])
                except BaseException:
                    end_message(sock)
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
                end_message(sock)
                raise
            pending.append((trackers, frames))

    def _reclaim_sends(self) -> None:
        """Drop the arrays of multi-frame sends libzmq is done with. Also run when reading
        outputs, so the last big request's memory is not pinned until the next one."""
        pending = self._pending_sends
        while pending and all(t.done for t in pending[0][0]):
            pending.popleft()

    def _copied_send(self, frames: list[Any]) -> bool:
        """The copied send's predicate (``_send``), for a sealed message's ``frames``: one
        frame, or one and its integrity trailer. Plain copying sends are cheaper than
        tracked zero-copy ones for these small frames, and nothing has to be kept after."""
        return len(frames) == 1 or (len(frames) == 2 and self._integrity is not None)

    def _plain_call(self, request: UtilityRequest) -> bytes | None:
        """The short send's predicate (``_send_call``): the one frame that ``request`` goes
        out as, the type byte and msgspec's own encoding, or None when it needs the general
        path (``_send``): frame integrity, values only the full encoder handles (arrays,
        registered Structs: its hook runs only for those, so what msgspec encodes alone is
        byte for byte the general path's frame), a frame over the engine's bounds (the
        general path refuses it, naming the bound)."""
        if self._integrity is not None:
            return None
        try:
            payload = _UTILITY_BYTE + self._call_encoder.encode(request)
        except Exception:
            return None
        return payload if len(payload) <= self._call_limit else None

    def _send_call(self, request: UtilityRequest) -> None:
        """Send a utility call: where ``_plain_call`` gives its frame, the short send (two
        plain sends, no checks but the socket's); else ``_send``. tests/runtime/
        test_mp_client.py checks that the two put the same bytes on the wire."""
        payload = self._plain_call(request)
        if payload is None:
            self._send(RequestType.UTILITY, request)
            return
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
                end_message(sock)
                raise

    def send_raw_frames(self, frames: list[bytes]) -> None:
        """Send ``[identity, *frames]`` unchecked: for conformance tests that inject
        malformed input on the wire."""
        self.ensure_alive()
        with self.resources.send_lock:
            sock = self.resources.input_socket
            if sock is None:
                raise ClientClosedError(self._closed_message)
            sock.send_multipart([self.identity, *frames])

    # -- the member surface (runtime/_dp_members.py's ``Member``) -------------------------------
    #
    # What a data-parallel client uses of each engine's client; the one-engine clients'
    # add/abort are these too. A member's owner tracks the requests (one CLIENT_REQUEST
    # lifecycle per request, kept where the caller reads): then ``_tracks_requests`` is off.

    # Off on a data-parallel member: its owner tracks the requests it routes, once.
    _tracks_requests = True

    @property
    def dead_cause(self) -> BaseException | None:
        """Why the engine died (None while it lives): the monitor's, reader's or send's cause."""
        return self._dead_cause

    def send_add(self, request: EngineCoreRequest) -> None:
        """Send an ADD without waiting (tracked first, where this client tracks requests)."""
        if not isinstance(request, EngineCoreRequest):
            raise TypeError(f"add_request expects an EngineCoreRequest, got {type(request)!r}")
        if request.client_index != self.client_index:
            request = msgspec.structs.replace(request, client_index=self.client_index)
        if not self._tracks_requests:  # the owner tracks it, and holds a Ctrl-C around both
            self._send(RequestType.ADD, request)
            return
        self._track_add(request)
        with SigintHold():  # raised after the except below: the ADD went out whole
            try:
                self._send(RequestType.ADD, request)
            except BaseException:
                self._untrack_add(request.request_id)
                raise

    def send_abort(self, request_ids: list[str]) -> None:
        """Send ABORTs for ``request_ids`` without waiting; a no-op once the engine died."""
        ids = check_request_ids(request_ids)
        if self.is_closed:
            raise ClientClosedError(self._closed_message)
        # On a dead engine an abort is a silent no-op: error paths must not raise twice.
        if not ids or self.is_dead:
            return
        if self._tracks_requests:
            ids = self._track_abort(ids)
        # In messages the engine takes (Limits.max_batch ids each): a longer list used to be
        # refused whole by the engine, so a live request in it never got its ABORT.
        step = (self._security[4] or DEFAULT_LIMITS).max_batch
        try:
            for i in range(0, len(ids), step):
                self._send(RequestType.ABORT, ids[i:i + step])
        except EngineDeadError:
            pass

    # -- the two clients' calls, less their waiting ---------------------------------------------
    #
    # ``get_output`` and ``call_utility`` of both clients are these steps around a wait that
    # each keeps for itself: the sync client's reader blocks its thread (``_SyncReader``), the
    # async client awaits an ``asyncio`` queue or future.

    def bind_loop(self) -> None:
        """Make sure a reader delivers what a caller is about to wait for: nothing to do for
        the sync client, whose reader starts with it; the async client's binds to the running
        loop (async_mp_client.py). Part of the member surface."""

    def _output_first(self) -> EngineCoreOutputs | None:
        """What ``get_output`` does before it looks at the queue: the closed error, the
        multi-frame sends libzmq is done with let go of, the reader made sure of; then a batch
        tracked already (``_redeliver``), which comes first, before a death's error. None when
        the caller is to take from the queue."""
        if self.is_closed:
            raise ClientClosedError(self._closed_message)
        if self._pending_sends:
            with self.resources.send_lock:
                self._reclaim_sends()
        self.bind_loop()
        if self._redeliver:
            with self._state_lock:  # two threads must not both take the last one
                if self._redeliver:
                    return self._redeliver.popleft()
        return None

    def _output_of(self, item: Any) -> EngineCoreOutputs:
        """A dequeued item, tracked already if it is a batch, as ``get_output`` returns it:
        the batch ``_presented``, or a marker's error. The marker goes back
        first, so it wakes the next waiter too; a shutdown is reported over a death (the
        caller closed the client after its engine died)."""
        if item is DEAD_MARKER or item is CLOSED_MARKER:
            self._outputs.put_nowait(item)
            if item is CLOSED_MARKER or self.is_closed:
                raise ClientClosedError(self._closed_message)
            raise self._dead_error()
        return self._presented(item)

    def _new_call(self) -> Any:
        """The future a utility call's outcome is set on, made where its caller waits."""
        raise NotImplementedError

    def _start_call(self, method: str, args: tuple[Any, ...], timeout: float | None
                    ) -> tuple[Any, int, float | None]:
        """What ``call_utility`` does before it waits: the arguments checked, the outcome's
        future made (``_new_call``), the call registered, then sent (a send that fails
        withdraws it). Returns the future, the call's id and the checked timeout."""
        timeout = check_timeout(timeout)
        future = self._new_call()
        check_method(method)
        check_no_dataclass(args)
        self.ensure_alive()
        call_id = self._utilities.new_id()
        try:
            self._utilities.register(call_id, future, method)
            request = UtilityRequest(self.client_index, call_id, method, list(args))
            self._send_call(request)
        except BaseException:
            event = UtilityEvent.ENGINE_DIED if self.is_dead else UtilityEvent.CLIENT_SHUTDOWN
            self._utilities.withdraw(call_id, event)
            raise
        return future, call_id, timeout

    def _call_timed_out(self, call_id: int, method: str, timeout: float | None) -> None:
        """The wait for call ``call_id`` outlasted ``timeout``: TIMEOUT fires, its entry goes
        and ``UtilityTimeoutError`` is raised, unless the outcome won the race (a reply that
        landed as the timeout fired). Its entry is then gone and its setter is about to set
        it: this returns, and the caller waits for that outcome without a deadline."""
        if self._utilities.give_up(call_id, UtilityEvent.TIMEOUT):
            assert timeout is not None
            raise UtilityTimeoutError(method, timeout) from None

    def _call_abandoned(self, call_id: int) -> bool:
        """Nobody waits for call ``call_id`` any more (Ctrl-C, a cancelled task): CANCEL fires
        and its entry goes, so a late reply is dropped like any late reply. False when its
        outcome (a reply, a death, a shutdown) is already on its way to the future."""
        return self._utilities.give_up(call_id, UtilityEvent.CANCEL)

    # -- receiving (shared by the thread and the task) -----------------------------------------

    def _on_message(self, first: bytes, sock: zmq.Socket[Any]) -> EngineCoreOutputs | None:
        """Route one message whose first frame was received as plain bytes (1.6 µs less than
        a ``Frame`` and its more flag): a utility reply settled, a batch returned to be
        queued, a heartbeat dropped. The sentinel, what does not decode and the end of this
        session raise, and the reader takes that for the engine's death.

        The general path reads the rest of the message and hands it all to ``_on_frames``.
        Nearly every message is one small frame, and three shortcuts take it in fewer steps,
        each where its predicate holds:

        * ``_one_frame()``: the first frame is taken for the whole message (``_on_frame``);
          the rest is read only when it does not decode and the more flag says parts follow
          (aux frames). A part a one-frame message should not have then arrives as a message
          of its own and fails to decode: death;
        * ``_short_decodes(first)``: one unchecked decode is tried first, and a batch it
          gives goes on checked (``Decoder.checked``), not decoded again;
        * ``_plain_reply(outputs)``: what that decode gave is a utility reply with nothing
          beside it for the post-check to bound, settled at once.

        tests/runtime/test_mp_client.py feeds the same messages through the shortcuts and
        through this general path (the predicates made False) and compares what each leaves.
        """
        if self._attaching is not None and self._before_marker(first, sock):
            return None
        if self._one_frame():
            outputs: EngineCoreOutputs | None = None
            if self._short_decodes(first):
                try:
                    outputs = self._decode_reply(first)
                except Exception:
                    pass  # the sentinel, aux frames, garbage: _on_frame decodes it as it is
                else:
                    # Batches, the hot path, skip the call: the predicate implies the test.
                    if outputs.utility_output is not None and self._plain_reply(outputs):
                        if self._stamp_seen:
                            self.resources.last_seen[0] = time.monotonic()
                        self._utilities.settle(outputs.utility_output)
                        return None
            try:
                return self._on_frame(first, outputs)
            except ProtocolError:
                if not sock.get(ZMQ_RCVMORE):
                    raise
        elif not sock.get(ZMQ_RCVMORE):
            return self._on_frames([first])  # no trailer: integrity reports it
        return self._on_frames(recv_rest(sock, [first], MAX_PARTS))

    def _one_frame(self) -> bool:
        """The one-frame shortcut's predicate (``_on_message``): a message is taken for its
        first frame alone unless frame integrity is on (then a trailer follows every one)."""
        return self._integrity is None

    @staticmethod
    def _short_decodes(first: bytes) -> bool:
        """The short decode's predicate (``_on_message``), for a one-frame message: a first
        frame this small is decoded unchecked first, its result checked, not decoded again.
        Bigger ones go to ``Decoder.decode_payload``, which screens them before decoding."""
        return len(first) <= _PLAIN_REPLY_BYTES

    @staticmethod
    def _plain_reply(outputs: EngineCoreOutputs) -> bool:
        """The plain reply's predicate (``_on_message``), for the short decode's unchecked
        result: a utility reply with nothing beside it that the post-check bounds (outputs,
        stream columns, finished ids), so it is settled at once, unchecked."""
        return (outputs.utility_output is not None and not outputs.outputs
                and not outputs.stream_ids and not outputs.stream_tokens
                and not outputs.finished_requests)

    def _on_frame(self, first: bytes, decoded: EngineCoreOutputs | None = None
                  ) -> EngineCoreOutputs | None:
        """``_on_frames([first])`` in fewer steps: the one-frame shortcut (``_one_frame``).
        ``decoded``: the short decode's unchecked result (``_short_decodes``), checked here
        instead of decoded again."""
        if self._stamp_seen:
            self.resources.last_seen[0] = time.monotonic()
        if first == ENGINE_DEAD_SENTINEL:
            raise _said_gone()
        dec = self._out_decoder
        return self._routed(
            dec.decode_payload(first) if decoded is None else dec.checked(first, decoded))

    def _on_frames(self, frames: list[Any]) -> EngineCoreOutputs | None:
        """The general path of ``_on_message``: a whole message, its integrity trailer
        opened (with frame integrity), decoded and checked, then routed."""
        if self._stamp_seen:
            self.resources.last_seen[0] = time.monotonic()
        if is_dead_sentinel(frames):
            raise _said_gone()
        if self._integrity is not None:
            frames = self._integrity.open(frames)
        return self._routed(decode_outputs(frames, self._out_decoder.limits))

    def _routed(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs | None:
        """A decoded message routed: a utility reply settled, a batch worth queueing
        returned, a heartbeat dropped; a message that ends this session raises."""
        if outputs.utility_output is not None:
            self._utilities.settle(outputs.utility_output)
            return None
        if (outputs.outputs or outputs.stream_ids or outputs.finished_requests
                or outputs.scheduler_stats):
            return outputs
        if outputs.power is not None:
            # Another front end's power utility succeeded on an engine serving several:
            # followed as its reply would be, so this client's view is the engine's.
            self._on_power_reply(outputs.power.method, outputs.power.result)
            return None
        if outputs.refusal is not None:
            # After the marker a refusal ends the session (its input failed the engine's
            # integrity check): the engine dropped this front end's work and ignores it, so
            # taking it for a heartbeat would leave every call waiting. Tested only on a
            # message with nothing else in it: no cost to batches and replies.
            self._attach_step(AttachEvent.SESSION_ENDED)
            raise ProtocolError(f"the engine ended this session: {outputs.refusal}")
        return None  # heartbeat

    def __repr__(self) -> str:
        return f"<{type(self).__name__} engine pid={self.engine_pid} {self.lifecycle.state.name}>"
