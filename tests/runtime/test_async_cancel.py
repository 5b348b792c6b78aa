"""AsyncMPClient as a server uses it: a cancellation is never lost, and the client follows its
code from one event loop to the next once the first is closed (a second ``asyncio.run``)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import pytest

from enginewire import EngineConfig, EngineCoreRequest, SamplingParams
from enginewire.protocol import UtilityOutput
from enginewire.runtime import AsyncMPClient, make_client
from enginewire.spec import ClientClosedError, EngineDeadError

NULL = EngineConfig(model="null", max_num_seqs=64)


def req(rid: str, n: int = 2) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True))


def _client(**options: Any) -> AsyncMPClient:
    client = make_client(NULL, multiprocess=True, asyncio=True, **options)
    assert isinstance(client, AsyncMPClient)
    return client


async def _read_to_end(client: AsyncMPClient, rids: set[str], tokens: dict[str, int]) -> None:
    while rids:
        out = await client.get_output_async(timeout=30)
        assert out.outputs, "no batch within 30 s"
        for o in out.outputs:
            tokens[o.request_id] = tokens.get(o.request_id, 0) + len(o.new_token_ids)
            if o.finished:
                rids.discard(o.request_id)


def test_a_cancel_that_lands_as_the_reply_does_is_not_swallowed() -> None:
    """The reply is set by hand, then the task is cancelled after 0..5 loop hops: whenever
    ``cancel()`` says it took, the task ends cancelled. Under ``wait_for`` (Python 3.11) the
    cancel landing two hops later was swallowed and the call returned its reply."""

    async def main() -> list[tuple[int, bool, str]]:
        client = _client()
        seen: list[tuple[int, bool, str]] = []
        try:
            loop = asyncio.get_running_loop()
            for hops in range(6):
                task = asyncio.create_task(client.call_utility_async("echo", "x", timeout=30.0))
                while not client.pending_utility_calls():
                    await asyncio.sleep(0)
                (call_id,) = list(client._utilities._pending)
                client._utilities.settle(UtilityOutput(call_id, result="by hand"))
                took: list[bool] = []

                def cancel_after(n: int, task: asyncio.Task[Any] = task,
                                 took: list[bool] = took) -> None:
                    if n:
                        loop.call_soon(cancel_after, n - 1)
                    else:
                        took.append(task.cancel())

                cancel_after(hops)
                try:
                    outcome = repr(await task)
                except asyncio.CancelledError:
                    outcome = "cancelled"
                while not took:  # the task may end before the chain does
                    await asyncio.sleep(0)
                seen.append((hops, took[0], outcome))
            assert client.pending_utility_calls() == 0
            assert await client.echo_async("after", timeout=30) == "after"
        finally:
            await client.shutdown_async()
        return seen

    seen = asyncio.run(main())
    assert all(outcome == "cancelled" for _, took, outcome in seen if took), seen
    assert any(took for _, took, _ in seen) and not all(took for _, took, _ in seen), seen


async def _until_idle(client: AsyncMPClient) -> None:
    """Until the engine holds no request: its outputs precede the stats reply on the one
    output socket, so by then this loop's reader has queued every batch (bounded)."""
    deadline = time.monotonic() + 30
    while (await client.get_stats_async(timeout=30)).num_live:
        assert time.monotonic() < deadline, "the engine still holds requests after 30 s"
        await asyncio.sleep(0.01)


def test_a_second_asyncio_run_uses_the_client_and_keeps_what_was_unread() -> None:
    """Before: every call in the second run raised RuntimeError (bound to the first loop)."""
    client = _client()
    tokens: dict[str, int] = {}
    try:
        async def first() -> None:
            await client.add_request_async(req("a", 20))
            assert await client.echo_async(1, timeout=30) == 1
            await _until_idle(client)  # "a"'s batches have all arrived, and stay unread

        async def second() -> None:
            assert await client.echo_async(2, timeout=30) == 2
            await client.add_request_async(req("b", 5))
            await _read_to_end(client, {"a", "b"}, tokens)

        asyncio.run(first())
        asyncio.run(second())
        # From a plain thread's own loop too, once the previous loop is closed.
        result: list[Any] = []
        th = threading.Thread(
            target=lambda: result.append(asyncio.run(client.echo_async(3, timeout=30))))
        th.start()
        th.join(30)
        assert result == [3]
    finally:
        client.shutdown()
    assert tokens == {"a": 20, "b": 5}  # nothing of "a" was lost between the loops


