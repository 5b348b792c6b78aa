"""A data-parallel client's members (dp_client.py): one-engine clients that tell their
owner when anything arrives in their output queue, when their engine dies and when a power
reply (sleep, wake-up, pause, resume: in time or late) moved their lifecycle."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

from ..protocol.messages import EngineCoreOutputs
from ..spec.errors import EngineDeadError
from .async_mp_client import AsyncMPClient
from .mp_client import MPClient
from .sync_mp_client import SyncMPClient

__all__ = ["AsyncMember", "SyncMember"]


class _NotifyingQueue(queue.Queue[Any]):
    """A sync member's output queue: every put also wakes the data-parallel client."""

    def __init__(self, notify: Callable[[], None]) -> None:
        super().__init__()
        self._notify = notify

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        self._notify()


class _NotifyingAsyncQueue(asyncio.Queue[Any]):
    """An async member's output queue (on its loop): every put wakes the client."""

    def __init__(self, notify: Callable[[], None]) -> None:
        super().__init__()
        self._notify = notify

    def put_nowait(self, item: Any) -> None:
        super().put_nowait(item)
        self._notify()


class _MemberMixin:
    """What a member adds to a one-engine client: it tells its owner of arrivals and death."""

    _dp_notify: Callable[[], None]
    _dp_died: Callable[[MPClient, BaseException], None]
    _dp_power: Callable[[], None]
    _abandon: threading.Event | None
    # Every batch of this (dead) incarnation was taken: the owner reads it no more. A flag on
    # the incarnation itself, not an id() in the owner: ids are reused once it is freed.
    read_to_end: bool

    def __init__(self, config: Any, *, notify: Callable[[], None],
                 died: Callable[[MPClient, BaseException], None], power: Callable[[], None],
                 abandon: threading.Event, **options: Any) -> None:
        # Set before the one-engine client starts: its output queue and death hook use them.
        self._dp_notify, self._dp_died, self._dp_power = notify, died, power
        self._abandon = abandon
        self.read_to_end = False
        super().__init__(config, **options)  # type: ignore[call-arg]

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
        return _NotifyingQueue(self._dp_notify)

    def has_output(self) -> bool:
        return bool(self._outputs.qsize() or self._redeliver)

    def take(self) -> EngineCoreOutputs | None:
        out = self.get_output(0)
        return out if (out.outputs or out.stream_ids or out.scheduler_stats
                       or out.finished_requests) else None


class AsyncMember(_MemberMixin, AsyncMPClient):
    def _new_output_queue(self) -> asyncio.Queue[Any]:
        return _NotifyingAsyncQueue(self._dp_notify)

    def has_output(self) -> bool:
        q = self._outputs
        return bool((q is not None and not q.empty()) or self._redeliver)

    def take(self) -> EngineCoreOutputs | None:
        return self._output_nowait()
