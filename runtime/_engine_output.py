"""The engine's output half: ``EngineOutput``, the output thread's object. It owns the PUSH
socket, its heartbeat, and every send of an output to the front end: direct from the calling
thread (``put(item, direct=True)``, ``send_encoded``) when nothing is queued ahead, else
queued for the output thread.

Separate because the output path has its own rules (one lock, order with what is queued,
buffers reused only once sent) that nothing else needs to read. Everything below is the
output thread's, or taken under its lock by the thread that sends: runtime/_engine_shared.py
says who owns what.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from typing import Any

import zmq

from ..protocol.messages import EngineCoreOutputs
from ._engine_link import (
    RECONNECT_IVL_MAX_MS,
    RECONNECT_IVL_MS,
    Link,
    SendAbandoned,
    send_reconnecting,
)
from ._engine_shared import IDLE_WAKE_S, Control
from ._engine_wire import OutputEncoder
from .faults import FaultInjector, FaultPoint
from .integrity import LinkIntegrity
from .security import TransportGuard
from .zmq_io import ZMQ_NOBLOCK, BufferPool, backend_send, send_frames

__all__ = ["DIRECT_SEND_MAX_OUTPUTS", "OUTPUT_FLUSH_S", "STOP_OUTPUT", "EngineOutput",
           "Retired", "goes_direct", "is_marker"]

# One logger for the engine process, whichever of its modules logs.
logger = logging.getLogger("enginewire.runtime.engine_proc")

# Bound on waiting for the output thread to flush the dead sentinel or the last outputs.
OUTPUT_FLUSH_S = 4.0
# Batches up to this size are sent by the thread that built them when nothing is queued
# ahead (no hand-off); larger ones are encoded by the output thread while the next step runs,
# if the step leaves it time: a model whose forward never releases the GIL (the null model
# without a delay) has the busy loop send every batch itself, as the output thread could
# only take the GIL from it (measured: 0.47 -> 0.70 of the floor's tokens/s at K=1024).
DIRECT_SEND_MAX_OUTPUTS = 64
# Finished requests handed to the output thread (``Retired``) are dropped once the thread
# has had nothing to send for this long, or after its next send: not right after the send
# of the batch that finished them, when the client decodes that batch and needs the CPU
# (a burst's end: 1024 requests' teardown took ~6 ms beside the client's decode, and the
# last batch reached its caller 3 -> 6 ms after its stamp). A step's forward outlasts this.
RETIRE_IDLE_S = 0.004


STOP_OUTPUT = object()  # output-queue item: flush and exit


class Retired:
    """Output-queue item: finished requests for the output thread to drop (not sent)."""

    __slots__ = ("requests",)

    def __init__(self, requests: list[Any]) -> None:
        self.requests = requests


def is_marker(item: Any) -> bool:
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


def goes_direct(size: int, overlap: bool) -> bool:
    """The direct send's predicate for a step's batch of ``size`` outputs (``EngineOutput.put``
    is the general path): small batches go straight out; big ones are encoded by the output
    thread while the next step runs, if the step releases the GIL (``overlap``)."""
    return size <= DIRECT_SEND_MAX_OUTPUTS or not overlap


class EngineOutput:
    """The output thread (``run()``) and every send to the front end.

    Any thread may send through ``put``, ``send_encoded`` and ``retire``: each takes the
    output lock, and sends itself only when nothing is queued ahead (``sends_now``), so the
    front end gets everything in the order it was handed over. The socket, the count of
    queued items, the buffer pool, the encoder and the time of the last send are read and
    written only under that lock, by the output thread or by the thread sending; ``faults``
    is set before the thread starts (``EngineCoreProc`` arms a plan once its engine is built).
    ``peer_seen`` is set (by the input thread, which sees the handshakes first) once a front
    end's connection completed its handshake: only then is the exit worth a flush linger (a
    standalone engine nobody reached, beating into its queue, took 2 s to exit). Not this
    socket's own handshake: its monitor may report it only after the last send.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        guard: TransportGuard,
        encoder: OutputEncoder,
        *,
        engine_index: int,
        output_queue: queue.SimpleQueue[Any],
        input_queue: queue.SimpleQueue[Any],
        heartbeat_interval_s: float | None = None,
        integrity: LinkIntegrity | None = None,
    ) -> None:
        self._ctx = ctx
        self._guard = guard
        self._engine_index = engine_index
        self.output_queue = output_queue
        self._input_queue = input_queue  # where a failed send tells the loop to stop
        self._heartbeat_s = heartbeat_interval_s
        self._integrity = integrity  # its sending half is this side's
        self.faults: FaultInjector | None = None
        self.peer_seen = threading.Event()
        self._lock = threading.Lock()
        # The PUSH, once the output thread connected it: (socket, address, link).
        self._out: tuple[zmq.Socket[Any], str, Link] | None = None
        self._send: Any = backend_send(zmq.Socket)  # set per socket in run()
        self._pending = 0  # items queued for the output thread and not yet sent
        self._encoder = encoder
        self._pool = BufferPool(max_free=4)
        self._last_send = 0.0
        # Set by ``stop_by``: past it a send that still blocks is abandoned (its peer is gone).
        self._stop_by: float | None = None

    def stop_by(self, deadline: float, *, unless_set: bool = False) -> None:
        """Abandon any send still blocked at ``deadline`` (monotonic): the engine is going.
        ``unless_set``: keep a deadline already set."""
        if not (unless_set and self._stop_by is not None):
            self._stop_by = deadline

    def run(self, address: str) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, int(OUTPUT_FLUSH_S * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sock.setsockopt(zmq.SNDTIMEO, int(IDLE_WAKE_S * 1000))
        link = Link()  # reconnect after a protocol error only (see Link)
        peer = threading.Event()  # a front end's connection is up (the monitor says)

        def dropped() -> None:
            peer.clear()
            link.drop()

        def connected() -> None:
            peer.set()
            link.mend()

        self._guard.connect_as_client(sock, "output", on_drop=dropped,
                                      on_connect=connected, on_retry=link.mend)
        hb = self._heartbeat_s
        out_queue = self.output_queue
        try:
            sock.connect(address)
            with self._lock:
                self._out = (sock, address, link)
                self._send = backend_send(type(sock))
            held: list[Retired] = []  # see RETIRE_IDLE_S
            while True:
                wait = None if hb is None else max(0.0, hb - (time.monotonic() - self._last_send))
                if held and (wait is None or wait > RETIRE_IDLE_S):
                    wait = RETIRE_IDLE_S
                try:
                    item = out_queue.get(timeout=wait)
                except queue.Empty:
                    if held:
                        held.clear()  # idle: their teardown costs nobody now
                        continue
                    # Idle heartbeat: lets an attached client tell "idle" from "gone". Direct
                    # sends count as traffic, so a busy link carries no extra heartbeats.
                    # Only to a connected peer whose pipe has room: a beat queued for nobody
                    # is stale when it arrives, and a standalone engine alone for long filled
                    # its pipe with them until a send blocked for good (SIGTERM then wedged).
                    with self._lock:
                        if self._pending == 0 and (
                            hb is None or time.monotonic() - self._last_send >= hb
                        ):
                            if peer.is_set() and sock.poll(0, zmq.POLLOUT):
                                self._send_locked(EngineCoreOutputs(
                                    engine_index=self._engine_index,
                                    timestamp=EngineCoreOutputs.now()))
                            else:
                                self._last_send = time.monotonic()  # next beat: an interval on
                    continue
                if item is STOP_OUTPUT:
                    return
                if type(item) is Retired:
                    held.append(item)
                    item = None
                    continue
                with self._lock:
                    self._pending -= 1
                    self._send_locked(item)
                if isinstance(item, bytes):  # the engine-dead sentinel: nothing follows it
                    return
                item = None  # a sent batch is freed now, not when the next one comes
                held.clear()  # those finished before this batch: the next step computes
        except zmq.ContextTerminated:
            return
        except SendAbandoned:
            logger.warning("engine stopping: its front end stopped reading; outputs still"
                           " queued for it are dropped")
            return
        except BaseException:
            logger.exception("engine output thread failed")
            # Nothing can reach the client any more; make the engine stop.
            self._input_queue.put((Control.SHUTDOWN, RuntimeError("output thread failed")))
        finally:
            with self._lock:
                self._out = None
            # Linger to flush the last outputs only if a front end ever connected: with none,
            # nothing can be delivered and the linger would only delay the exit.
            sock.close(linger=None if self.peer_seen.is_set() else 0)

    def _send_locked(self, item: Any) -> None:
        """Encode and send one item on the PUSH socket; the caller holds the lock."""
        out = self._out
        if out is None:
            return
        sock, address, link = out
        give_up = self._past_stop
        if isinstance(item, bytes):  # the engine-dead sentinel
            send_reconnecting(sock, address, link, functools.partial(sock.send, item), give_up)
            return
        if type(item) is _Encoded:  # a direct send that found the pipe full
            send_reconnecting(sock, address, link, functools.partial(
                send_frames, sock, item.frames), give_up)
            self._last_send = time.monotonic()
            return
        if self.faults is not None and not is_marker(item):  # the marker is the handshake's
            self.faults(FaultPoint.OUTPUT_SEND)
        pool = self._pool
        buf = pool.acquire()
        frames = self._encoder.encode_into(item, buf)
        if self._integrity is not None and (mode := _seal_mode(item)) is not None:
            frames = [*frames, self._integrity.seal(frames, restart=mode)]
        # The payload's own tracker decides when ``buf`` may be reused.
        tracker = send_reconnecting(sock, address, link, functools.partial(
            send_frames, sock, frames, track=True), give_up)
        pool.release(buf, tracker)
        self._last_send = time.monotonic()

    def sends_now(self, direct: bool) -> bool:
        """The direct send's predicate (``put`` and ``send_encoded`` are its general path,
        the queue): asked for, and nothing queued ahead on a connected socket. Under the
        lock."""
        return direct and self._pending == 0 and self._out is not None

    def put(self, item: Any, *, direct: bool) -> None:
        """Hand ``item`` to the client, in order with everything handed over before it.

        ``direct`` sends on the calling thread when ``sends_now`` (and the pipe takes it
        without blocking): a reply that does not wait for the output thread saves a thread
        wake-up per round trip. Otherwise the output thread sends it: big batches during a
        busy step (``goes_direct``), so encoding overlaps the next step.
        """
        with self._lock:
            if self.sends_now(direct):
                try:
                    item = self._send_direct(self._out[0], item)  # type: ignore[index]
                except zmq.ContextTerminated:
                    return
                except BaseException as e:
                    self._send_failed(e)
                    return
                if item is None:
                    return
            self._pending += 1
            self.output_queue.put(item)

    def _past_stop(self) -> bool:
        stop_by = self._stop_by
        return stop_by is not None and time.monotonic() > stop_by

    def _send_failed(self, error: BaseException) -> None:
        """A direct send raised: nothing more can reach the client, so the engine stops."""
        logger.exception("engine: sending outputs failed")
        self._input_queue.put((Control.SHUTDOWN, RuntimeError(f"output send failed: {error!r}")))

    def _send_direct(self, sock: zmq.Socket[Any], item: Any) -> _Encoded | None:
        """Send ``item`` now if the socket takes it without blocking (None), else return it
        encoded for the output thread. A direct sender must never block: a gone or slow
        client fills the pipe, and then only the output thread waits on it while the busy
        loop still sees a shutdown. Caller holds the lock."""
        if self.faults is not None and not is_marker(item):  # the marker is the handshake's
            self.faults(FaultPoint.OUTPUT_SEND)
        # A fresh bytes payload, no pool: the send copies it (below copy_threshold) or keeps
        # a reference to it until libzmq is done (above), and nothing else writes to it.
        frames = self._encoder.encode(item)
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

    def send_encoded(self, payload: bytes) -> None:
        """Send a one-frame message now if ``sends_now`` and the pipe takes it, else queue it
        behind what is already there (``put``'s order, for a payload encoded by the caller)."""
        with self._lock:
            if self.sends_now(True):
                try:
                    self._send(self._out[0], payload, ZMQ_NOBLOCK)  # type: ignore[index]
                    self._last_send = time.monotonic()
                    return
                except zmq.Again:
                    pass
                except zmq.ContextTerminated:
                    return
                except BaseException as e:
                    self._send_failed(e)
                    return
            self._pending += 1
            self.output_queue.put(_Encoded([payload]))

    def retire(self, ended: list[Any]) -> None:
        """Have the output thread drop finished requests (a thousand take milliseconds to
        tear down) behind their batch, while the next step computes, when that batch went
        to the thread; when it did not, the caller's reference was the last and they go now."""
        with self._lock:
            if self._pending:
                self.output_queue.put(Retired(ended))
