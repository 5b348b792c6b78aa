"""What shutdown() promises of a multi-process client (found missing by a mutation audit).

Every blocked reader wakes, an engine that does not stop within the grace is killed (and the
grace is the one asked for), and nothing the client sent stays pinned by it afterwards. A
request refused before it was sent never becomes live.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
import weakref
from multiprocessing import resource_tracker
from typing import Any

import numpy as np
import pytest

from enginewire import ClientClosedError, UtilityTimeoutError, make_client
from enginewire.protocol.codec import Limits
from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
from enginewire.runtime.config import EngineConfig
from enginewire.testing.oracle import ResourceSnapshot, check_released

NULL = EngineConfig(model="null", device="cpu")
BOUND_S = 30.0
WAITERS = 6


def _req(rid: str, prompt: list[int], **kw: Any) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=3), **kw)


def _wait_until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_every_thread_blocked_in_get_output_wakes_at_shutdown() -> None:
    """The close marker is handed on from waiter to waiter: with one marker taken by the
    first, the others would wait for good."""
    client = make_client(NULL, multiprocess=True, asyncio=False)
    outcomes: list[str] = []

    def wait() -> None:
        try:
            client.get_output()  # no timeout: only the shutdown can end it
            outcomes.append("batch")
        except ClientClosedError:
            outcomes.append("closed")

    threads = [threading.Thread(target=wait, daemon=True) for _ in range(WAITERS)]
    try:
        for t in threads:
            t.start()
        # Every one is inside the reader's wait (counted there) before the shutdown.
        _wait_until(lambda: client._reader._callers == WAITERS, "the waiters to block")
    finally:
        client.shutdown()
    for t in threads:
        t.join(5.0)
    assert not any(t.is_alive() for t in threads), "a get_output() never returned"
    assert outcomes == ["closed"] * WAITERS


def test_every_task_awaiting_get_output_wakes_at_shutdown() -> None:
    async def main() -> list[str]:
        client = make_client(NULL, multiprocess=True, asyncio=True)

        async def wait() -> str:
            try:
                await client.get_output_async()
                return "batch"
            except ClientClosedError:
                return "closed"

        tasks = [asyncio.create_task(wait()) for _ in range(WAITERS)]
        try:
            deadline = time.monotonic() + BOUND_S
            while client._outputs is None or len(client._outputs._getters) < WAITERS:
                assert time.monotonic() < deadline, "the tasks did not block"
                await asyncio.sleep(0.005)
        finally:
            await client.shutdown_async()
        done, pending = await asyncio.wait(tasks, timeout=5.0)
        for t in pending:
            t.cancel()
        assert not pending, "a get_output_async() never returned"
        return [t.result() for t in done]

    assert asyncio.run(main()) == ["closed"] * WAITERS


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["option", "argument"])
def test_an_engine_stuck_in_a_step_is_killed_after_the_grace_asked_for(how: str) -> None:
    """The grace (``shutdown_timeout_s``, or ``shutdown(timeout=)``) is 0.5 s here, against a
    step that lasts 60 s: SIGTERM waits for the step, so only the SIGKILL after the grace
    ends the engine, and shutdown returns once it is gone."""
    options = {"shutdown_timeout_s": 0.5} if how == "option" else {}
    client = make_client(NULL, multiprocess=True, asyncio=False,
                         engine_fault="step:1:delay:60", **options)
    pid = client.engine_pid
    client.add_request(_req("r", [5]))
    # A call the engine does not answer finds it inside its step (one that arrives before
    # the step starts is answered first).
    deadline = time.monotonic() + BOUND_S
    while True:
        assert time.monotonic() < deadline, "the engine never entered its long step"
        try:
            client.call_utility("echo", 1, timeout=0.5)
        except UtilityTimeoutError:
            break
    start = time.monotonic()
    if how == "option":
        client.shutdown()
    else:
        client.shutdown(timeout=0.5)
    took = time.monotonic() - start
    assert _pid_gone(pid), "the engine outlived shutdown()"
    assert took < 3.0, f"shutdown took {took:.1f} s with a 0.5 s grace (the default is 5 s)"


def test_shutdown_lets_go_of_what_the_client_sent() -> None:
    """An array sent as an aux frame is kept until libzmq is done with it; after shutdown the
    client must not pin it (a front end may keep the client object around)."""
    client = make_client(NULL, multiprocess=True, asyncio=False)
    arr = np.zeros(4 << 20, np.uint8)  # large enough to travel as a zero-copy aux frame
    client.add_request(_req("t", [5], tensors={"x": arr}))
    client.shutdown()
    ref = weakref.ref(arr)
    del arr
    gc.collect()
    assert ref() is None, "a shut-down client still pins a sent array"


def test_a_request_refused_before_sending_never_becomes_live() -> None:
    """A frame over the engine's bound is refused on the client's side: the id never left,
    so it is not live and may be used again."""
    with make_client(NULL, multiprocess=True, asyncio=False,
                     engine_limits=Limits(max_frame_bytes=1 << 16)) as client:
        with pytest.raises(ValueError, match="max_frame_bytes"):
            client.add_request(_req("r", [5] * 100_000))
        assert client.live_requests() == []
        client.add_request(_req("r", [5]))  # the same id: accepted
        assert client.live_requests() == ["r"]


class _Interrupt(BaseException):
    """Stands in for the KeyboardInterrupt of a Ctrl-C pressed during shutdown's grace."""


@pytest.mark.timeout(60)
def test_ctrl_c_during_the_grace_still_reclaims_everything() -> None:
    """Ctrl-C while shutdown() waits out the grace for a hung engine (the moment a user
    presses it): the interrupt still reaches the caller, and nothing is left behind. Before
    the fix the teardown stopped where the interrupt landed: the engine was never killed or
    reaped, the reader thread, sockets and ipc directory stayed, and a second shutdown()
    returned at once, since the teardown counted as done."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    resource_tracker.ensure_running()  # once per process: not this client's
    before = ResourceSnapshot.take()
    client = make_client(NULL, multiprocess=True, asyncio=False,
                         engine_fault="step:1:delay:60")
    pid = client.engine_pid
    ipc_dir = client.resources.ipc_dir
    assert ipc_dir is not None
    client.add_request(_req("r", [5]))
    deadline = time.monotonic() + BOUND_S
    while True:  # as above: wait until the engine is inside its long step
        assert time.monotonic() < deadline, "the engine never entered its long step"
        try:
            client.call_utility("echo", 1, timeout=0.5)
        except UtilityTimeoutError:
            break

    def interrupt(*_: object) -> None:
        raise _Interrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)  # inside the default 5 s grace
        with pytest.raises(_Interrupt):
            client.shutdown()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    client.shutdown()  # returns: nothing is left to do
    check_released(before, engine_pid=pid, ipc_path=str(ipc_dir.path))
