"""EngineCoreClient: one surface over an in-process engine or an engine in a subprocess.

Theory of operation
-------------------
Rule 1: every client drives the spec's CLIENT lifecycle, one CLIENT_REQUEST lifecycle per live
request id and one UTILITY lifecycle per call; the code fires events, never assigns states,
and an optional ``trace`` list records every step for ``spec.validate_trace``.
Rule 2: whose fault is in the error type: after ``shutdown()`` every call raises
``ClientClosedError``; once the engine died every send raises ``EngineDeadError`` (its
``__cause__`` says why), except ``abort_requests``, which is then a silent no-op so error
paths do not raise twice.

``make_client`` (``factory``) picks the transport: ``InprocClient`` runs the engine in the
caller's thread (``get_output`` is one engine step; no threads, no sockets), ``SyncMPClient``
and ``AsyncMPClient`` (``mp_client``) put it in a subprocess behind ZMQ.
"""

from __future__ import annotations

import abc
import collections
import concurrent.futures
import itertools
import operator
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Self

from ..protocol.codec import (
    Encoder,
    check_no_dataclass,
    check_sendable,
    decode_input,
    decode_utility_result,
    encode_input,
    utility_output,
)
from ..protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    RequestType,
    UtilityRequest,
)
from ..protocol.utilities import BY_NAME as UTILITY_DECLARATIONS
from ..protocol.utilities import PAUSE_MODES as SLEEP_MODES
from ..protocol.utilities import POWER_METHODS, check_sleep_args
from ..spec.client import CLIENT, ClientEvent, ClientState
from ..spec.errors import (
    ClientClosedError,
    EngineDeadError,
    EngineStartupError,
    ProtocolError,
    SpecViolation,
    UtilityError,
    UtilityTimeoutError,
)
from ..spec.machine import Lifecycle, TraceEntry
from ..spec.request import (
    CLIENT_REQUEST,
    CLIENT_REQUEST_LIVE,
    ClientRequestEvent,
    ClientRequestState,
)
from ..spec.utility import UTILITY, UtilityEvent
from ._registry import utility_outcome
from ._utilities import SyncUtilityMethods
from .args import (
    check_method,
    check_option_flag,
    check_request_ids,
    check_timeout,
)
from .config import EngineConfig

__all__ = ["SLEEP_MODES", "EngineCoreClient", "InprocClient"]


_FINISH_EVENTS = {
    FinishReason.STOP: ClientRequestEvent.FINISH_STOP,
    FinishReason.LENGTH: ClientRequestEvent.FINISH_LENGTH,
    FinishReason.ABORT: ClientRequestEvent.FINISH_ABORT,
    FinishReason.ERROR: ClientRequestEvent.FINISH_ERROR,
}
_TERMINAL_CLIENT = CLIENT.terminal  # read once: one set lookup per call
# States where OUTPUT leads back to the same state, read from the spec's table: there an
# output changes nothing, so the per-token path skips the lookup (unless a trace records it).
_OUTPUT_SELF_LOOPS = frozenset(
    t.source for t in CLIENT_REQUEST.transitions
    if t.event is ClientRequestEvent.OUTPUT and t.guard is None and t.target is t.source
)
# The per-output path looks these up by int: an Enum member hashes in Python (~0.5 us each,
# once per output per step), an int in C.
CLIENT_REQUEST.compiled()  # gives every state its table index ``_ix``
_OUTPUT_SELF_LOOP_IX = frozenset(s._ix for s in _OUTPUT_SELF_LOOPS)  # type: ignore[attr-defined]
# A finish reason as it travels (an int, on either wire) -> the event it fires; the monitor
# (model_tests/monitor.py) reads finishes with it too.
FINISH_EVENT_BY_VALUE = {int(r): ev for r, ev in _FINISH_EVENTS.items()}
_NO_FINISH = frozenset({None})
_request_id = operator.attrgetter("request_id")
_LIST_ITERATOR: type = type(iter([]))
# Request ids a SpecViolation for refused outputs names; the rest are counted, so a batch of
# 64k refused outputs does not make a message of a megabyte.
_MAX_NAMED_IDS = 20
_finish_reason = operator.attrgetter("finish_reason")


