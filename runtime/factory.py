"""The factories: the client for a transport, and the async one built off the event loop.

Their own module so that the base client (``client.py``) does not know its subclasses: the
clients import ``client``, and only this module imports them all.
"""

from __future__ import annotations

from typing import Any

from .args import check_option_flag
from .async_mp_client import AsyncMPClient
from .client import EngineCoreClient, InprocClient
from .dp_client import AsyncDPClient, SyncDPClient
from .options import DataParallelOptions
from .sync_mp_client import SyncMPClient

__all__ = ["make_client", "make_client_async"]


def make_client(
    config: Any, *, multiprocess: bool, asyncio: bool, **options: Any
) -> EngineCoreClient:
    """The client for a transport: in-process, or a subprocess driven sync or async."""
    for name, flag in (("multiprocess", multiprocess), ("asyncio", asyncio)):
        check_option_flag(flag, name)  # "no" would read as True and pick another client
    if asyncio and not multiprocess:
        raise NotImplementedError(
            "asyncio=True needs multiprocess=True: the engine core steps synchronously, so"
            " an in-process engine cannot be awaited; run it in a subprocess instead"
        )
    if _data_parallel(config, options):
        if not multiprocess:
            raise ValueError(
                f"data_parallel_size={config.data_parallel_size} needs multiprocess=True:"
                " an in-process client steps one engine in the caller's thread; several"
                " engine cores each run in a process of their own")
        return AsyncDPClient(config, **options) if asyncio else SyncDPClient(config, **options)
    if not multiprocess:
        return InprocClient(config, **options)
    if asyncio:
        return AsyncMPClient(config, **options)
    return SyncMPClient(config, **options)


def _data_parallel(config: Any, options: dict[str, Any]) -> bool:
    """Whether the config (or a restart policy, or the data-parallel client's own options
    object) asks for the data-parallel client."""
    given = options.get("options")
    return bool(getattr(config, "data_parallel_size", 1) > 1
                or getattr(config, "data_parallel_backend", "mp") != "mp"
                or options.get("restart_dead_engines")
                or isinstance(given, DataParallelOptions))


async def make_client_async(config: Any, **options: Any) -> AsyncMPClient | AsyncDPClient:
    """``make_client(config, multiprocess=True, asyncio=True)`` for code on an event loop.

    Starting the engine process and waiting for its ready handshake takes from half a second
    (``null``) to minutes (real weights); built on the loop, every other task would stall that
    long. Here the client is built in a worker thread. Cancelling the await shuts the client
    down as soon as it is built, so nothing leaks.
    """
    import asyncio as aio  # the module; ``asyncio`` is a parameter name in this file

    loop = aio.get_running_loop()
    # The client is handed over in a box, not as the future's result: the awaited future
    # stays referenced while the awaiting task runs on (its wake-up call holds it), so a
    # caller that drops the client without awaiting again would keep it, and its engine,
    # alive (vLLM's delete test has that shape).
    box: list[AsyncMPClient | AsyncDPClient] = []
    kind = AsyncDPClient if _data_parallel(config, options) else AsyncMPClient

    def build() -> None:
        box.append(kind(config, **options))

    fut = loop.run_in_executor(None, build)
    try:
        await aio.shield(fut)
        return box.pop()
    except aio.CancelledError:
        def reclaim(done: aio.Future[None]) -> None:
            if done.cancelled() or done.exception() is not None or not box:
                return
            client = box.pop()
            try:
                loop.run_in_executor(None, client.shutdown)
            except RuntimeError:  # the loop is closing: tear down here
                client.shutdown()

        fut.add_done_callback(reclaim)
        raise
