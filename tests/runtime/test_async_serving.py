"""AsyncMPClient inside a serving loop: building, leaving ``async with`` and mixing shutdown
flavours never stall the loop's other tasks for an engine's start or teardown."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import pytest

from enginewire import EngineConfig
from enginewire.runtime import AsyncMPClient, make_client, make_client_async

NULL = EngineConfig(model="null")


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_make_client_async_builds_off_the_loop_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    built_on: list[threading.Thread] = []
    init = AsyncMPClient.__init__

    def recording_init(self: AsyncMPClient, *args: Any, **kw: Any) -> None:
        built_on.append(threading.current_thread())
        init(self, *args, **kw)

    monkeypatch.setattr(AsyncMPClient, "__init__", recording_init)

    async def main() -> Any:
        client = await make_client_async(NULL)
        async with client:
            assert isinstance(client, AsyncMPClient)
            return await client.echo_async("up")  # type: ignore[attr-defined]

    assert asyncio.run(main()) == "up"
    assert len(built_on) == 1 and built_on[0] is not threading.main_thread()


def test_cancelling_make_client_async_shuts_the_client_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[AsyncMPClient] = []
    started = threading.Event()
    init = AsyncMPClient.__init__

    def recording_init(self: AsyncMPClient, *args: Any, **kw: Any) -> None:
        started.set()
        init(self, *args, **kw)
        built.append(self)

    monkeypatch.setattr(AsyncMPClient, "__init__", recording_init)

    async def main() -> None:
        task = asyncio.create_task(make_client_async(NULL))
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 30
        while not (built and built[0].is_closed):
            assert time.monotonic() < deadline, "the cancelled build was not shut down"
            await asyncio.sleep(0.01)

    asyncio.run(main())
    client = built[0]
    client.resources.wait_finished(30)
    assert not _alive(client.engine_pid)


def test_leaving_async_with_tears_down_off_the_loop_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torn_on: list[threading.Thread] = []
    shutdown = AsyncMPClient.shutdown

    def recording_shutdown(self: AsyncMPClient, timeout: float | None = None) -> None:
        torn_on.append(threading.current_thread())
        shutdown(self, timeout)

    monkeypatch.setattr(AsyncMPClient, "shutdown", recording_shutdown)

    async def main() -> None:
        async with make_client(NULL, multiprocess=True, asyncio=True) as client:
            await client.echo_async(1)  # type: ignore[attr-defined]

    asyncio.run(main())
    assert torn_on and torn_on[0] is not threading.main_thread()


def test_a_sync_shutdown_on_the_loop_during_shutdown_async_does_not_wait_for_the_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The teardown thread used to wait 5 s for the loop to close the output socket while the
    loop's thread was blocked in shutdown(), waiting for that same teardown."""

    async def main() -> float:
        client = make_client(NULL, multiprocess=True, asyncio=True)
        await client.echo_async(1)  # type: ignore[attr-defined]
        task = asyncio.create_task(client.shutdown_async())  # type: ignore[attr-defined]
        await asyncio.sleep(0)  # the teardown thread starts
        t0 = time.monotonic()
        client.shutdown()  # on the loop's thread, while the other teardown runs
        took = time.monotonic() - t0
        await task
        assert not _alive(client.engine_pid)
        return took

    with caplog.at_level(logging.WARNING):
        took = asyncio.run(main())
    assert not [r for r in caplog.records if "did not close the output socket" in r.message]
    assert took < 4.0, took
