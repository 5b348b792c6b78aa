"""The engine's input half: the input thread, which owns the DEALER socket, sends the ready
at each handshake, decodes every message and queues it for the busy loop, and serves a
utility call itself while the loop idles.

``InputSide`` is a mixin of ``EngineCoreProc`` (runtime/engine_proc.py), which sets its
state (``EngineProcState``); separate because nothing it receives may kill it, and that
rule (reject, log, end a session, never raise) is easier to hold in a file of its own.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from typing import Any, cast

import msgspec
import zmq

from ..protocol.codec import (
    Encoder,
    decode_input,
    peek_call_id,
    peek_request_id,
    split_input,
    utility_output,
)
from ..protocol.messages import (
    AttachRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    ReadyResponse,
    RequestType,
    UtilityOutput,
    UtilityRequest,
)
from ..protocol.results import PLAIN_RESULTS
from ..protocol.utilities import LOOP_THREAD_METHODS
from ..spec.engine import IN_LOOP, SCHEDULING, EngineState
from ..spec.errors import ProtocolError
from ..spec.session import SESSION_DROPS_INPUT, SessionEvent
from ._engine_link import RECONNECT_IVL_MAX_MS, RECONNECT_IVL_MS, Link, Wakeup, reconnect
from ._engine_shared import IDLE_WAKE_S, Control, EngineProcState
from .faults import FaultPoint
from .zmq_io import ZMQ_RCVMORE, recv_rest

# One logger for the engine process, whichever of its modules logs.
logger = logging.getLogger("enginewire.runtime.engine_proc")

# How long the input thread blocks in a plain receive before it also watches for a new front
# end (a poll over its DEALER and a wake pipe): a front end's next message comes well within
# this, so the per-message path stays one blocking ``recv()``. It bounds how late the ready
# goes out after a handshake that completes while messages are still coming in.
BUSY_RECV_S = 0.01

_UTILITY_BYTE = RequestType.UTILITY.value
_ATTACH_BYTE = RequestType.ATTACH.value


class InputSide(EngineProcState):
    """The input half of ``EngineCoreProc``: its input thread and the idle-call path."""

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
        link = Link()
        # Every connection that completes its handshake may be a new front end, which learns
        # of this engine only from a ready (a duplicate to the same front end is ignored).
        # The monitor thread counts handshakes and wakes this thread's poll, so the ready
        # goes out at once (it used to wait for a receive timeout: 0.5 s per attach).
        connects = itertools.count(1)
        connected = [0]  # handshakes so far (counted by the monitor thread)
        readied = [0]  # the handshake count when the ready was last sent (this thread)
        wakeup = Wakeup()

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
                try:
                    if not (self._fast_calls and self._serve_plain(first)):
                        self._accept(first, sock)
                except zmq.ContextTerminated:
                    return
                except Exception:
                    # The input thread must outlive any frame: log and keep serving.
                    logger.exception("engine input thread: dropped a frame it could not handle")
        except zmq.ContextTerminated:
            return
        except BaseException as e:
            self._input_error = e
            logger.exception("engine input thread failed")
            # Without input the engine is useless: make it visible as a fatal error.
            self.input_queue.put((Control.SHUTDOWN, e))
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
                self._session_step(SessionEvent.INTEGRITY_FAILED)
                self.input_queue.put((Control.END_SESSION, e))
                return
        try:
            try:
                kind, payload = decode_input(frames, self.limits, self._vocab_size)
            except ProtocolError:
                # Only now is the more flag read: a payload that refers to aux frames
                # fails alone; with them it may decode. A message without more fails as is.
                if self._integrity is not None or not sock.get(ZMQ_RCVMORE):
                    raise
                frames = recv_rest(sock, frames, self._max_parts)
                kind, payload = decode_input(frames, self.limits, self._vocab_size)
        except ProtocolError as e:
            self._reject(frames[0], e)
            return
        if self.faults is not None:
            try:
                self._fault(FaultPoint.INPUT_DECODED)
            except Exception as e:
                # An injected raise or OOM is this thread failing, not one bad frame.
                self.input_queue.put((Control.SHUTDOWN, e))
                return
        if kind is RequestType.ABORT:
            # Seen by a step already running; the queued copy keeps the order behind ADDs.
            self.engine.mid_step_aborts.extend(payload)
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
            kind, payload = decode_input(frames, self.limits)
        except ProtocolError as e:
            self._reject(frames[0], e)
            return
        attach = cast(AttachRequest, payload)
        ours = self._integrity is not None
        if attach.integrity != ours:
            self._session_step(SessionEvent.ATTACH_REFUSED)
            reason = (f"frame integrity is {'on' if attach.integrity else 'off'} at this front"
                      f" end and {'on' if ours else 'off'} at the engine; set the same on both"
                      " (client option frame_integrity, enginewire engine --integrity)")
            logger.error("refused a front end: %s", reason)
            self.input_queue.put((Control.OUTPUTS, EngineCoreOutputs(
                engine_index=self.engine_index, session=attach.session, refusal=reason,
                timestamp=EngineCoreOutputs.now())))
            return
        self._session_step(SessionEvent.ATTACH_ACCEPTED)
        if self._integrity is not None:
            self._integrity.restart_receiving()
        self.input_queue.put((kind, payload))

    def _session_step(self, event: SessionEvent) -> None:
        self.session_phase.fire(event)
        self._refused = self.session_phase.state in SESSION_DROPS_INPUT

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
            if not self.input_queue.empty():  # something is queued ahead of it: keep the order
                return False
            if plain:
                self._answer_plain(call)
            else:
                self._call_utility(call)
            if self._replies:
                self._flush_replies()
            if self._has_work() or self.engine.lifecycle.state is EngineState.DEAD:
                self.input_queue.put((Control.WAKE, None))  # the loop has something to do
            return True
        finally:
            lock.release()

    def _admit_parked(self, request: EngineCoreRequest) -> bool:
        """Admit an ADD on this thread while the busy loop is parked (idle, or backing off
        over requests a paused scheduler holds) with an empty queue, so nothing is
        reordered; False when the loop must take it. A burst of adds to a parked engine
        then costs no wake-up of the loop each. The loop is woken only when the engine can
        schedule the request now; a paused or sleeping one keeps it until its resume (a
        call, which wakes the loop)."""
        lock = self._engine_lock
        if not lock.acquire(blocking=False):
            return False
        try:
            if not self.input_queue.empty() or self.engine.lifecycle.state not in IN_LOOP:
                return False  # keep the order; the loop's own checks past its end
            try:
                self._add(request)
            except Exception as e:
                # The engine died admitting it: the loop's error to raise, not this thread's
                # (which must outlive anything it receives).
                self.input_queue.put((Control.FATAL, e))
                return True
            if self._replies:
                self._flush_replies()
            if self.engine.lifecycle.state in SCHEDULING:
                self.input_queue.put((Control.WAKE, None))  # the loop has a step to run
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
        if type(result) in PLAIN_RESULTS:
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
            self.input_queue.put((Control.REJECT_ADD, (request_id, f"malformed request: {error}")))
            return
        call_id = peek_call_id(rest) if type_byte == RequestType.UTILITY.value else None
        if type_byte == RequestType.UTILITY.value and call_id is not None:
            logger.warning("rejected malformed utility call %r: %s", call_id, error)
            reply = UtilityOutput(call_id=call_id, failure_message=f"malformed call: {error}")
            self.input_queue.put((Control.OUTPUTS, EngineCoreOutputs(utility_output=reply)))
            return
        logger.warning("rejected malformed input (type byte %r): %s", type_byte, error)
