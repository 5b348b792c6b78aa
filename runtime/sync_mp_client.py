"""``SyncMPClient``: the blocking multi-process client. Whoever waits reads the output socket
(``_SyncReader``); a background thread only when nobody has read for a while.

What this client keeps of ``get_output`` and ``call_utility`` is its waiting: the reader's
blocking wait, a ``queue.Queue`` taken from under the client's lock, a ``_SyncCall`` for each
call's outcome, and the Ctrl-C hold around a batch being returned. The steps around the wait
are ``MPClient``'s (mp_client.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import zmq

from ..protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
)
from ..spec.errors import ClientClosedError
from ._background import SigintHold
from .args import (
    MAX_WAIT_SLICE_S,
    check_timeout,
)
from .client import SyncClientMixin
from .mp_client import CLOSED_MARKER, DEAD_MARKER, MPClient, only_markers
from .zmq_io import ZMQ_NOBLOCK

__all__ = ["SyncMPClient"]

# One logger for the multi-process client, whichever of its modules logs.
logger = logging.getLogger("enginewire.runtime.mp_client")


# --- sync ------------------------------------------------------------------------------------


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


# How often a caller waiting out the attach phase looks again (the background reader's routing
# of the marker wakes it at once; this bounds a wake-up lost to an interrupted wait).
_ATTACH_WAIT_S = 0.05


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
        # A message read whose routing an exception (Ctrl-C) interrupted: routed first by
        # the next reader, which holds the socket as this one did.
        self._held: bytes | None = None
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
        first = self._held
        if first is not None:
            self._held = None
        else:
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
        except BaseException:
            # Interrupted (Ctrl-C) while routing what it read: the next reader routes it
            # again, so no message is lost, the attach marker included (without it every
            # later reply would be dropped). Routing again is safe: decoding changes
            # nothing, a reply already settled is dropped as late, a marker already taken
            # reads as a heartbeat.
            self._held = first
            raise
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
                attaching = self._attaching()
                if self._reading:
                    if self._bg_reading and not self._kicked and not attaching:
                        self._kicked = True
                        self._kick_locked()
                    cv.wait(None if remaining is None else min(remaining, MAX_WAIT_SLICE_S))
                    continue
                if attaching:
                    # Until the attach marker only the background thread reads (below).
                    self._bg_cv.notify()
                    cv.wait(_ATTACH_WAIT_S if remaining is None else min(remaining,
                                                                         _ATTACH_WAIT_S))
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
            if (self._reading or self._callers or self._closing or self._stopped
                    or self._attaching()):
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

    def _attaching(self) -> bool:
        """Whether the client still awaits its attach marker. Until then only the background
        thread reads: a signal handler's exception (Ctrl-C) can land in a caller's thread
        between a receive and its result, and a marker lost there would leave every later
        reply dropped as a previous front end's; no handler runs on the background thread."""
        client = self._client_ref()
        return client is not None and client._attaching is not None

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
                        if not self._reading and (self._attaching() or (
                                self._caller_reads == seen and (
                                    not self._callers or self._bg_idle_checks >= 2))):
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
        self._outputs.put(marker)
        reader = self._reader
        if reader is not None:
            reader.wake()

    def _drop_backlog(self) -> None:
        q = self._outputs
        with q.mutex:  # atomically: a reader never finds it empty in between
            kept = only_markers(q.queue)
            q.queue.clear()
            q.queue.extend(kept)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.send_add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.send_abort(request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """Next batch; an empty batch if ``timeout`` passes first. Outputs queued before a
        death are still delivered, then ``EngineDeadError``."""
        timeout = check_timeout(timeout)
        out = self._output_first()
        if out is not None:
            return out
        outputs = self._outputs
        reader = self._reader
        if reader is not None and not self.is_dead and outputs.empty():
            reader.wait_for(lambda: not outputs.empty(), timeout)
        # A Ctrl-C between taking a batch and returning it would lose the batch and leave
        # its requests live for good: held past the return value, then the batch is kept
        # for the next call.
        hold = SigintHold()
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
        # Dequeue and track as one step: concurrent callers then track batches in queue
        # order (tracking batch N+1 before batch N would break the request lifecycles).
        with self._state_lock:
            try:
                item = self._outputs.get_nowait()
            except queue.Empty:
                item = None
            else:
                if (item is not DEAD_MARKER and item is not CLOSED_MARKER
                        and self._tracks_requests):
                    self._track_outputs(item)
        if item is None:
            if self.is_dead:
                raise self._dead_error()
            return EngineCoreOutputs()
        return self._output_of(item)

    def _new_call(self) -> _SyncCall:
        if self._reader is None:  # construction has not reached the reader: nothing would answer
            raise ClientClosedError("the client is not running (its construction did not"
                                    " complete)")
        return _SyncCall()

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        call, call_id, timeout = self._start_call(method, args, timeout)
        reader = self._reader
        assert reader is not None  # _new_call saw to it
        try:
            if timeout is None:
                reader.wait_call(call)
            elif not reader.wait_for(call.done, timeout):
                self._call_timed_out(call_id, method, timeout)
                # The outcome won the race: its setter then wakes the reader's waiters.
                reader.wait_for(call.done, None)
        except BaseException:
            # Interrupted (Ctrl-C): nobody waits for this call any more.
            self._call_abandoned(call_id)
            raise
        return call.result()
