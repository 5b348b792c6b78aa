"""``AsyncMPClient``: the asyncio multi-process client. A loop callback on the output
socket's FD feeds an ``asyncio.Queue``; utility calls are asyncio futures.

What this client keeps of ``get_output`` and ``call_utility`` is its waiting: the reader bound
to the running loop, awaiting the queue or the call's future under ``asyncio.timeout`` (the
future shielded, so a reply that races the deadline still lands), and a cancelled task's
outcome retrieved. The steps around the wait are ``MPClient``'s (mp_client.py).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from typing import Any, cast

import zmq

from ..protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
)
from ..spec.errors import ClientClosedError
from ._registry import drain_queue, retrieve_exception, set_future
from ._utilities import AsyncUtilityMethods
from .args import check_timeout
from .mp_client import CLOSED_MARKER, DEAD_MARKER, MPClient, only_markers
from .zmq_io import ZMQ_NOBLOCK, ZMQ_POLLIN

__all__ = ["AsyncMPClient", "call_on_loop"]

# One logger for the multi-process client, whichever of its modules logs.
logger = logging.getLogger("enginewire.runtime.mp_client")


# --- async -----------------------------------------------------------------------------------


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


def call_on_loop(loop: asyncio.AbstractEventLoop | None, fn: Callable[[], Any]) -> None:
    """Run ``fn`` on ``loop``: now when called there, else soon from its thread; nothing when
    there is no loop or it is closed (nobody waits on it any more)."""
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
        pass


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
        self.bind_loop()

    def bind_loop(self) -> None:
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
        for call_id in list(self._utilities._pending):
            self._call_abandoned(call_id)
        self._loop = None

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        res = self.resources
        sock = res.async_output_socket
        if sock is None:
            raise ClientClosedError(self._closed_message)
        # Batches and markers queued on a closed loop's queue are carried over unread.
        kept = drain_queue(self._outputs) if self._outputs is not None else []
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
        if self.is_dead and not any(x is DEAD_MARKER for x in kept):
            outputs.put_nowait(DEAD_MARKER)

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
            for x in only_markers(drain_queue(q)):
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
                    set_future(f, err, None)

            self._call_on_loop(fail)

    def _call_on_loop(self, fn: Any) -> None:
        call_on_loop(self._loop, fn)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.bind_loop()
        self.send_add(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.send_abort(request_ids)

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
        out = self._output_first()
        if out is not None:
            return out
        q = self._outputs
        assert q is not None  # bound by _output_first's bind_loop
        if q.empty():
            if self.is_dead:
                raise self._dead_error()
            return None
        return self._accept(q.get_nowait())

    def _accept(self, item: Any) -> EngineCoreOutputs:
        """A dequeued item as ``get_output_async`` returns it: tracked where it was taken,
        on the loop, so concurrent callers track batches in queue order."""
        if item is not DEAD_MARKER and item is not CLOSED_MARKER and self._tracks_requests:
            self._track_outputs(item)
        return self._output_of(item)

    def _new_call(self) -> asyncio.Future[Any]:
        self.bind_loop()
        assert self._loop is not None
        return self._loop.create_future()

    async def call_utility_async(
        self, method: str, *args: Any, timeout: float | None = None
    ) -> Any:
        fut, call_id, timeout = self._start_call(method, args, timeout)
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
            if not self._call_abandoned(call_id):
                # Its outcome is already on its way to ``fut``, which nobody awaits now:
                # retrieve it so asyncio does not log it as lost.
                fut.add_done_callback(retrieve_exception)
            raise
        except TimeoutError:
            self._call_timed_out(call_id, method, timeout)
        return await fut  # the outcome won the race (see MPClient._call_timed_out)

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