def test_an_engine_that_died_between_loops_leaves_its_backlog_readable() -> None:
    """As on one loop: the batches that came before the death, then EngineDeadError (the
    next loop raised it at once, before the backlog)."""
    client = _client()
    try:
        async def first() -> None:
            await client.add_request_async(req("a", 10))
            assert await client.echo_async(1, timeout=30) == 1
            await _until_idle(client)  # every batch of "a" has arrived, unread

        asyncio.run(first())
        assert client.engine_pid is not None
        os.kill(client.engine_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not client.is_dead and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.is_dead

        async def second() -> int:
            n = 0
            with pytest.raises(EngineDeadError):
                while True:
                    out = await client.get_output_async(timeout=30)
                    assert out.outputs, "no batch or death within 30 s"
                    n += sum(len(o.new_token_ids) for o in out.outputs)
            with pytest.raises(EngineDeadError):
                await client.echo_async(2)
            return n

        assert asyncio.run(second()) == 10
    finally:
        client.shutdown()


def test_a_call_left_on_a_closed_loop_does_not_break_the_next_loop() -> None:
    """A loop closed under a task still awaiting a reply (no asyncio.run to cancel it): the
    reply, read on the next loop, is dropped; it must not be set on a future of the closed
    loop (that raises, and the reader would declare the engine dead)."""
    # The first echo's reply is held back in the engine, so it is still unread when its loop
    # closes however fast the machine (unheld, a fast reply was sometimes read in the one
    # loop turn below, and nothing was left pending).
    from enginewire.runtime.faults import Fault

    client = _client(engine_fault=Fault(point="utility", method="echo", action="delay",
                                        arg=0.3))
    try:
        old = asyncio.new_event_loop()
        task = old.create_task(client.echo_async("orphan"))
        old.run_until_complete(asyncio.sleep(0))  # the call is sent; its reply is not read
        assert client.pending_utility_calls() == 1
        old.close()
        task._log_destroy_pending = False  # type: ignore[attr-defined]  # closed under it

        async def next_loop() -> Any:
            return await client.echo_async("next", timeout=30)

        assert asyncio.run(next_loop()) == "next"
        assert not client.is_dead and client.pending_utility_calls() == 0
    finally:
        client.shutdown()


def test_another_loop_while_the_first_is_open_is_refused() -> None:
    client = _client()
    try:
        first = asyncio.new_event_loop()
        try:
            assert first.run_until_complete(client.echo_async(1, timeout=30)) == 1

            async def elsewhere() -> None:
                await client.echo_async(2, timeout=30)

            with pytest.raises(RuntimeError, match="bound to the event loop"):
                asyncio.run(elsewhere())
            assert first.run_until_complete(client.echo_async(3, timeout=30)) == 3
        finally:
            first.close()
    finally:
        client.shutdown()


@pytest.mark.parametrize("end", ["sigkill", "shutdown_async"])
def test_every_waiting_task_gets_the_typed_error(end: str) -> None:
    expected = EngineDeadError if end == "sigkill" else ClientClosedError

    async def main() -> None:
        client = _client()
        try:
            async def getter() -> None:
                while True:
                    await client.get_output_async()

            async def caller() -> None:
                while True:
                    await client.echo_async("x")

            tasks = [asyncio.create_task(getter()) for _ in range(100)]
            tasks += [asyncio.create_task(caller()) for _ in range(100)]
            await asyncio.sleep(0.1)
            if end == "sigkill":
                assert client.engine_pid is not None
                os.kill(client.engine_pid, signal.SIGKILL)
            else:
                await client.shutdown_async()
            done, pending = await asyncio.wait(tasks, timeout=30)
            for t in pending:
                t.cancel()
            assert not pending
            assert {type(t.exception()) for t in done} == {expected}
        finally:
            await client.shutdown_async()

    asyncio.run(main())
