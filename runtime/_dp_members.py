"""A data-parallel client's members (dp_client.py): one-engine clients that tell their
owner when anything arrives in their output queue, when their engine dies and when a power
reply (sleep, wake-up, pause, resume: in time or late) moved their lifecycle.

``Member`` is everything the data-parallel client uses of one: ``MPClient``'s member surface
(``send_add``, ``send_abort``, ``dead_cause``, ``bind_loop``, ``abort_left_behind``) and what
this module adds (``has_output``, ``take``, ``read_to_end``). A member tracks no request: its
owner does, once (one CLIENT_REQUEST lifecycle per request, where the caller reads).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ..protocol.messages import EngineCoreOutputs, EngineCoreRequest
from ..spec.client import ClientEvent, ClientState
from ..spec.errors import EngineDeadError
from ..spec.machine import Lifecycle
from .async_mp_client import AsyncMPClient
from .mp_client import BackgroundResources, MPClient
from .sync_mp_client import SyncMPClient

__all__ = ["AsyncMember", "Member", "SyncMember"]


class Member(Protocol):
    """One engine's client as its data-parallel owner sees it."""

    engine_index: int
    # Every batch of this (dead) incarnation was taken: the owner reads it no more. A flag on
    # the incarnation itself, not an id() in the owner: ids are reused once it is freed.
    read_to_end: bool
    # Why a scale-down took this incarnation (its requests still live then end ABORT with
    # this as their error); None for one that died.
    removal: str | None
    lifecycle: Lifecycle[ClientState, ClientEvent]
    resources: BackgroundResources
    ready_response: Any

    @property
    def is_dead(self) -> bool: ...
    @property
    def is_closed(self) -> bool: ...
    @property
    def dead_cause(self) -> BaseException | None: ...
    @property
    def engine_pid(self) -> int | None: ...
    def send_add(self, request: EngineCoreRequest) -> None: ...
    def send_abort(self, request_ids: list[str]) -> None: ...
    def abort_left_behind(self, request_ids: list[str]) -> None: ...
    def bind_loop(self) -> None: ...
    def has_output(self) -> bool: ...
    def take(self) -> EngineCoreOutputs | None: ...
    def watch_finishes(self) -> None: ...
    def finishes_arrived(self) -> frozenset[str] | set[str]: ...
    def pending_utility_calls(self) -> int: ...
    def queued_outputs(self) -> int: ...
    def send_raw_frames(self, frames: list[bytes]) -> None: ...
    def shutdown(self, timeout: float | None = None) -> None: ...


class _NotifyingQueue(queue.Queue[Any]):
    """A sync member's output queue: every put is told to the member (``_arrived``)."""

    def __init__(self, arrived: Callable[[Any], None]) -> None:
        super().__init__()
        self._arrived = arrived

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        self._arrived(item)


class _NotifyingAsyncQueue(asyncio.Queue[Any]):
    """An async member's output queue (on its loop): every put is told to the member."""

    def __init__(self, arrived: Callable[[Any], None]) -> None:
        super().__init__()
        self._arrived = arrived

    def put_nowait(self, item: Any) -> None:
        super().put_nowait(item)
        self._arrived(item)


def _finishes(item: Any) -> list[str]:
    outs = getattr(item, "outputs", None)  # a batch, or a marker
    return [o.request_id for o in outs if o.finish_reason is not None] if outs else []


class _MemberMixin:
    """What a member adds to a one-engine client: it tells its owner of arrivals and death."""

    _tracks_requests = False  # its owner tracks them (one lifecycle per request)
    _dp_notify: Callable[[], None]
    _dp_died: Callable[[MPClient, BaseException], None]
    _dp_power: Callable[[], None]
    _abandon: threading.Event | None
    read_to_end: bool
    removal: str | None
    # While a scale-down drains this engine: the ids whose finishing output has arrived in
    # its queue (read or not). None otherwise: no per-batch work on the serving path.
    _finished: set[str] | None = None

    def __init__(self, config: Any, *, notify: Callable[[], None],
                 died: Callable[[MPClient, BaseException], None], power: Callable[[], None],
                 abandon: threading.Event, **options: Any) -> None:
        # Set before the one-engine client starts: its output queue and death hook use them.
        self._dp_notify, self._dp_died, self._dp_power = notify, died, power
        self._abandon = abandon
        self.read_to_end = False
        self.removal = None
        super().__init__(config, **options)  # type: ignore[call-arg]

    def _arrived(self, item: Any) -> None:
        """Something was put in the output queue (the reader's thread, or the loop)."""
        finished = self._finished
        if finished is not None:
            finished.update(_finishes(item))
        self._dp_notify()

    def _queued(self) -> list[Any]:
        raise NotImplementedError

    def _death_expected(self) -> bool:
        return self.removal is not None

    def watch_finishes(self) -> None:
        """From now on, note each finishing output as it arrives (a drain's end is every
        request finished at the engine, read or not). Set before the queue is looked at:
        a batch put meanwhile is noted by its put or seen in the queue (a C-level copy)."""
        finished: set[str] = set()
        self._finished = finished
        for item in self._queued():
            finished.update(_finishes(item))

    def finishes_arrived(self) -> frozenset[str] | set[str]:
        return self._finished or frozenset()

    def _on_power_reply(self, method: str, result: Any) -> None:
        # The owner's power state is derived from its members' (dp_client.py): told after
        # every reply that moved this one, a late one too, whatever this one's outcome.
        try:
            super()._on_power_reply(method, result)  # type: ignore[misc]
        finally:
            self._dp_power()

    def _mark_dead(self, cause: BaseException | None) -> bool:
        # Told before the engine's calls fail: a caller whose call raised EngineDeadError
        # finds the engine dead in the owner's membership too.
        first: bool = super()._mark_dead(cause)  # type: ignore[misc]
        if first:
            self._dp_died(self, cause or EngineDeadError())  # type: ignore[arg-type]
        return first


class SyncMember(_MemberMixin, SyncMPClient):
    def _new_output_queue(self) -> queue.Queue[Any]:
        return _NotifyingQueue(self._arrived)

    def _queued(self) -> list[Any]:
        return list(self._outputs.queue)

    def has_output(self) -> bool:
        return bool(self._outputs.qsize() or self._redeliver)

    def take(self) -> EngineCoreOutputs | None:
        out = self.get_output(0)
        return out if (out.outputs or out.stream_ids or out.scheduler_stats
                       or out.finished_requests) else None


class AsyncMember(_MemberMixin, AsyncMPClient):
    def _new_output_queue(self) -> asyncio.Queue[Any]:
        return _NotifyingAsyncQueue(self._arrived)

    def _queued(self) -> list[Any]:
        q = self._outputs
        return [] if q is None else list(q._queue)  # type: ignore[attr-defined]

    def has_output(self) -> bool:
        q = self._outputs
        return bool((q is not None and not q.empty()) or self._redeliver)

    def take(self) -> EngineCoreOutputs | None:
        return self._output_nowait()
