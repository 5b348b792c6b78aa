"""A utility whose result is a Future (a deferred reply) is answered when the future
completes, idle engine or busy, on every client; the caller's timeout still applies.

The reply used to go out only after a step, and an idle engine does not step: a user's
utility resolved by another thread got no answer until the next input (the caller timed
out). In-process, a future nothing steps was waited on without end, whatever the timeout."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from enginewire import make_client
from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
from enginewire.runtime.config import EngineConfig
from enginewire.spec import UtilityTimeoutError

os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")
CONFIG = EngineConfig(model="null")
BOUND_S = 30.0
DELAY_S = 0.3


def _install(engine: Any) -> None:
    engine.UTILITY_METHODS = engine.UTILITY_METHODS | {"later", "never"}

    def later(delay: float, value: str) -> concurrent.futures.Future[str]:
        fut: concurrent.futures.Future[str] = concurrent.futures.Future()
        threading.Timer(delay, fut.set_result, (value,)).start()
        return fut

    engine.later = later
    engine.never = lambda: concurrent.futures.Future()


@pytest.fixture(params=["inproc", "sync", "async"])
def client(request: pytest.FixtureRequest, attach_client: Any) -> Iterator[Any]:
    if request.param == "inproc":
        with make_client(CONFIG, multiprocess=False, asyncio=False) as c:
            _install(c.engine)
            yield c
        return
    with attach_client(CONFIG, _install, asyncio=request.param == "async") as c:
        yield c


def _call(c: Any, method: str, *args: Any, timeout: float) -> Any:
    if hasattr(c, "call_utility_async"):
        return asyncio.run(c.call_utility_async(method, *args, timeout=timeout))
    return c.call_utility(method, *args, timeout=timeout)


def test_a_deferred_reply_goes_out_when_its_future_completes_on_an_idle_engine(
        client: Any) -> None:
    t0 = time.monotonic()
    assert _call(client, "later", DELAY_S, "idle", timeout=BOUND_S) == "idle"
    took = time.monotonic() - t0
    assert DELAY_S <= took < DELAY_S + 2.0, took  # not at some later input, nor a timeout
    assert _call(client, "echo", "after", timeout=BOUND_S) == "after"


def test_and_on_a_busy_engine(client: Any) -> None:
    if hasattr(client, "add_request_async"):
        async def add() -> None:
            await client.add_request_async(EngineCoreRequest(
                "busy", [1, 2], SamplingParams(max_tokens=100_000, ignore_eos=True)))
        asyncio.run(add())
    else:
        client.add_request(EngineCoreRequest(
            "busy", [1, 2], SamplingParams(max_tokens=100_000, ignore_eos=True)))
    assert _call(client, "later", DELAY_S, "busy", timeout=BOUND_S) == "busy"
    if hasattr(client, "abort_requests_async"):
        asyncio.run(client.abort_requests_async(["busy"]))
    else:
        client.abort_requests(["busy"])


def test_the_callers_timeout_applies_to_a_reply_that_never_comes(client: Any) -> None:
    t0 = time.monotonic()
    with pytest.raises(UtilityTimeoutError):
        _call(client, "never", timeout=0.5)
    assert time.monotonic() - t0 < 5.0
    assert _call(client, "echo", "still serving", timeout=BOUND_S) == "still serving"