class EngineCoreClient(abc.ABC):
    """What every client shares: lifecycles, error mapping, utility wrappers."""

    # ``columnar_outputs``: batches reach the caller as they came, token-only outputs still
    # in the ``stream_ids``/``stream_tokens`` columns (no struct and list per token); off,
    # every batch is ``expanded()`` first and ``outputs`` is all a caller reads. Presentation
    # only: every engine makes the columns (and runs the decode batch) either way, and each
    # client applies ``_presented`` at its delivery edge.
    _columnar: bool = False

    def __init__(self, config: Any, *, trace: list[TraceEntry] | None = None) -> None:
        if not isinstance(config, EngineConfig):
            # Refused here, not as an AttributeError in a spawned engine that then fails its
            # start-up (EngineStartupError naming 'resolved_device').
            raise TypeError(f"expected an EngineConfig, got {type(config).__name__} "
                            f"{config!r:.80}; e.g. EngineConfig(model='tiny')")
        if trace is not None and not isinstance(trace, list):
            raise ValueError(f"trace={trace!r}: must be a list or None")
        self.config = config
        self.trace = trace
        # Reached from the caller's thread and from reader/monitor threads.
        self._state_lock = threading.RLock()
        self.lifecycle: Lifecycle[ClientState, ClientEvent] = CLIENT.lifecycle(trace=trace)
        self._requests: dict[str, Lifecycle[ClientRequestState, ClientRequestEvent]] = {}
        # Ids whose lifecycle is in a state where OUTPUT loops (see _OUTPUT_SELF_LOOPS): a
        # batch made only of those needs no per-output work beyond a C-level subset check.
        self._streaming: set[str] = set()
        # Batches tracked and not yet returned, which every get_output returns first: the
        # legal rest of a batch that held an output the spec forbids (see _track_outputs)
        # and, on the sync client, a batch a Ctrl-C kept from its caller.
        self._redeliver: collections.deque[EngineCoreOutputs] = collections.deque()
        self._dead_cause: BaseException | None = None
        self.num_gpu_blocks: int | None = None
        # What ClientClosedError says; a forked child's copy of a client says why it is closed.
        self._closed_message = "the client was shut down"

    # -- state ------------------------------------------------------------------------------

    @property
    def state(self) -> ClientState:
        return self.lifecycle.state

    @property
    def is_dead(self) -> bool:
        return self.lifecycle.state is ClientState.DEAD

    @property
    def is_closed(self) -> bool:
        return self.lifecycle.state is ClientState.SHUTDOWN

    def _dead_error(self) -> EngineDeadError:
        err = EngineDeadError()
        err.__cause__ = self._dead_cause
        return err

    def ensure_alive(self) -> None:
        """Raise ``ClientClosedError`` after shutdown, ``EngineDeadError`` once the engine died."""
        state = self.lifecycle.state
        if state in _TERMINAL_CLIENT:  # one set lookup per call, not two enum lookups
            if state is ClientState.SHUTDOWN:
                raise ClientClosedError(self._closed_message)
            raise self._dead_error()

    def _apply_ready(self, info: Any) -> None:
        """Adopt what the engine reported it can hold (vLLM's ``_apply_ready_response``)."""
        import msgspec

        def get(key: str) -> int:
            return int(info[key] if isinstance(info, dict) else getattr(info, key))

        self.num_gpu_blocks = get("num_gpu_blocks")
        changes = {"block_size": get("block_size"),
                   "max_model_len": min(get("max_model_len"), self.config.max_model_len)}
        self.config = msgspec.structs.replace(self.config, **changes)

    def _mark_dead(self, cause: BaseException | None) -> bool:
        """Record engine death once; True if this call made the client DEAD."""
        with self._state_lock:
            if self.lifecycle.state in _TERMINAL_CLIENT:
                # A second notice loops in DEAD; after SHUTDOWN an exit is expected and is
                # absorbed, never reported.
                self.lifecycle.fire(ClientEvent.ENGINE_DIED)
                return False
            self._dead_cause = cause
            self.lifecycle.fire(ClientEvent.ENGINE_DIED)
            for lc in self._requests.values():
                lc.fire(ClientRequestEvent.ENGINE_DIED)
            self._requests.clear()
            self._streaming.clear()
            return True

    def _mark_closed(self) -> bool:
        """Fire SHUTDOWN (idempotent); True on the first call."""
        with self._state_lock:
            first = self.lifecycle.state is not ClientState.SHUTDOWN
            if self.lifecycle.state is ClientState.CONSTRUCTING:
                self.lifecycle.fire(ClientEvent.CONSTRUCTION_FAILED)
            else:
                self.lifecycle.fire(ClientEvent.SHUTDOWN)
            if first:
                self._requests.clear()
                self._streaming.clear()
            return first

    def _presented(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """A tracked batch as ``get_output`` hands it to the caller: as the engine made it
        with ``columnar_outputs``, else with its stream columns expanded into ``outputs``
        (``EngineCoreOutputs.expanded``: columns first, then ``outputs``). The one delivery
        edge of every client, in-process, multi-process and data-parallel alike."""
        return outputs if self._columnar else outputs.expanded()

    # -- request bookkeeping ------------------------------------------------------------------

    def _track_add(self, request: EngineCoreRequest) -> None:
        """Check and record an ADD before it is sent; a live duplicate id is a SpecViolation."""
        if not isinstance(request, EngineCoreRequest):
            raise TypeError(f"add_request expects an EngineCoreRequest, got {type(request)!r}")
        rid = request.request_id
        if not isinstance(rid, str):
            # The engine could not name it in an ERROR output, so it would stay live for good.
            raise TypeError(f"add_request: request_id must be a str, got {rid!r}")
        with self._state_lock:
            self.ensure_alive()
            lc = self._requests.get(rid)
            if lc is None:
                lc = CLIENT_REQUEST.lifecycle(trace=self.trace)
            if not lc.can(ClientRequestEvent.SEND) or not self.lifecycle.can(
                ClientEvent.ADD_REQUEST
            ):
                # Fire to raise the SpecViolation naming the offending transition.
                if not lc.can(ClientRequestEvent.SEND):
                    lc.fire(ClientRequestEvent.SEND)
                self.lifecycle.fire(ClientEvent.ADD_REQUEST)
            lc.fire(ClientRequestEvent.SEND)
            self.lifecycle.fire(ClientEvent.ADD_REQUEST)
            self._requests[rid] = lc
            self._note(rid, lc)

    def _note(self, rid: str, lc: Lifecycle[ClientRequestState, ClientRequestEvent]) -> None:
        if lc.state._ix in _OUTPUT_SELF_LOOP_IX:  # type: ignore[attr-defined]
            self._streaming.add(rid)
        else:
            self._streaming.discard(rid)

    def _untrack_add(self, request_id: str) -> None:
        # The send failed: the request never left, so forget it (it may be re-sent).
        with self._state_lock:
            self._requests.pop(request_id, None)
            self._streaming.discard(request_id)

    def _track_abort(self, request_ids: list[str]) -> list[str]:
        """Ids whose abort is worth sending; fires ABORT_SENT on the live ones.

        An id this client does not track (unknown, or finished and so forgotten) takes the
        spec's no-op UNKNOWN loop, on a throwaway instance that only a trace needs."""
        with self._state_lock:
            trace = self.trace
            for rid in request_ids:
                lc = self._requests.get(rid)
                if lc is not None:
                    lc.fire(ClientRequestEvent.ABORT_SENT)
                    self._note(rid, lc)
                elif trace is not None:
                    CLIENT_REQUEST.lifecycle(trace=trace).fire(ClientRequestEvent.ABORT_SENT)
        return list(request_ids)

    def _track_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Advance each request's lifecycle; an output the spec forbids raises SpecViolation.

        Reads the stream columns too (``EngineCoreOutputs.stream_ids``); a batch whose every
        output loops in its request's state costs two C-level subset checks.

        A forbidden output (an unknown id, an output after its request's finish) advances
        nothing, and costs the rest of its batch nothing either: every legal output is
        tracked, the batch without the forbidden ones is queued in ``_redeliver`` for the
        next ``get_output``, and then the SpecViolation naming the ids is raised. Raised now
        rather than on the next call, so a caller that stops reading still learns of it;
        queued before the raise, so neither a Ctrl-C nor another thread can lose the rest.
        """
        outs = outputs.outputs
        sids = outputs.stream_ids
        if not outs and not sids:
            return
        with self._state_lock:
            if self.lifecycle.state in _TERMINAL_CLIENT:
                return
            bad_sids = bad_outs = None
            if sids and not self._only_loops(sids):
                bad_sids = self._advance(zip(sids, itertools.repeat(None)), len(sids))
            if outs and not self._only_loops(map(_request_id, outs),
                                             map(_finish_reason, outs)):
                bad_outs = self._advance(
                    zip(map(_request_id, outs), map(_finish_reason, outs), strict=True),
                    len(outs))
            if bad_sids or bad_outs:
                raise self._refuse(outputs, bad_sids or [], bad_outs or [])

    def _only_loops(self, ids: Iterable[str], reasons: Iterable[Any] | None = None) -> bool:
        """Whether tracking outputs for ``ids`` (finishing for ``reasons``, None: none do)
        takes the fast path and fires nothing: no trace records the steps, none finishes,
        and each id's request is in a state where OUTPUT loops (``_streaming``), so
        ``_advance`` would change nothing. Two C-level subset checks; holds ``_state_lock``."""
        return (self.trace is None and self._streaming.issuperset(ids)
                and (reasons is None or _NO_FINISH.issuperset(reasons)))

    def _advance(self, pairs: Iterator[tuple[str, Any]], n: int
                 ) -> list[tuple[int, SpecViolation]] | None:
        """Fire each of the ``n`` ``(request id, finish reason or None)``; holds
        ``_state_lock``. A refused fire changed nothing, so it is skipped and the rest go on;
        returns the refused ones' positions and errors (None when every one was legal).

        The general path of ``_track_outputs``, which skips it when ``_only_loops`` holds;
        test_client_tracking.py feeds both the same batches and compares what they leave."""
        requests, trace, streaming = self._requests, self.trace, self._streaming
        skip = _OUTPUT_SELF_LOOP_IX if trace is None else frozenset()
        refused: list[tuple[int, SpecViolation]] | None = None
        while True:
            for rid, reason in pairs:
                lc = requests.get(rid)
                if lc is None:
                    # Unknown id, or output after a finishing one: fire to raise.
                    lc = CLIENT_REQUEST.lifecycle(trace=trace)
                try:
                    if reason is None:
                        if lc.state._ix in skip:  # type: ignore[attr-defined]
                            continue
                        lc.fire(ClientRequestEvent.OUTPUT)
                        if lc.state._ix in _OUTPUT_SELF_LOOP_IX:  # type: ignore[attr-defined]
                            streaming.add(rid)
                    else:
                        event = FINISH_EVENT_BY_VALUE.get(int(reason))
                        if event is None:  # not a FinishReason: raise the usual ValueError
                            event = _FINISH_EVENTS[FinishReason(reason)]
                        lc.fire(event)
                        requests.pop(rid, None)
                        streaming.discard(rid)
                except SpecViolation as e:
                    # The position comes from what is left, so the legal path counts nothing:
                    # the rest is listed once, at the first refusal, and from then on its
                    # list iterator says how much is left (listing it again at each refusal
                    # made a batch of refused outputs quadratic: 30 s for one of 64k).
                    refused = refused or []
                    if type(pairs) is _LIST_ITERATOR:
                        refused.append((n - operator.length_hint(pairs) - 1, e))
                        continue
                    rest = iter(list(pairs))
                    refused.append((n - operator.length_hint(rest) - 1, e))
                    pairs = rest
                    break
            else:
                return refused

    def _refuse_unsent(self, outputs: EngineCoreOutputs, sid_ix: list[int], out_ix: list[int]
                       ) -> SpecViolation:
        """The stream ids and outputs at these positions are for requests this channel was
        never sent, though this client tracks them (a data-parallel member speaking for
        another engine's request): refused as an unknown id is, touching nothing of those
        requests; the rest of the batch is tracked and redelivered. The error to raise."""
        import msgspec

        sids, outs = outputs.stream_ids, outputs.outputs
        skip_s, skip_o = set(sid_ix), set(out_ix)
        rest = msgspec.structs.replace(
            outputs,
            outputs=[o for i, o in enumerate(outs) if i not in skip_o],
            stream_ids=[r for i, r in enumerate(sids) if i not in skip_s],
            stream_tokens=[t for i, t in enumerate(outputs.stream_tokens) if i not in skip_s])
        with self._state_lock:
            self._track_outputs(rest)  # its own refusals are raised first
            bad_s = [(i, self._unsent(None)) for i in sid_ix]
            bad_o = [(i, self._unsent(outs[i].finish_reason)) for i in out_ix]
            return self._refuse(outputs, bad_s, bad_o)

    def _unsent(self, reason: Any) -> SpecViolation:
        """The error of an output (``reason`` None) or finish for a request never sent."""
        lc = CLIENT_REQUEST.lifecycle(trace=self.trace)
        try:
            lc.fire(ClientRequestEvent.OUTPUT if reason is None
                    else _FINISH_EVENTS[FinishReason(reason)])
        except SpecViolation as e:
            return e
        raise AssertionError("a new request lifecycle took an output")  # the spec says no

    def _refuse(self, outputs: EngineCoreOutputs, bad_sids: list[tuple[int, SpecViolation]],
                bad_outs: list[tuple[int, SpecViolation]]) -> SpecViolation:
        """Queue ``outputs`` less its refused outputs for the next get_output; the error to
        raise, naming them. Holds ``_state_lock``."""
        import msgspec

        sids, outs = outputs.stream_ids, outputs.outputs
        skip_s = {i for i, _ in bad_sids}
        skip_o = {i for i, _ in bad_outs}
        rest = msgspec.structs.replace(
            outputs,
            outputs=[o for i, o in enumerate(outs) if i not in skip_o],
            stream_ids=[r for i, r in enumerate(sids) if i not in skip_s],
            stream_tokens=[t for i, t in enumerate(outputs.stream_tokens) if i not in skip_s])
        if rest.outputs or rest.stream_ids or rest.finished_requests or rest.scheduler_stats:
            self._redeliver.append(self._presented(rest))
        # In the order the caller would have read them (``expanded``: columns first).
        rids = [sids[i] for i, _ in bad_sids] + [outs[i].request_id for i, _ in bad_outs]
        first = (bad_sids or bad_outs)[0][1]
        err = SpecViolation(first.machine, first.state, first.event, first.guard)
        named = ", ".join(map(repr, rids[:_MAX_NAMED_IDS]))
        if len(rids) > _MAX_NAMED_IDS:
            named += f" and {len(rids) - _MAX_NAMED_IDS} more"
        err.args = (f"{len(rids)} engine output(s) the spec forbids, for request id(s) "
                    f"{named} (first: {first}); the batch's other "
                    "outputs were tracked and the next get_output returns them",)
        return err

    def live_requests(self) -> list[str]:
        """Ids of requests sent and not yet seen finished (sorted)."""
        with self._state_lock:
            return sorted(r for r, lc in self._requests.items() if lc.state in CLIENT_REQUEST_LIVE)

    # -- utility bookkeeping ------------------------------------------------------------------

    def _new_utility_lifecycle(self) -> Lifecycle[Any, UtilityEvent]:
        return UTILITY.lifecycle(trace=self.trace)

    def _on_power_reply(self, method: str, result: Any) -> None:
        """Follow a successful reply of a ``POWER_METHODS`` call as its declaration says
        (protocol/utilities.py); ``SpecViolation`` if the spec forbids it. Runs where the
        reply is routed, in the order the engine replied: two threads calling ``sleep()`` and
        ``wake_up()`` at once leave the client in the engine's state, whichever caller
        resumes first (and so does a raw ``call_utility("sleep")``)."""
        power = UTILITY_DECLARATIONS[method].power
        assert power is not None, method
        event, guard = power.resolve(result)
        with self._state_lock:
            lc = self.lifecycle
            # A reply after the client died or shut down changes nothing; anywhere else a
            # reply the table has no row for is the engine breaking the spec (fire raises).
            if lc.can(event, guard) or lc.state not in _TERMINAL_CLIENT:
                lc.fire(event, guard)

    # -- context manager ----------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @abc.abstractmethod
    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine and release every resource; idempotent."""


class SyncClientMixin(SyncUtilityMethods):
    """The sync method set, written once over ``call_utility`` (generated from the utility
    declarations: runtime/_utilities.py)."""

    def call_utility_all(self, method: str, *args: Any, timeout: float | None = None
                         ) -> list[Any]:
        """One result per engine, in index order: here the one engine's (the data-parallel
        client asks each of its engines)."""
        return [self.call_utility(method, *args, timeout=timeout)]


# How often an in-process deferred call with nothing to step looks at its shutdown flag.
_IDLE_POLL_S = 0.01


class _TimedOut(BaseException):
    """Carries a deferred call's UtilityTimeoutError past the handler that turns the
    engine's own exceptions into a UtilityError (a BaseException: ``except Exception`` must
    not take it)."""

    def __init__(self, error: UtilityTimeoutError) -> None:
        super().__init__(str(error))
        self.error = error


class InprocClient(SyncClientMixin, EngineCoreClient):
    """The engine in the caller's thread: ``get_output`` runs one step. No threads, sockets."""

    multiprocess = False

    def __init__(self, config: Any, *, trace: list[TraceEntry] | None = None,
                 columnar_outputs: bool = False) -> None:
        columnar = check_option_flag(columnar_outputs, "columnar_outputs")
        super().__init__(config, trace=trace)
        from .engine import EngineCore

        self._columnar = columnar
        try:
            # The engine hands out its batches as a process sends them, columns and all (and
            # so runs the same scheduler path); get_output presents them (_presented).
            self.engine = EngineCore(config, inproc=True, trace=trace, stream_outputs=True)
        except Exception as e:
            self._mark_closed()
            raise EngineStartupError(f"engine core initialization failed: {e}") from e
        # Release the engine if the client is dropped without shutdown().
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        # Outputs produced while a deferred utility was being driven to completion.
        self._buffered: collections.deque[EngineCoreOutputs] = collections.deque()
        # Held around every use of the engine and the tracking of what it returned: the
        # engine core is not thread-safe (two callers stepping it at once finished a request
        # twice), and a batch must be tracked before the next step's. Reentrant: a signal
        # handler may shut down while its thread is in a call.
        self._engine_lock = threading.RLock()
        self._encoder = Encoder()
        self._apply_ready(self.engine.ready_info())
        with self._state_lock:
            self.lifecycle.fire(ClientEvent.HANDSHAKE_OK)

    def _step(self) -> EngineCoreOutputs:
        try:
            outputs: EngineCoreOutputs = self.engine.step()
        except Exception as e:
            self._mark_dead(e)
            raise self._dead_error() from e
        return outputs

    def _wire(self, kind: RequestType, obj: Any) -> Any:
        """``obj`` as the engine receives it over the wire: encoded and decoded by the codec,
        so the in-process transport refuses (``TypeError``/``ValueError`` for what cannot be
        sent, ``ProtocolError`` for what the engine would reject) and converts exactly what
        the multi-process ones do."""
        frames = encode_input(self._encoder, kind, obj)
        check_sendable(kind, frames)
        return decode_input(frames)[1]

    def add_request(self, request: EngineCoreRequest) -> None:
        with self._engine_lock:
            self._track_add(request)
            try:
                try:
                    wired = self._wire(RequestType.ADD, request)
                except ProtocolError as e:  # as the engine process answers a malformed ADD
                    self.engine.reject_request(request.request_id, f"malformed request: {e}")
                    return
                self.engine.add_request(wired)
            except Exception:
                self._untrack_add(request.request_id)
                raise

    def abort_requests(self, request_ids: list[str]) -> None:
        ids = check_request_ids(request_ids)
        with self._engine_lock:
            if self.is_closed:
                raise ClientClosedError(self._closed_message)
            if not ids or self.is_dead:
                return
            self.engine.abort_requests(self._track_abort(ids))

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """One engine step (``timeout`` is accepted for symmetry; a step never waits)."""
        check_timeout(timeout)
        with self._engine_lock:
            if self._redeliver and not self.is_closed:  # tracked already, before any death
                return self._redeliver.popleft()
            self.ensure_alive()  # under the lock: a shutdown may have run while we waited
            outputs = self._buffered.popleft() if self._buffered else self._step()
            self._track_outputs(outputs)
        return self._presented(outputs)

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        timeout = check_timeout(timeout)
        check_method(method)
        check_no_dataclass(args)
        self.ensure_alive()
        # What cannot be sent raises here, as from the multi-process clients' send.
        frames = encode_input(self._encoder, RequestType.UTILITY,
                              UtilityRequest(0, 0, method, list(args)))
        check_sendable(RequestType.UTILITY, frames)
        lc = self._new_utility_lifecycle()
        with utility_outcome(lc):  # an error ends the call as spec/utility.py maps it
            try:
                wired = decode_input(frames)[1]
            except ProtocolError as e:  # as the engine process answers a malformed call
                raise UtilityError(str(method), f"malformed call: {e}") from e
            assert isinstance(wired, UtilityRequest)
            with self._engine_lock:
                try:
                    self.ensure_alive()
                    result = self.engine.call_utility(wired.method, wired.args)
                    if isinstance(result, concurrent.futures.Future):
                        result = self._drive_deferred(result, method, timeout)
                except _TimedOut as e:
                    raise e.error from None
                except (EngineDeadError, ClientClosedError):
                    raise
                except Exception as e:
                    # Same message a remote engine would send, so both transports read alike.
                    message = utility_output(0, method, error=e).failure_message or str(e)
                    raise UtilityError(method, message) from e
                # What the engine process could not send fails here too, and a registered
                # type comes back as itself: both transports return the same thing.
                reply = utility_output(0, method, result=result)
                if reply.failure_message is not None:
                    raise UtilityError(method, reply.failure_message)
                result = decode_utility_result(reply.result)
                lc.fire(UtilityEvent.REPLY_OK)
                if wired.method in POWER_METHODS:
                    self._on_power_reply(wired.method, result)
        return result

    def _drive_deferred(self, fut: concurrent.futures.Future[Any], method: str,
                        timeout: float | None) -> Any:
        """A deferred reply's result. Nothing else steps the engine in-process: it is
        stepped while it has work; otherwise the future is waited on (a user's utility that
        another thread resolves). A shutdown from another thread waits for the engine lock:
        the call ends then (as a pending call at shutdown ends), not after the drain; and the
        caller's timeout applies, as on every client."""
        deadline = None if timeout is None else time.monotonic() + timeout
        engine = self.engine
        while not fut.done():
            if self.is_closed:
                raise ClientClosedError(self._closed_message)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                assert timeout is not None
                raise _TimedOut(UtilityTimeoutError(method, timeout))
            if engine.has_unfinished_requests() or engine.has_pending_outputs():
                outputs = self._step()
                if outputs.outputs or outputs.stream_ids or outputs.finished_requests:
                    self._buffered.append(outputs)
            else:
                concurrent.futures.wait([fut], timeout=_IDLE_POLL_S if left is None
                                        else min(_IDLE_POLL_S, left))
        return fut.result()

    def sleep(self, level: int = 1, mode: str = "abort", *,
              timeout: float | None = None) -> None:
        check_sleep_args(level, mode)
        if mode == "wait":
            raise ValueError(
                "sleep(mode='wait') is not supported in-process: nothing steps the engine"
                " while the call waits; use mode='abort' or 'keep'"
            )
        super().sleep(level, mode, timeout=timeout)

    def pause_scheduler(self, mode: str = "abort", *, timeout: float | None = None) -> None:
        if mode == "wait":
            raise ValueError("pause_scheduler(mode='wait') is not supported in-process")
        super().pause_scheduler(mode, timeout=timeout)

    def queued_outputs(self) -> int:
        """Batches stepped while a deferred call was driven (or kept back from a batch that
        held a forbidden output), not yet taken by get_output."""
        return len(self._buffered) + len(self._redeliver)

    def shutdown(self, timeout: float | None = None) -> None:
        # Nothing here waits, but a bad timeout is refused as the subprocess clients refuse it.
        check_timeout(timeout)
        if self._mark_closed() and self._finalizer.detach() is not None:
            with self._engine_lock:  # after the step another thread is running, if any
                self.engine.shutdown()

    def __repr__(self) -> str:
        return f"<InprocClient {self.lifecycle.state.name}>"
