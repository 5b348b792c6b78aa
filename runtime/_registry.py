"""The drivers of the UTILITY machine (spec/utility.py), one lifecycle per call.

``UtilityRegistry``: a multi-process client's calls, registered before their frame is sent,
each ended exactly once (a reply, a death, a shutdown, a cancel or a timeout); a reply with
no entry is dropped. Shared by the sync and async clients (mp_client.py).
``utility_outcome``: a call answered in the caller's own thread (the in-process client, the
data-parallel client over its engines): its error ends the lifecycle with the event
spec/utility.py maps it to, so no client decides an outcome of its own.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ..protocol.codec import decode_utility_result
from ..protocol.messages import UtilityOutput
from ..protocol.results import PLAIN_RESULTS
from ..protocol.utilities import POWER_METHODS
from ..spec.errors import (
    ProtocolError,
    SpecViolation,
    UtilityError,
)
from ..spec.machine import Lifecycle, TraceEntry
from ..spec.utility import UTILITY, UtilityEvent, UtilityState, outcome_of

__all__ = ["UtilityRegistry", "utility_outcome"]

# One logger for the multi-process client, whichever of its modules logs.
logger = logging.getLogger("enginewire.runtime.mp_client")


# Late replies remembered (to record their drop in the trace); bounded, oldest forgotten.
_LATE_MEMORY = 256


@contextlib.contextmanager
def utility_outcome(lc: Lifecycle[Any, UtilityEvent]) -> Iterator[None]:
    """Around one call whose outcome is known in this thread: an error raised inside fires
    the event spec/utility.py maps it to (``outcome_of``) unless ``lc`` has ended already;
    the caller fires REPLY_OK itself once it has the result."""
    try:
        yield
    except BaseException as e:
        event = outcome_of(e)
        if event is not None and lc.can(event):
            lc.fire(event)
        raise


# --- utility registry ------------------------------------------------------------------------


class _Pending(Lifecycle[UtilityState, UtilityEvent]):
    """One pending call: its lifecycle (one object per round trip, not two), the future it
    answers and the method it called. Built by ``Lifecycle.__init__`` (the registry sets the
    other two): one constructor call per round trip, not two."""

    __slots__ = ("future", "method")
    future: Any  # concurrent.futures.Future, asyncio.Future or _SyncCall
    method: str


class UtilityRegistry:
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
                    if type(result) not in PLAIN_RESULTS:
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
        if reply.failure_message is None and type(reply.result) in PLAIN_RESULTS:
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
                        set_future(fut, violation, None)
                        return
                try:
                    fut.set_result(reply.result)
                except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
                    pass  # cancelled in between: the reply is dropped
                return
        hit = self.resolve(reply)
        if hit is not None:
            set_future(*hit)

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


def drain_queue(q: asyncio.Queue[Any]) -> list[Any]:
    """Everything in ``q``, taken without blocking."""
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except asyncio.QueueEmpty:
            return out


def retrieve_exception(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def set_future(fut: Any, error: BaseException | None, result: Any) -> None:
    if fut.done():
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
        pass  # cancelled in between: the reply is dropped


