"""EngineCoreProc: the engine core in its own process, behind two sockets.

Theory of operation
-------------------
Three threads share the work so that (de)serialization overlaps compute (vLLM's layout), and
each owns its state (runtime/_engine_shared.py says who owns what):

* the **input thread** runs ``EngineInput`` (runtime/_engine_input.py): a DEALER connected
  to the client's ROUTER. It speaks first (the ready handshake: a ROUTER cannot address a
  peer it has not heard from), and again whenever a connection completes its handshake
  (maybe a new front end: the monitor thread wakes the thread's poll through a pipe). It
  decodes every frame and puts ``(kind, payload)`` on the one input queue. Nothing it
  receives can kill it: a frame that does not decode is a logged rejection, or an ERROR
  output (or a failed utility reply) when the request id or call id can be recovered; one
  that fails the integrity check ends its front end's session (the engine serves the next
  one).
* the **busy loop** on the main thread (this module) drains the input queue, parks on it
  when the engine has nothing to do (no spinning; the wait is sliced at ``IDLE_WAKE_S`` so
  signals are seen), and otherwise calls ``EngineCore.step()``. Aborts share the queue with
  adds, so an abort is never applied before its ADD; the queue is drained before every step,
  so an abort lands at the next step boundary. While it is parked with nothing queued, the
  engine gate (``EngineGate``) lets the input thread serve a call or admit an ADD itself,
  one thread hop less per message; the gate's docstring is that protocol.
* the **output thread** runs ``EngineOutput`` (runtime/_engine_output.py): a PUSH connected
  to the client's PULL; it encodes into reused buffers, which are only handed back once zmq
  reports the payload frame sent. Other threads send small outputs themselves through it,
  under its lock, when nothing is queued ahead.

What the bytes mean is the wire profile's (``WireProfile``, runtime/_engine_wire.py):
enginewire's own by default, vLLM 0.33's in runtime/vllm_wire.py.

A fatal error in the loop queues the engine-dead sentinel, waits (bounded) for the output
thread to flush it, and the process exits non-zero. SIGTERM/SIGINT shut down cleanly, also
while the engine is still being built. The process exits by itself within 5 s of its parent's
death: ``PR_SET_PDEATHSIG`` where Linux offers it, and a watchdog on the parent's
multiprocessing sentinel (or pid) everywhere (runtime/_engine_lifeline.py); link mending is
runtime/_engine_link.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import msgspec
import zmq

from ..protocol.codec import DEFAULT_LIMITS, Limits, utility_output
from ..protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    PowerNotice,
    RequestType,
    UtilityOutput,
    UtilityRequest,
)
from ..protocol.results import PLAIN_RESULTS
from ..protocol.utilities import POWER_METHODS
from ..spec.engine import POWER_PARKED, SCHEDULING, EngineEvent, EngineState
from ..spec.errors import EngineStartupError, ProtocolError
from ..spec.machine import TraceEntry
from ..spec.session import SESSION
from ._engine_input import SCOPE_END, EngineInput, channel_prefix
from ._engine_lifeline import EngineShutdownRequested, ShutdownSignals, watch_parent
from ._engine_link import DROP_GRACE_S as DROP_GRACE_S  # re-exported: tests read it here
from ._engine_output import OUTPUT_FLUSH_S, STOP_OUTPUT, EngineOutput, goes_direct, is_marker
from ._engine_shared import IDLE_WAKE_S, Control, EngineGate, InputQueue
from ._engine_trace import TRACE_BOUND, EngineTrace, engine_trace_for
from ._engine_wire import WireProfile
from .faults import ARM_FAULT_UTILITY, FaultInjector, FaultPoint, as_plan
from .integrity import LinkIntegrity
from .preload import run_preloads
from .security import CurveConfig, TransportGuard, check_transport

__all__ = ["EngineCoreProc", "EngineShutdownRequested", "run_engine_core"]

logger = logging.getLogger(__name__)

# Bound on the input thread connecting and sending the ready handshake.
HANDSHAKE_SEND_S = 30.0
# ``_emit_scoped``'s id cache: its bound, and the marker of an id it has not resolved yet.
_SPLIT_BOUND = 1 << 16
_UNRESOLVED: Any = object()

# A reply's route on an engine serving several front ends: (channel, session generation).
Route = tuple[int, int]


def _addresses(name: str, value: str | Sequence[str]) -> list[str]:
    addresses = [value] if isinstance(value, str) else list(value)
    if not addresses or not all(isinstance(a, str) and a for a in addresses):
        raise ValueError(f"{name}={value!r}: must be an address or a non-empty list of them")
    return addresses


class _SessionEnded(EngineCoreOutputs, frozen=True):
    """The notice that ends a session whose input failed the integrity check: on the wire
    an ``EngineCoreOutputs`` with ``refusal`` (and the session, if any) like a refused
    attach marker, since the front end reads ``refusal`` after its marker as "ended" and
    before it as "refused". Its own type only tells the sender to seal it as usual (the
    front end opens everything after its marker, and the output direction is intact: the
    notice is checked like any output), where a refusal marker goes out unsealed. No
    fields of its own, so it encodes exactly as its base."""


def plain_reply(encoder: msgspec.msgpack.Encoder, engine_index: int, call_id: int,
                result: Any) -> bytes | None:
    """The idle-call short path's reply predicate (``EngineCoreProc._reply_to`` is the
    general builder): ``result`` encoded as a one-frame reply when msgpack carries it as
    itself, else None."""
    if type(result) not in PLAIN_RESULTS:
        return None
    try:
        return encoder.encode(EngineCoreOutputs(
            engine_index, [], time.monotonic(), None, None,
            UtilityOutput(call_id, None, result)))
    except (TypeError, OverflowError, UnicodeEncodeError, msgspec.EncodeError):
        return None  # e.g. an int beyond 64 bits: the general builder reports it


class EngineCoreProc:
    """The engine core plus its IO threads; ``run_busy_loop()`` runs on the calling thread.
    It owns the engine and the busy loop's state; ``input`` (``EngineInput``) and ``output``
    (``EngineOutput``) are its two IO threads' objects. ``wire`` is the profile it speaks."""

    wire: type[WireProfile] = WireProfile

    def __init__(
        self,
        config: Any,
        *,
        input_address: str | Sequence[str],
        output_address: str | Sequence[str],
        engine_index: int = 0,
        heartbeat_interval_s: float | None = None,
        startup_delay_s: float = 0.0,
        trace: list[TraceEntry] | None = None,
        signals: ShutdownSignals | None = None,
        fault: Any = None,
        curve: CurveConfig | None = None,
        allow_insecure_tcp: bool = False,
        limits: Limits = DEFAULT_LIMITS,
        integrity: bool = False,
        front_end_timeout_s: float | None = None,
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
        # Several front ends (spec/session.py): channel i is the i-th address pair, served by
        # its own input and output thread, all feeding this one busy loop.
        inputs = _addresses("input_address", input_address)
        outputs = _addresses("output_address", output_address)
        if len(inputs) != len(outputs):
            raise ValueError(f"{len(inputs)} input address(es) but {len(outputs)} output"
                             " address(es): one pair per front end")
        if front_end_timeout_s is not None and not (
                isinstance(front_end_timeout_s, (int, float))
                and math.isfinite(front_end_timeout_s) and front_end_timeout_s > 0):
            raise ValueError(f"front_end_timeout_s={front_end_timeout_s!r}: must be a finite"
                             " number of seconds > 0, or None")
        # Scoped: request ids, replies and sessions per channel. Only with several front
        # ends or a front-end deadline: one front end without one is served as always.
        self._scoped = len(inputs) > 1 or front_end_timeout_s is not None
        if self._scoped and not self.wire.sessions:
            raise ValueError(f"the {self.wire.name} wire has no sessions: it serves one front"
                             " end, without front_end_timeout_s")
        # The two queues between the threads: input items for the loop, outputs for the
        # output thread (one per channel; this is channel 0's).
        self.input_queue = InputQueue()
        self.output_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._signals = signals
        check_transport((*inputs, *outputs), curve, allow_insecure_tcp)
        # Bounds on input, applied by the codec and (frame size) by libzmq before allocating.
        self.limits = limits
        self._wire = self.wire()
        self._ctx = zmq.Context()
        self._guard = TransportGuard(self._ctx, curve, side="engine")
        self._threads: list[threading.Thread] = []
        self._deferred: set[concurrent.futures.Future[Any]] = set()
        self._loop_thread: int | None = None  # the busy loop's thread, once it runs
        # Replies owed, each with its route (None: the one front end's).
        self._replies: list[tuple[Route | None, UtilityOutput]] = []
        # The attached front end's session (protocol/messages.py, "Attaching"); busy loop only.
        self._session: bytes | None = None
        # Scoped: each channel's served session (None: none) and its generation, as the loop
        # has seen them (behind the input queued before them).
        self._sessions: list[bytes | None] = [None] * len(inputs)
        self._generations = [0] * len(inputs)
        self._split: dict[str, tuple[int, str] | None] = {}  # _emit_scoped's id cache
        self._split_key: Any = None
        # The session and the engine core record into one bounded trace, which drain_trace
        # hands out (runtime/_engine_trace.py); a plain list given here still gets each entry.
        records: int = getattr(config, "engine_trace_records", 0)
        if trace is not None and not isinstance(trace, EngineTrace):
            trace = EngineTrace(records or TRACE_BOUND, sink=trace)
        elif trace is None and records:
            trace = EngineTrace(records)  # EngineConfig.engine_trace_records asks for one
        # Which front end each channel serves (spec/session.py): its input thread's.
        session_phases = [SESSION.lifecycle(trace=trace) for _ in inputs]
        self.engine: Any = None
        self._overlap = True  # the output thread can encode while a step runs
        # Fault points (runtime/faults.py); None: no plan, every point is a no-op.
        self.faults: FaultInjector | None = None
        # Optional seq/ack/CRC trailers on every message (runtime/integrity.py): one object
        # for both directions (each one's acks ride on the other's messages), locked on its own.
        # One per channel: each front end's link numbers its own messages (a shared one gave
        # every front end the others' sequence numbers as gaps: "messages were lost").
        self._integrities = [LinkIntegrity() if integrity else None for _ in outputs]
        # Built first, so that close() always has them to stop; their threads start below.
        self.outputs = [EngineOutput(
            self._ctx, self._guard, self._wire.encoder(), engine_index=engine_index,
            output_queue=self.output_queue if i == 0 else queue.SimpleQueue(),
            input_queue=self.input_queue,
            heartbeat_interval_s=heartbeat_interval_s, integrity=self._integrities[i])
            for i in range(len(outputs))]
        self.output = self.outputs[0]
        self.inputs: list[EngineInput] = []
        self.input: EngineInput | None = None  # built once the engine is
        # The idle call's short path encodes plain replies itself (``plain_reply``).
        self._reply_encoder = msgspec.msgpack.Encoder()
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
            ready = self._wire.ready(self.engine, engine_index)
            if front_end_timeout_s is not None:
                ready = self._wire.ready(self.engine, engine_index,
                                         front_end_timeout_s=front_end_timeout_s)
            # Held by the busy loop except while it parks: the input thread may then serve
            # a call or admit an ADD itself (one thread hop less per message).
            self._gate = EngineGate(self.input_queue, self.engine.lifecycle)
            # The idle call's short path is off with integrity (every message is sealed) and
            # under a fault plan (every fault point lies on the general path).
            fast_calls = not integrity and self.faults is None
            self.inputs = [EngineInput(
                self._ctx, self._guard, address, self._wire,
                identity=engine_index.to_bytes(2, "little"), engine_index=engine_index,
                limits=limits, vocab_size=self.engine.arch.vocab_size, ready=ready,
                input_queue=self.input_queue, gate=self._gate, loop=self,
                aborts=self.engine.mid_step_aborts, session_phase=session_phases[i],
                on_peer=self.outputs[i].peer_seen.set,
                integrity=self._integrities[i], faults=self.faults, fast_calls=fast_calls,
                channel=i, scoped=self._scoped, front_end_timeout_s=front_end_timeout_s)
                for i, address in enumerate(inputs)]
            self.input = self.inputs[0]
            for output, address in zip(self.outputs, outputs, strict=True):
                self._start("EngineCoreOutputThread", output.run, address)
            for inp in self.inputs:
                self._start("EngineCoreInputThread", inp.run)
            inputs_threads = self._threads[-len(inputs):]
            deadline = time.monotonic() + HANDSHAKE_SEND_S
            for inp, address, thread in zip(self.inputs, inputs, inputs_threads, strict=True):
                while not inp.ready_sent.wait(0.1):
                    if inp.error is not None or not thread.is_alive():
                        raise EngineStartupError(
                            f"engine input thread died during start-up: {inp.error}"
                        ) from inp.error
                    if time.monotonic() > deadline:
                        raise EngineStartupError(
                            f"no front end took the ready handshake at {address} within"
                            f" {HANDSHAKE_SEND_S:g} s (is one bound there, with matching"
                            " keys?)")
            self.engine.lifecycle.fire(EngineEvent.HANDSHAKE_SENT)
        except BaseException:
            self.close()
            raise

    # -- threads ------------------------------------------------------------------------------

    def _start(self, name: str, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

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
            # No local outlives its iteration: a name still bound to the last batch or to the
            # requests it finished would free them when rebound, after the next step (its
            # burst's end: milliseconds), or only once the next burst's first step is done.
            progressed = self._emit(self.engine.step()) | self._flush_replies()
            self._retire(self.engine.take_ended())
            idle_rounds = 0 if progressed else idle_rounds + 1

    def _flush_replies(self) -> bool:
        if not self._replies:
            return False
        replies, self._replies = self._replies, []
        for route, out in replies:
            self._emit_utility(out, route)
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
                # Work exists but steps produce nothing (e.g. a paused scheduler's requests):
                # back off instead of spinning, while still reacting to input at once. The
                # loop is parked as when idle: the input thread may admit and serve meanwhile.
                item = self._wait_input(min(0.05, 0.001 * idle_rounds))
                if item is None:
                    return True
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

    def _wait_input(self, timeout: float = IDLE_WAKE_S) -> tuple[Any, Any] | None:
        # Parked: the gate opens for the wait (EngineGate). The wait is sliced because CPython
        # runs signal handlers only on the main thread, and a signal the kernel hands to
        # another thread (zmq's, torch's) does not interrupt it: every IDLE_WAKE_S the main
        # thread looks.
        item: tuple[Any, Any] | None = self._gate.park(timeout)
        return item

    def _stop_requested(self) -> bool:
        return self._signals is not None and self._signals.requested.is_set()

    def _handle(self, kind: Any, payload: Any) -> bool:
        if kind is Control.SHUTDOWN:
            if isinstance(payload, BaseException):
                raise RuntimeError("engine IO thread failed") from payload
            return False
        if kind is Control.WAKE:
            pass
        elif kind is Control.FATAL:
            raise payload  # met by the input thread while it ran the engine for the loop
        elif kind is Control.END_SESSION:
            if self._scoped:
                self._end_channel(*payload)
            else:
                self._end_session(payload)
        elif kind is Control.FRONT_END_GONE:
            self._front_end_gone(*payload)
        elif kind is Control.REJECT_ADD:
            self.engine.reject_request(*payload)  # its ERROR goes out with the next step
        elif kind is Control.OUTPUTS:
            if self._scoped:
                channel, payload = payload
                if is_marker(payload) or self._sessions[channel] is not None:
                    self.outputs[channel].put(payload, direct=True)
            elif is_marker(payload):  # a refusal: nothing else in it, sent all the same
                self.output.put(payload, direct=True)
            else:
                self._emit(payload)
        elif kind is RequestType.ADD:
            self._add(payload)
        elif kind is RequestType.ABORT:
            self.engine.abort_requests(list(payload))
            # The input thread put these ids there too, for a step that might be running;
            # none is (this is the loop), so they are stale: an idle engine that takes
            # millions of aborts must not keep them until its next step.
            self.engine.mid_step_aborts.clear()
        elif kind is RequestType.UTILITY:
            self._call_utility(payload)
        elif kind is RequestType.ATTACH:
            if self._scoped:
                self._attach_channel(*payload)
            else:
                self._attach(payload.session)
        else:
            logger.error("engine: unknown input kind %r dropped", kind)
        return True

    def _add(self, request: EngineCoreRequest) -> None:
        """Admit ``request`` (the loop's, or the input thread's while the loop is parked:
        ``admit``); one the engine refuses ends with ERROR, and it serves on."""
        try:
            self.engine.add_request(request)
        except Exception as e:
            if self.engine.lifecycle.state is EngineState.DEAD:
                raise
            # Request-scoped: this request fails, the engine serves on.
            logger.exception("engine refused request %.80r", request.request_id)
            self._emit(EngineCoreOutputs(outputs=[EngineCoreOutput(
                request.request_id, [], FinishReason.ERROR, error=f"{type(e).__name__}: {e}")]))

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
        self.output.put(EngineCoreOutputs(engine_index=self.engine_index, session=session,
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
        self.output.put(_SessionEnded(engine_index=self.engine_index, session=self._session,
                                      refusal=reason, timestamp=EngineCoreOutputs.now()),
                        direct=True)
        self._session = None

    # -- several front ends (spec/session.py; scoped only) ------------------------------------

    def _attach_channel(self, channel: int, generation: int, attach: Any) -> None:
        """A front end attaches on ``channel``: a new session there ends that channel's
        previous work only (nobody else's, and the engine stays as it is: asleep stays
        asleep); then its marker."""
        self._fault(FaultPoint.AFTER_READY)
        if generation != self._generations[channel]:
            dropped = self._drop_channel(channel)
            logger.info("front end %d attached%s", channel,
                        f"; {dropped} request(s) of its predecessor were dropped"
                        if dropped else "")
            self._generations[channel] = generation
        self._sessions[channel] = attach.session
        self.outputs[channel].put(EngineCoreOutputs(
            engine_index=self.engine_index, session=attach.session,
            timestamp=EngineCoreOutputs.now()), direct=True)
        if self.engine.lifecycle.state in POWER_PARKED:
            # Asleep or paused by another front end: this one's client follows, as if it
            # had made the call (a draining engine's notice comes when its drain ends).
            self.outputs[channel].put(EngineCoreOutputs(
                engine_index=self.engine_index, power=PowerNotice("sleep"),
                timestamp=EngineCoreOutputs.now()), direct=True)

    def _drop_channel(self, channel: int) -> int:
        """End every live request a channel's earlier sessions started (ABORT: KV freed;
        their outputs match no served session and are dropped) and forget the replies owed
        to them; how many requests ended."""
        head = f"{channel}."
        ids = [rid for rid in self.engine.scheduler.requests if rid.startswith(head)]
        if ids:
            self.engine.abort_requests(ids)
        self._replies = [(r, o) for r, o in self._replies if r is None or r[0] != channel]
        return len(ids)

    def _front_end_gone(self, channel: int, generation: int, why: str | None) -> None:
        """FRONT_END_GONE on ``channel``: its work ends, nobody else's. ``why``: the session
        is told so (``EngineInput._gone``), sealed like any output, behind what it was owed
        before."""
        dropped = self._drop_channel(channel)
        session = self._sessions[channel]
        self._generations[channel] = generation
        self._sessions[channel] = None
        logger.warning("front end %d is gone; its %d live request(s) were aborted",
                       channel, dropped)
        if why is not None:
            self.outputs[channel].put(_SessionEnded(
                engine_index=self.engine_index, session=session, timestamp=EngineCoreOutputs.now(),
                refusal=(f"this front end's session is gone ({why}): the engine aborted its"
                         f" {dropped} live request(s) and ignores it until it attaches again")),
                direct=True)

    def _end_channel(self, channel: int, error: ProtocolError) -> None:
        """``_end_session`` for one channel of several."""
        dropped = self._drop_channel(channel)
        reason = (f"this front end's input failed the frame integrity check ({error}); the"
                  f" engine dropped its {dropped} request(s) and ignores it until it attaches"
                  " again")
        logger.error("ended front end %d's session: %s", channel, reason)
        self.outputs[channel].put(_SessionEnded(
            engine_index=self.engine_index, session=self._sessions[channel], refusal=reason,
            timestamp=EngineCoreOutputs.now()), direct=True)
        self._sessions[channel] = None

    def _route(self, call: UtilityRequest) -> Route | None:
        """Where ``call``'s reply goes: its channel's session now (the input thread set
        ``client_index`` to the channel); None with one unscoped front end."""
        if not self._scoped:
            return None
        return call.client_index, self._generations[call.client_index]

    def _output_for(self, route: Route | None) -> EngineOutput | None:
        """The channel a reply goes to, or None when its session has gone since."""
        if route is None:
            return self.output
        channel, generation = route
        if self._generations[channel] != generation or self._sessions[channel] is None:
            return None
        return self.outputs[channel]

    def _notify_power(self, call: UtilityRequest, result: Any) -> None:
        """A power utility succeeded for one front end: every other served front end is told,
        in the engine's order, so its client follows as it would the reply (spec/client.py)."""
        if not self._scoped or call.method not in POWER_METHODS:
            return
        notice = PowerNotice(call.method, result if type(result) is bool else None)
        for channel, session in enumerate(self._sessions):
            if session is not None and channel != call.client_index:
                self.outputs[channel].put(EngineCoreOutputs(
                    engine_index=self.engine_index, power=notice,
                    timestamp=EngineCoreOutputs.now()), direct=True)

    def _call_utility(self, call: UtilityRequest) -> None:
        reply = self._run_utility(call)
        if reply is not None:
            self._emit_utility(reply, self._route(call))

    def _run_utility(self, call: UtilityRequest) -> UtilityOutput | None:
        """Run ``call``; its reply, or None when the reply is deferred (sent on resolution)."""
        try:
            result = self.engine.call_utility(call.method, call.args)
        except Exception as e:
            return utility_output(call.call_id, call.method, error=e)
        reply = self._reply_to(call, result)
        if self._scoped and reply is not None and reply.failure_message is None:
            self._notify_power(call, result)
        return reply

    def _reply_to(self, call: UtilityRequest, result: Any) -> UtilityOutput | None:
        """The reply for ``result``, the general builder (its shortcut: ``plain_reply``, on
        the idle call's short path); None when it is a Future (sent once it resolves)."""
        if isinstance(result, concurrent.futures.Future):
            # Deferred reply (pause/sleep in "wait" mode): sent when the engine resolves it.
            self._deferred.add(result)
            route = self._route(call)

            def done(fut: concurrent.futures.Future[Any]) -> None:
                exc = fut.exception()
                if exc is not None:
                    out = utility_output(call.call_id, call.method, error=exc)
                else:
                    out = utility_output(call.call_id, call.method, result=fut.result())
                    if out.failure_message is None:
                        self._notify_power(call, fut.result())
                # Completed inside step(): held until that step's outputs are queued, so a
                # "wait" reply follows the last outputs it waited for. Queued before the
                # future leaves _deferred: the loop, seeing no work left, flushes it then.
                self._replies.append((route, out))
                self._deferred.discard(fut)
                if threading.get_ident() != self._loop_thread:
                    # Completed by another thread (a user's utility resolving later): an
                    # idle loop is parked on its input queue, and would send it only after
                    # the next input; wake it to send it now.
                    self.input_queue.put((Control.WAKE, None))

            result.add_done_callback(done)
            return None
        return utility_output(call.call_id, call.method, result=result)

    # -- the input thread's work for a parked loop (ParkedLoop, through the EngineGate) -------

    def answer_call(self, call: UtilityRequest) -> None:
        """Run a utility call on the input thread while the loop is parked. The bookkeeping
        comes after the reply: code that runs between receiving a call and sending its reply
        is the round trip's own time (it runs cold, after a wake-up), while code after the
        send overlaps the reply's way to the client."""
        self._call_utility(call)
        self._after_parked_call()

    def answer_plain(self, call: UtilityRequest) -> None:
        """``answer_call`` on the short path: a result msgpack carries as itself
        (``plain_reply``) is sent at once if the pipe takes it (else queued behind what is
        already there); any other outcome takes the general reply builder."""
        if self._scoped:
            self._answer_plain_scoped(call)
            return
        try:
            result = self.engine.call_utility(call.method, call.args)
        except Exception as e:
            self._emit_utility(utility_output(call.call_id, call.method, error=e))
        else:
            payload = plain_reply(self._reply_encoder, self.engine_index, call.call_id, result)
            if payload is not None:
                self.output.send_encoded(payload)
            else:
                reply = self._reply_to(call, result)
                if reply is not None:
                    self._emit_utility(reply)
        self._after_parked_call()

    def _answer_plain_scoped(self, call: UtilityRequest) -> None:
        """``answer_plain`` on an engine serving several front ends: the reply goes to the
        caller's channel, a power change to the others as a notice."""
        route = self._route(call)
        try:
            result = self.engine.call_utility(call.method, call.args)
        except Exception as e:
            self._emit_utility(utility_output(call.call_id, call.method, error=e), route)
        else:
            payload = plain_reply(self._reply_encoder, self.engine_index, call.call_id, result)
            if payload is not None:
                output = self._output_for(route)
                if output is not None:
                    output.send_encoded(payload)
                self._notify_power(call, result)
            else:
                reply = self._reply_to(call, result)
                if reply is not None:
                    self._emit_utility(reply, route)
                    if reply.failure_message is None:
                        self._notify_power(call, result)
        self._after_parked_call()

    def _after_parked_call(self) -> None:
        if self._replies:
            self._flush_replies()
        if self._has_work() or self.engine.lifecycle.state is EngineState.DEAD:
            self.input_queue.put((Control.WAKE, None))  # the loop has something to do

    def admit(self, request: EngineCoreRequest) -> None:
        """Admit an ADD on the input thread while the loop is parked. The loop is woken only
        when the engine can schedule the request now; a paused or sleeping one keeps it
        until its resume (a call, which wakes the loop)."""
        try:
            self._add(request)
        except Exception as e:
            # The engine died admitting it: the loop's error to raise, not the input
            # thread's (which must outlive anything it receives).
            self.input_queue.put((Control.FATAL, e))
            return
        if self._replies:
            self._flush_replies()
        if self.engine.lifecycle.state in SCHEDULING:
            self.input_queue.put((Control.WAKE, None))  # the loop has a step to run

    # -- outputs (sent through EngineOutput) --------------------------------------------------

    def _emit(self, outputs: EngineCoreOutputs | None) -> bool:
        if outputs is None:
            return False
        if not (outputs.outputs or outputs.stream_ids or outputs.finished_requests
                or outputs.utility_output):
            return False
        if outputs.engine_index != self.engine_index:
            outputs = msgspec.structs.replace(outputs, engine_index=self.engine_index)
        if self._scoped:
            self._emit_scoped(outputs)
            return True
        size = len(outputs.outputs) + len(outputs.stream_ids)
        self.output.put(outputs, direct=goes_direct(size, self._overlap))
        return True

    def _emit_scoped(self, outputs: EngineCoreOutputs) -> None:
        """Split a step's batch by front end: each served session gets its own requests'
        outputs under the ids it sent; those of a session that has gone are dropped.

        Each scoped id is resolved once (``_split``: id -> (channel, own id), None for a
        session no longer served) and looked up by the same str object on every later step
        (its hash cached): the per-token cost is one dict lookup, not a find, two slices and
        two more lookups. The cache holds only while the served sessions are the ones it was
        built under (``_split_key``) and is emptied past a bound (ids of requests ended
        without a finish notice, e.g. dropped with their session)."""
        key = (tuple(self._generations), tuple(s is not None for s in self._sessions))
        split = self._split
        if key != self._split_key or len(split) > _SPLIT_BOUND:
            split.clear()
            self._split_key = key
        served = {channel_prefix(ch, self._generations[ch]): ch
                  for ch, session in enumerate(self._sessions) if session is not None}

        def resolve(rid: str) -> tuple[int, str] | None:
            cut = rid.find(SCOPE_END) + 1
            ch = served.get(rid[:cut])
            hit = split[rid] = None if ch is None else (ch, rid[cut:])
            return hit

        k = len(self._sessions)
        ids: list[list[str]] = [[] for _ in range(k)]
        toks: list[list[int]] = [[] for _ in range(k)]
        get = split.get
        for rid, tok in zip(outputs.stream_ids, outputs.stream_tokens, strict=False):
            hit = get(rid, _UNRESOLVED)
            if hit is _UNRESOLVED:
                hit = resolve(rid)
            if hit is not None:
                ch, own = hit
                ids[ch].append(own)
                toks[ch].append(tok)
        outs: list[list[EngineCoreOutput]] = [[] for _ in range(k)]
        for out in outputs.outputs:
            rid = out.request_id
            hit = get(rid, _UNRESOLVED)
            if hit is _UNRESOLVED:
                hit = resolve(rid)
            if hit is not None:
                outs[hit[0]].append(msgspec.structs.replace(out, request_id=hit[1]))
        finished: list[list[str]] = [[] for _ in range(k)]
        for rid in outputs.finished_requests or ():
            hit = split.pop(rid, _UNRESOLVED)
            if hit is _UNRESOLVED:
                hit = resolve(rid)
                split.pop(rid, None)
            if hit is not None:
                finished[hit[0]].append(hit[1])
        for ch in range(k):
            if ids[ch] or outs[ch] or finished[ch]:
                batch = EngineCoreOutputs(
                    engine_index=self.engine_index, outputs=outs[ch],
                    timestamp=outputs.timestamp, finished_requests=finished[ch] or None,
                    scheduler_stats=outputs.scheduler_stats, stream_ids=ids[ch],
                    stream_tokens=toks[ch])
                self.outputs[ch].put(batch, direct=goes_direct(len(ids[ch]) + len(outs[ch]),
                                                               self._overlap))
        if outputs.utility_output is not None:
            self._emit_utility(outputs.utility_output)

    def _emit_utility(self, out: UtilityOutput, route: Route | None = None) -> None:
        output = self.output if route is None else self._output_for(route)
        if output is None:
            return  # its session has gone: nobody awaits it
        output.put(
            EngineCoreOutputs(engine_index=self.engine_index, utility_output=out,
                              timestamp=EngineCoreOutputs.now()),
            direct=True,
        )

    def _retire(self, ended: list[Any]) -> None:
        """Have the requests a step finished torn down on the output thread, behind their
        batch, when the step releases the GIL (``EngineOutput.retire``); here otherwise."""
        if ended and self._overlap:
            self.output.retire(ended)

    # -- teardown -----------------------------------------------------------------------------

    def send_engine_dead(self) -> None:
        """Queue the sentinel and give the output thread a bounded time to flush it."""
        if self.engine is not None and self.engine.lifecycle.can(EngineEvent.FATAL_ERROR):
            self.engine.lifecycle.fire(EngineEvent.FATAL_ERROR)
        # A send blocked on a gone peer must not hold the exit. Every channel is told.
        for output in self.outputs:
            output.stop_by(time.monotonic() + OUTPUT_FLUSH_S, unless_set=True)
            output.put(self._wire.dead_sentinel, direct=False)
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
        for output in self.outputs:
            output.stop_by(time.monotonic() + (
                OUTPUT_FLUSH_S if output.peer_seen.is_set() else 0.1))
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
                    self.output.put(self._wire.dead_sentinel, direct=False)
                for channel, session in enumerate(self._sessions):
                    if say_gone and session is not None:
                        self.outputs[channel].put(self._wire.dead_sentinel, direct=False)
                # Deferred calls the shutdown failed get no reply: to the front end the
                # engine went away under them, and it says so (EngineDeadError) once it sees
                # the exit; a UtilityError would blame the method. After the front end's own
                # shutdown nobody waits for them anyway.
                self._replies.clear()
            except Exception:
                logger.exception("engine shutdown raised")
        for output in self.outputs:
            output.output_queue.put(STOP_OUTPUT)
        # Time to flush the last outputs, if a front end ever connected. Without one a send
        # only waits for a peer that never comes: terminating the context below ends it at
        # once.
        flush_s = OUTPUT_FLUSH_S if any(o.peer_seen.is_set() for o in self.outputs) else 0.1
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
        self.faults = injector  # before the IO threads start
        for output in self.outputs:
            output.faults = injector
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
    input_address: str | Sequence[str],
    output_address: str | Sequence[str],
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
    proc_class: type[EngineCoreProc] | None = None,
    front_end_timeout_s: float | None = None,
) -> int:
    """Build the engine, handshake with the client at the given addresses, serve until told
    to stop. Returns the process exit status (0 clean, 1 fatal); with
    ``raise_startup_errors`` a failure to start is raised instead (after cleanup), so a
    command line can say it in one line. ``parent_pid`` turns on the
    parent-death watch; engines started by ``enginewire engine`` pass None. ``fault`` is a
    test hook: a ``FaultPlan``, ``Fault`` or spec string (``runtime/faults.py``). ``curve``
    makes both sockets CURVE clients of the front end (plain tcp needs
    ``allow_insecure_tcp=True``); ``limits`` bounds the input (docs/security.md).
    ``parent_lifeline``: an fd that reads EOF once the parent is gone (runtime/engine_launch.py).
    ``proc_class``: an ``EngineCoreProc`` subclass speaking another wire (runtime/vllm_wire.py).
    Several front ends: lists of addresses, the i-th pair for front end ``client_index`` i
    (spec/session.py); ``front_end_timeout_s`` ends the work of a front end silent for that
    long (its client sends heartbeats within it). docs/runtime.md, "Several front ends".
    ``ENGINEWIRE_ENGINE_PRELOAD`` names code to run first (runtime/preload.py)."""
    signals = ShutdownSignals()
    signals.install()
    proc: EngineCoreProc | None = None
    constructed = stopped = False
    try:
        # First, and a start-up failure like any other: what a preload changes (the testing
        # package patches functions) must already hold for the parent watch and the engine.
        run_preloads()
        if parent_pid is not None:
            watch_parent(parent_pid, parent_lifeline)
        proc = (proc_class or EngineCoreProc)(
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
            front_end_timeout_s=front_end_timeout_s,
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


def configure_logging() -> None:
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


def process_main(config_type: type, config_bytes: bytes, kwargs: dict[str, Any]) -> None:
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
    configure_logging()
    threads = os.environ.get("ENGINEWIRE_ENGINE_THREADS")
    if threads and getattr(config, "model", None) != "null":
        # CPU engines on a shared machine (CI) oversubscribe cores with torch's default; a
        # null-model engine never loads torch, so it is not imported for this either.
        import torch

        torch.set_num_threads(int(threads))
    try:
        if "trace" not in kwargs:
            # Trace mode for a launched engine: its lifecycles' records, for drain_trace.
            kwargs = {**kwargs, "trace": engine_trace_for(config)}
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
