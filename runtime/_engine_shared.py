"""What the engine process's threads share (runtime/engine_proc.py), and nothing more.

Theory of operation
-------------------
Every piece of the engine process's state has one owner, and the owner says which thread
touches it:

* the **busy loop** (``EngineCoreProc``, the main thread) owns the engine, the replies it
  owes and the attached session;
* the **input thread** owns ``EngineInput`` (runtime/_engine_input.py): the DEALER, the
  session phase, the ready handshake;
* the **output thread** owns ``EngineOutput`` (runtime/_engine_output.py): the PUSH, its
  lock, the count of items queued ahead, the buffers and the encoder. Other threads send
  only through its public methods, which take its lock.

Between them pass only the two queues (``queue.SimpleQueue``: thread-safe; the input one an
``InputQueue`` that counts), the
``EngineGate`` below, and, with frame integrity, the link's one ``LinkIntegrity`` (locked on
its own: each direction's acks ride on the other's messages). This module holds the gate,
the input queue's control items and the idle bound every wait is sliced by.
"""

from __future__ import annotations

import enum
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ..spec.engine import IN_LOOP, EngineState

__all__ = ["IDLE_WAKE_S", "Control", "EngineGate", "InputQueue", "LoopState"]

T = TypeVar("T")

# Longest an idle busy loop waits before it looks at pending signals (EngineGate.park).
# The input thread's idle poll and the output socket's blocking send are sliced by it too;
# each module reads its own binding of it, so a test patches it in the reader's module.
IDLE_WAKE_S = 0.5


class Control(enum.Enum):
    # Items of the input queue that do not come from the wire.
    SHUTDOWN = "shutdown"
    OUTPUTS = "outputs"  # an output built by the input thread (a rejection)
    REJECT_ADD = "reject_add"  # (request id, error): a malformed ADD, answered in order
    WAKE = "wake"  # the input thread served a call that left the loop work to do
    END_SESSION = "end_session"  # the front end's link failed the integrity check
    FATAL = "fatal"  # an error the input thread met running the engine: the loop raises it
    # (channel, generation): a served front end is gone (heartbeat deadline or goodbye) on an
    # engine serving several front ends; its work ends (spec/session.py, FRONT_END_GONE).
    FRONT_END_GONE = "front_end_gone"


class InputQueue(queue.SimpleQueue[Any]):
    """The engine process's input queue: a ``SimpleQueue`` that also counts what was put in
    and what the busy loop has taken *while holding the gate*, so that ``settled()`` (nothing
    queued, nothing in the loop's hands) is exact. ``empty()`` alone is not: a parked loop
    whose ``wait`` just returned an item has emptied the queue but not yet taken the gate
    back, and a call run past the gate then would overtake that item (EngineGate, Rule 2)."""

    def __init__(self) -> None:
        super().__init__()
        self._count_lock = threading.Lock()  # puts come from several threads
        self._queued = 0
        self._taken = 0  # written by the busy loop only, holding the gate

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        with self._count_lock:
            self._queued += 1
            super().put(item)

    def get_nowait(self) -> Any:
        """The busy loop's take while it holds the gate: counted at once."""
        item = super().get_nowait()
        self._taken += 1
        return item

    def wait(self, timeout: float) -> Any:
        """The parked loop's take, the gate open: the next item, or None after ``timeout``;
        not counted until the loop holds the gate again (``taken``)."""
        try:
            return super().get(timeout=timeout)
        except queue.Empty:
            return None

    def taken(self) -> None:
        """The loop holds the gate again with the item ``wait`` returned."""
        self._taken += 1

    def settled(self) -> bool:
        """Every item put in was taken by the loop holding the gate (Rule 2's 'nothing is
        queued for it'); a put racing this read makes it False, the safe answer."""
        return self._taken == self._queued


class LoopState(Protocol):
    """What the gate reads of the engine: its lifecycle's state (``spec.machine.Lifecycle``)."""

    @property
    def state(self) -> EngineState: ...


class EngineGate:
    """Who may drive the engine: the lock protocol between the busy loop and the input thread.

    Rule 1: the busy loop drives the engine. It holds the gate from the start (a gate is made
    held) and lets go only while it is *parked*: blocked in ``park`` on the input queue, idle
    or backing off over work that makes no progress. ``park`` takes the gate back before it
    returns, so the loop handles what it got as the engine's only driver.
    Rule 2: another thread may drive the engine only through ``try_run_parked(fn, arg)``,
    and only while ``may_run_parked()``: the loop is parked, nothing is queued for it nor in
    its hands (``InputQueue.settled``: an item its wait just returned counts), and the
    engine is in the loop's states (``IN_LOOP``: past the handshake, before death or
    shutdown). Otherwise it gets False and queues its item for the loop, the general path.
    With nothing queued, nothing is overtaken; a loop woken meanwhile waits for the gate, so
    nothing it sends overtakes what ``fn`` sent.
    Rule 3: ``fn`` never blocks, and leaves whatever the loop must do next as an item on the
    input queue (``Control.WAKE``, ``Control.FATAL``) before the gate opens again.

    ``try_run_parked`` never waits for the gate: a loop that holds it is driving the engine,
    and the caller's item belongs behind the loop's work anyway. The gate runs on the input
    thread's idle-call path and parked admission (runtime/_engine_input.py), each a thread
    hop less per message than the queue.
    """

    __slots__ = ("_lock", "_loop", "_queue")

    def __init__(self, input_queue: InputQueue, loop: LoopState) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()  # Rule 1: the loop's, until it first parks
        self._queue = input_queue
        self._loop = loop

    def park(self, timeout: float) -> Any:
        """The busy loop's wait on the input queue: its next item, or None after ``timeout``.
        The gate is open for the wait and held again on return (Rule 1)."""
        lock = self._lock
        lock.release()
        item = None
        try:
            item = self._queue.wait(timeout)
        finally:
            lock.acquire()
            if item is not None:
                self._queue.taken()
        return item

    def may_run_parked(self) -> bool:
        """Rule 2's condition past the gate's lock: the fast paths' predicate (the idle call,
        parked admission), beside the general path of queueing for the loop."""
        return self._queue.settled() and self._loop.state in IN_LOOP

    def try_run_parked(self, fn: Callable[[T], object], arg: T) -> bool:
        """Run ``fn(arg)`` on this thread if the loop is parked (Rule 2); False, having run
        nothing, when the caller must queue its item for the loop instead."""
        lock = self._lock
        if not lock.acquire(blocking=False):
            return False
        try:
            if not self.may_run_parked():
                return False
            fn(arg)
            return True
        finally:
            lock.release()
