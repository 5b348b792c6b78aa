"""The engine's input half: ``EngineInput``, the input thread's object. It owns the DEALER,
sends the ready at each handshake, decodes every message (as its ``WireProfile`` says) and
queues it for the busy loop, or, while the loop is parked, has the engine gate run it here.

Separate because nothing it receives may kill it, and that rule (reject, log, end a session,
never raise) is easier to hold in a file of its own. Everything below is the input thread's
alone but the queue, the gate and what the loop lends it (``ParkedLoop``): runtime/
_engine_shared.py says who owns what.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

import msgspec
import zmq

from ..protocol.codec import Limits, decode_input
from ..protocol.messages import (
    AttachRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    UtilityRequest,
)
from ..protocol.utilities import LOOP_THREAD_METHODS
from ..spec.errors import ProtocolError
from ..spec.machine import Lifecycle
from ..spec.session import SESSION_DROPS_INPUT, SESSION_SERVED, SessionEvent, SessionState
from ._engine_link import RECONNECT_IVL_MAX_MS, RECONNECT_IVL_MS, Link, Wakeup, reconnect
from ._engine_shared import IDLE_WAKE_S, Control, EngineGate
from ._engine_wire import WireProfile
from .faults import FaultInjector, FaultPoint
from .integrity import LinkIntegrity
from .security import TransportGuard
from .zmq_io import ZMQ_RCVMORE, recv_rest

__all__ = ["BUSY_RECV_S", "EngineInput", "ParkedLoop", "channel_prefix"]

# One logger for the engine process, whichever of its modules logs.
logger = logging.getLogger("enginewire.runtime.engine_proc")

# How long the input thread blocks in a plain receive before it also watches for a new front
# end (a poll over its DEALER and a wake pipe): a front end's next message comes well within
# this, so the per-message path stays one blocking ``recv()``. It bounds how late the ready
# goes out after a handshake that completes while messages are still coming in.
BUSY_RECV_S = 0.01

# A served front end whose connection stays down this long (or its front_end_timeout_s, if
# shorter) is gone (spec/session.py): a killed process's socket closes at once, so its work
# ends well before its heartbeat deadline, while a drop libzmq mends (a reconnect, a protocol
# error's grace: DROP_GRACE_S) is no sign.
CONNECTION_LOSS_S = 1.0

_ATTACH_BYTE = RequestType.ATTACH.value
# Ends a scoped request id's prefix (``channel_prefix``): a control character no decimal has.
SCOPE_END = "\x1f"


def channel_prefix(channel: int, generation: int) -> str:
    """The prefix that scopes a request id to one front end's session on an engine serving
    several (``EngineInput(scoped=True)``): the engine keys requests by (channel, session
    generation, the front end's id), spelled ``f"{channel}.{generation}\x1f{id}"`` so the
    engine core needs no second key. The first ``SCOPE_END`` ends it, whatever the id holds."""
    return f"{channel}.{generation}{SCOPE_END}"


class ParkedLoop(Protocol):
    """What the busy loop (``EngineCoreProc``) lets the input thread run while it is parked,
    through the engine gate: each runs the engine, sends what it owes, and leaves the loop a
    ``Control.WAKE`` when there is work for it (the gate's Rule 3)."""

    def answer_call(self, call: UtilityRequest) -> None: ...

    def answer_plain(self, call: UtilityRequest) -> None: ...

    def admit(self, request: EngineCoreRequest) -> None: ...


class EngineInput:
    """The input thread: ``run()`` until the context terminates. Built by ``EngineCoreProc``
    once its engine is; ``ready_sent`` is set once the first ready is queued (or, with CURVE,
    sent), ``error`` holds what killed the thread if anything did."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        guard: TransportGuard,
        address: str,
        wire: WireProfile,
        *,
        identity: bytes,
        engine_index: int,
        limits: Limits,
        vocab_size: int | None,
        ready: list[Any],
        input_queue: queue.SimpleQueue[Any],
        gate: EngineGate,
        loop: ParkedLoop,
        aborts: collections.deque[str],
        session_phase: Lifecycle[SessionState, SessionEvent],
        on_peer: Callable[[], None],
        integrity: LinkIntegrity | None = None,
        faults: FaultInjector | None = None,
        fast_calls: bool = True,
        channel: int = 0,
        scoped: bool = False,
        front_end_timeout_s: float | None = None,
    ) -> None:
        self._ctx = ctx
        self._guard = guard
        self._address = address
        self._wire = wire
        self._identity = identity
        self._engine_index = engine_index
        self._limits = limits
        self._ready = ready
        self.input_queue = input_queue
        self._gate = gate
        self._answer_call = loop.answer_call
        self._answer_plain = loop.answer_plain
        self._admit = loop.admit
        # The engine's mid-step aborts: a step already running sees an ABORT at once.
        self._aborts = aborts
        # Which front end this engine serves (spec/session.py): this thread's alone, as it
        # sees every ATTACH and integrity failure first. ``_refused`` caches whether the state
        # drops input (SESSION_DROPS_INPUT), its per-message test.
        self.session_phase = session_phase
        self._refused = session_phase.state in SESSION_DROPS_INPUT
        # Told when a front end's connection completed its handshake (without sessions: once
        # connected), from the monitor thread: the output's flush linger waits on it.
        self._on_peer = on_peer
        self._integrity = integrity  # its receiving half is this thread's
        self.faults = faults
        # Parts held per message: the payload's frames, and the integrity trailer.
        self._max_parts = limits.max_frames + 1
        self._decode = wire.decoder(limits, vocab_size, self._max_parts)
        # The idle-call short path (``_serve_plain``); off with integrity (every message is
        # sealed) and under a fault plan (every fault point lies on the general path).
        self._short_call = wire.short_call(limits) if fast_calls else None
        # Without sessions the client's first message completes the handshake (AFTER_READY).
        self._handshaking = not wire.sessions
        # Several front ends (spec/session.py): this thread serves channel ``channel``, whose
        # front end must ATTACH with that client_index. ``scoped``: request ids are scoped to
        # the session (``channel_prefix``; ``_generation`` counts its sessions), and the items
        # queued for the loop name the channel. ``front_end_timeout_s``: a served front end
        # silent for longer is gone (it sends heartbeats: empty ABORTs).
        self.channel = channel
        self._scoped = scoped
        self._generation = 0
        self._prefix = channel_prefix(channel, 0)
        self._attached: bytes | None = None  # the served session, as this thread saw it
        self._front_end_timeout_s = front_end_timeout_s
        self._last_heard = time.monotonic()
        # When the front end's connection went down (the monitor thread sets and clears it);
        # ``_loss_told``: that drop was already taken as a sign of loss.
        self._down_since: float | None = None
        self._loss_told = False
        self.ready_sent = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self._identity)
        sock.setsockopt(zmq.LINGER, 0)
        # libzmq drops the connection on a larger frame before allocating it, and after such
        # a protocol error (or a refused handshake) it does not reconnect: the monitor
        # reports the drop and wakes this thread's poll, which connects again once the
        # drop's grace (DROP_GRACE_S) ended.
        sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_frame_bytes)
        sock.setsockopt(zmq.RCVTIMEO, int(BUSY_RECV_S * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sessions = self._wire.sessions
        if sessions:
            # Queue only on a connection whose handshake completed, and drop what is queued
            # when it goes: a ready must reach the front end on the connection it announces.
            # Without this a ready sent while the link was down waited in the pipe and
            # arrived on the next connection ahead of that one's own ready; a front end that
            # took the extra one as the next re-ready sent into a link about to drop (#27:
            # 1 ATTACH in 8 lost).
            sock.setsockopt(zmq.IMMEDIATE, 1)
        address = self._address
        link = Link()
        # Every connection that completes its handshake may be a new front end, which learns
        # of this engine only from a ready (a duplicate to the same front end is ignored).
        # The monitor thread counts handshakes and wakes this thread's poll, so the ready
        # goes out at once (it used to wait for a receive timeout: 0.5 s per attach).
        connects = itertools.count(1)
        connected = [0]  # handshakes so far (counted by the monitor thread)
        readied = [0]  # the handshake count when the ready was last sent (this thread)
        wakeup = Wakeup()
        ready_frames = self._ready

        on_peer = self._on_peer

        def on_connect() -> None:
            link.mend()
            self._down_since = None
            on_peer()
            connected[0] = next(connects)
            wakeup.set()

        def on_drop() -> None:
            link.drop()
            if self._down_since is None:
                self._down_since, self._loss_told = time.monotonic(), False
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
                    self.ready_sent.set()

        try:
            if sessions:
                self._guard.connect_as_client(sock, "input", on_drop=on_drop,
                                              on_connect=on_connect, on_retry=link.mend)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            wake_fd = wakeup.fileno()  # a poll reports an fd by its number
            poller.register(wake_fd, zmq.POLLIN)
            idle_ms = int(IDLE_WAKE_S * 1000)
            sock.connect(address)
            if not sessions:
                # One ready, queued before the connection completes (no IMMEDIATE), as
                # vLLM's DEALER sends it: the ROUTER learns the identity from it.
                sock.send_multipart(ready_frames, copy=False)
                on_peer()
                self.ready_sent.set()
            elif self._guard.curve is None:
                # A plain engine waits for its front end without a deadline; the first ready
                # goes out at the first handshake, as every later one does (a CURVE engine's
                # start-up waits for it: security.md).
                self.ready_sent.set()
            recv = sock.recv
            short_call = self._short_call
            watch = self._front_end_timeout_s is not None
            while True:
                if connected[0] != readied[0]:
                    # A handshake while messages keep coming: announce it now, not at the
                    # next idle moment, when that connection may have gone.
                    send_ready()
                # A message's first frame (type byte + payload) is received as plain bytes:
                # 0.4 µs against 2 for a Frame and its more flag. Further parts are read only
                # when the payload refers to them or a trailer follows (``accept``).
                try:
                    first = recv()
                except zmq.ContextTerminated:
                    return
                except zmq.Again:
                    # Idle for BUSY_RECV_S: wait for a message, a handshake (the ready goes
                    # out at once), IDLE_WAKE_S, or a dropped link's grace to end (it is then
                    # mended).
                    while True:
                        if watch:
                            self._check_heard()
                        if link.take_due():
                            reconnect(sock, address)
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
                if watch:
                    self._last_heard = time.monotonic()
                try:
                    if not (short_call is not None and self._serve_plain(short_call, first)):
                        self.accept(first, sock)
                except zmq.ContextTerminated:
                    return
                except Exception:
                    # The input thread must outlive any frame: log and keep serving.
                    logger.exception("engine input thread: dropped a frame it could not handle")
        except zmq.ContextTerminated:
            return
        except BaseException as e:
            self.error = e
            logger.exception("engine input thread failed")
            # Without input the engine is useless: make it visible as a fatal error.
            self.input_queue.put((Control.SHUTDOWN, e))
        finally:
            sock.close(linger=0)
            wakeup.close()  # the monitor may outlive the socket: its set() is then a no-op

    def _serve_plain(self, short_call: Any, first: bytes) -> bool:
        """The idle-call short path: a call the wire's ``short_call`` predicate takes, served
        while the loop is parked, in as few steps as the protocol allows (the round trip's
        latency is mostly how much code runs cold after a wake-up); False when the message
        takes the general path (``accept``), which decodes again and reports any error. A
        call served here is one frame: its payload decoded without aux frames (a part its
        sender added after it is read as a message of its own)."""
        if self._refused:
            return False
        call = short_call(first)
        if call is None:
            return False
        if self._scoped and call.client_index != self.channel:
            call = msgspec.structs.replace(call, client_index=self.channel)  # the reply's route
        return self._serve_idle_call(call, plain=True)

    def accept(self, first: bytes, sock: zmq.Socket[Any]) -> None:
        """The general path: decode and dispatch one message whose first frame was received;
        read its further parts (aux frames, the integrity trailer) when it has them: parts of
        one message arrive together, so that never waits. Its shortcuts: the idle-call short
        path (``_serve_plain``, predicate ``WireProfile.short_call``) before it, and the
        parked paths (``_serve_idle_call``, ``_admit_parked``; predicate
        ``EngineGate.may_run_parked``) instead of the queue at its end."""
        frames: list[Any] = [first]
        rest: zmq.Socket[Any] | None = sock
        if self._wire.sessions:
            try:
                if (self._refused or first[:1] == _ATTACH_BYTE or self._integrity is not None
                        ) and sock.get(ZMQ_RCVMORE):
                    # The whole message (an ATTACH or a refused peer's, whatever it is), or
                    # the integrity trailer and the aux frames before it.
                    recv_rest(sock, frames, self._max_parts)
            except ProtocolError as e:  # more parts than any message has: read, dropped
                self._reject([first], e)
                return
            if self._refused or first[:1] == _ATTACH_BYTE:
                if first[:1] == _ATTACH_BYTE:
                    self._accept_attach(frames)  # unsealed: it starts the counts afresh
                return
            if self._integrity is not None:
                rest = None  # read above
                try:
                    frames = self._integrity.open(frames)
                except ProtocolError as e:
                    # This front end's link is broken (lost, reordered or corrupted input):
                    # its session ends, not the engine, which serves the next front end.
                    # Nothing more of it is read (its counts no longer line up) until it
                    # attaches anew; the busy loop drops its work and tells it, in order
                    # behind its input.
                    self._session_step(SessionEvent.INTEGRITY_FAILED)
                    self._new_generation(None)
                    self.input_queue.put(
                        (Control.END_SESSION, (self.channel, e) if self._scoped else e))
                    return
        elif self._handshaking:
            # No ATTACH on this wire (enginewire's AFTER_READY point): the client's first
            # message proves it read the ready, so the handshake is done here.
            self._handshaking = False
            if self.faults is not None:
                try:
                    self.faults(FaultPoint.AFTER_READY)
                except Exception as e:
                    self.input_queue.put((Control.SHUTDOWN, e))
                    return
        try:
            kind, payload = self._decode(frames, rest)
        except ProtocolError as e:
            self._reject(frames, e)
            return
        if self.faults is not None and type(kind) is RequestType:
            try:
                self.faults(FaultPoint.INPUT_DECODED)
            except Exception as e:
                # An injected raise or OOM is this thread failing, not one bad frame.
                self.input_queue.put((Control.SHUTDOWN, e))
                return
        if self._scoped:
            payload = self._scope(kind, payload)
            if payload is None:
                return  # a front end's heartbeat: it was heard, nothing more
        if kind is RequestType.ABORT:
            # Seen by a step already running; the queued copy keeps the order behind ADDs.
            self._aborts.extend(payload)
        elif kind is RequestType.UTILITY and self._serve_idle_call(
                cast(UtilityRequest, payload)):
            return
        elif kind is RequestType.ADD and self._admit_parked(cast(EngineCoreRequest, payload)):
            return
        self.input_queue.put((kind, payload))

    def _accept_attach(self, frames: list[Any]) -> None:
        """An ATTACH: accepted, or refused when the front end's frame integrity differs from
        this engine's (its messages would fail here, or its outputs there). With integrity,
        the new session's first sealed message is ``seq`` 1: the count restarts here, before
        the next message is opened."""
        try:
            kind, payload = decode_input(frames, self._limits)
        except ProtocolError as e:
            self._reject(frames, e)
            return
        attach = cast(AttachRequest, payload)
        if self._scoped and attach.goodbye:
            # The served front end leaves (its shutdown): its work ends now, not at its
            # heartbeat deadline. A goodbye from any other session changes nothing.
            if attach.session == self._attached:
                self._gone("it said goodbye", tell=False)
            return
        ours = self._integrity is not None
        reason = None
        if attach.integrity != ours:
            reason = (f"frame integrity is {'on' if attach.integrity else 'off'} at this front"
                      f" end and {'on' if ours else 'off'} at the engine; set the same on both"
                      " (client option frame_integrity, enginewire engine --integrity)")
            event = SessionEvent.ATTACH_REFUSED
        elif self._scoped and attach.client_index != self.channel:
            reason = (f"this front end's client_index is {attach.client_index}, but it"
                      f" attached on channel {self.channel} (input and output address pair"
                      f" {self.channel} of the engine); each front end attaches on the pair"
                      " at its own index")
            # MISPLACED disturbs nobody: a served session keeps its work and its deadline.
            event = SessionEvent.ATTACH_MISPLACED
        if reason is not None:
            served = self.session_phase.state in SESSION_SERVED
            self._session_step(event)
            logger.error("refused a front end: %s", reason)
            if (self._scoped and served and self.session_phase.state not in SESSION_SERVED
                    and attach.session != self._attached):
                # Another peer took the channel and was refused: the served session's
                # front end is cut off, and REFUSED has no heartbeat deadline, so its work
                # ends now (as a new session's ATTACH would end it), not never.
                self._new_generation(None)
                self.input_queue.put(
                    (Control.FRONT_END_GONE, (self.channel, self._generation, None)))
            refusal = EngineCoreOutputs(
                engine_index=self._engine_index, session=attach.session, refusal=reason,
                timestamp=EngineCoreOutputs.now())
            self.input_queue.put(
                (Control.OUTPUTS, (self.channel, refusal) if self._scoped else refusal))
            return
        self._session_step(SessionEvent.ATTACH_ACCEPTED)
        if self._integrity is not None:
            self._integrity.restart_receiving()
        if self._scoped:
            if attach.session != self._attached:
                self._new_generation(attach.session)
            self._last_heard = time.monotonic()
            self.input_queue.put((kind, (self.channel, self._generation, attach)))
            return
        self.input_queue.put((kind, payload))

    # -- several front ends (spec/session.py): scoped ids, the heartbeat deadline --------------

    def _new_generation(self, session: bytes | None) -> None:
        """A new session (or none) on this channel: ids are scoped afresh, so nothing the
        previous session sent can name what the next one sends."""
        self._attached = session
        self._generation += 1
        self._prefix = channel_prefix(self.channel, self._generation)

    def _scope(self, kind: Any, payload: Any) -> Any:
        """A decoded message of a served front end, scoped to its session: request ids carry
        the session's prefix, a call names this channel (its reply's route). None: an empty
        ABORT, the front end's heartbeat."""
        if kind is RequestType.ADD:
            return msgspec.structs.replace(
                payload, request_id=self._prefix + payload.request_id,
                client_index=self.channel)
        if kind is RequestType.ABORT:
            if not payload:
                return None
            prefix = self._prefix
            return [prefix + rid for rid in payload]
        if kind is RequestType.UTILITY and payload.client_index != self.channel:
            return msgspec.structs.replace(payload, client_index=self.channel)
        return payload

    def _check_heard(self) -> None:
        """The signs of a front end's loss: silent past ``front_end_timeout_s`` (its
        process died or hangs), or its connection down past ``CONNECTION_LOSS_S`` (its
        process died, or its link is cut). The first makes a served session GONE; a later
        one is noted on the GONE session (its trace shows both)."""
        timeout = self._front_end_timeout_s
        if timeout is None:
            return
        now = time.monotonic()
        down = self._down_since
        if down is not None and not self._loss_told and now - down > min(
                CONNECTION_LOSS_S, timeout):
            self._loss_told = True
            why = f"its connection stayed down for {min(CONNECTION_LOSS_S, timeout):g} s"
            if self.session_phase.state in SESSION_SERVED:
                self._gone(why)
            elif self.session_phase.can(SessionEvent.FRONT_END_GONE):
                self._session_step(SessionEvent.FRONT_END_GONE)  # a later sign: nothing to end
        if (self.session_phase.state in SESSION_SERVED
                and now - self._last_heard > timeout):
            self._gone(f"nothing heard from it for {timeout:g} s (front_end_timeout_s)")

    def _gone(self, why: str, *, tell: bool = True) -> None:
        """FRONT_END_GONE: the loop ends this session's work, behind its input. ``tell``:
        the loop also sends the session an ended notice, for a front end that is only
        stopped or slow (SIGSTOP past its deadline): resumed, it reads that its session is
        gone instead of waiting on calls the engine drops unread. A dead one's notice waits
        in the pipe and reaches the next front end ahead of its marker, which drops it. Not
        after a goodbye: that front end is shutting down and reads nothing more."""
        if self.session_phase.state not in SESSION_SERVED:
            return
        self._session_step(SessionEvent.FRONT_END_GONE)
        self._new_generation(None)
        logger.warning("front end %d is gone: %s", self.channel, why)
        self.input_queue.put((Control.FRONT_END_GONE,
                              (self.channel, self._generation, why if tell else None)))

    def _session_step(self, event: SessionEvent) -> None:
        self.session_phase.fire(event)
        self._refused = self.session_phase.state in SESSION_DROPS_INPUT

    def _serve_idle_call(self, call: UtilityRequest, *, plain: bool = False) -> bool:
        """Have the gate run a utility call on this thread while the busy loop is parked
        (``EngineGate.try_run_parked``); False when the loop must take it. ``plain``: the
        short path (``ParkedLoop.answer_plain``)."""
        if call.method in LOOP_THREAD_METHODS:
            return False  # e.g. the profiler: one thread for start, stop and export
        return self._gate.try_run_parked(self._answer_plain if plain else self._answer_call,
                                         call)

    def _admit_parked(self, request: EngineCoreRequest) -> bool:
        """Have the gate admit an ADD on this thread while the busy loop is parked (idle, or
        backing off over requests a paused scheduler holds); False when the loop must take
        it. A burst of adds to a parked engine then costs no wake-up of the loop each."""
        return self._gate.try_run_parked(self._admit, request)

    def _reject(self, frames: list[Any], error: ProtocolError) -> None:
        answer = self._wire.rejection(frames, error)
        if answer is not None:
            if self._scoped:
                what, detail = answer
                if what is Control.REJECT_ADD:
                    answer = what, (self._prefix + detail[0], detail[1])
                else:
                    answer = what, (self.channel, detail)
            self.input_queue.put(answer)
