"""The conformance suite (enginewire.testing.conformance) on the three built-in clients.

A scenario that cannot run on a client raises ``cf.NotApplicable`` (a ``unittest.SkipTest``),
which pytest reports as a skip: the tests below run every scenario on every client kind and
let the suite say where it does not apply.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from enginewire.runtime import make_client
from enginewire.runtime.config import EngineConfig
from enginewire.spec import ClientState, EngineStartupError
from enginewire.testing import conformance as cf

torch.set_num_threads(1)
os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")  # spawned engines inherit it

CONFIG_KW: dict[str, Any] = {"model": "tiny", "max_num_seqs": 8, "max_model_len": 256}
CONFIG = EngineConfig(**CONFIG_KW)
MP_KINDS = ("sync", "async")


def factory_for(kind: str) -> cf.ClientFactory:
    def factory(**options: Any) -> cf.ClientUnderTest:
        config = options.pop("config", CONFIG)
        return cf.open_client(kind, config, **options)

    return factory


@pytest.fixture(scope="module", params=cf.CLIENT_KINDS)
def warm(request: pytest.FixtureRequest) -> Iterator[cf.ClientUnderTest]:
    """One engine per client kind, shared by the scenarios that leave it healthy."""
    cut = cf.open_client(request.param, CONFIG)
    try:
        yield cut
    finally:
        cut.shutdown()
        cf.check_trace(cut)


def test_generate(warm: cf.ClientUnderTest) -> None:
    cf.check_generate(warm)


def test_abort_half(warm: cf.ClientUnderTest) -> None:
    cf.check_abort_half(warm)


def test_utilities(warm: cf.ClientUnderTest) -> None:
    cf.check_utilities(warm)


def test_bad_arguments(warm: cf.ClientUnderTest) -> None:
    cf.check_bad_arguments(warm)


def test_duplicate_request_id(warm: cf.ClientUnderTest) -> None:
    cf.check_duplicate_request_id(warm)


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_sleep_wake(warm: cf.ClientUnderTest, level: int, mode: str) -> None:
    cf.check_sleep_wake(warm, level, mode)


def test_malformed_frames(warm: cf.ClientUnderTest) -> None:
    cf.check_malformed_frames(warm)  # NotApplicable in-process: no wire


def test_rejected_add_spares_live_request(warm: cf.ClientUnderTest) -> None:
    cf.check_rejected_add_spares_live_request(warm)


@pytest.mark.parametrize("kind", cf.CLIENT_KINDS)
def test_shutdown_semantics(kind: str) -> None:
    cf.check_shutdown_semantics(cf.open_client(kind, CONFIG))


@pytest.mark.parametrize("kind", cf.CLIENT_KINDS)
def test_kill_during_get_output(kind: str) -> None:
    cf.check_kill_during_get_output(factory_for(kind))


@pytest.mark.parametrize("kind", cf.CLIENT_KINDS)
def test_kill_during_utility(kind: str) -> None:
    cf.check_kill_during_utility(factory_for(kind))


@pytest.mark.parametrize("kind", cf.CLIENT_KINDS)
def test_kill_during_handshake(kind: str) -> None:
    cf.check_kill_during_handshake(factory_for(kind))


@pytest.mark.parametrize("kind", cf.CLIENT_KINDS)
def test_engine_fatal_error(kind: str) -> None:
    cf.check_engine_fatal_error(factory_for(kind))


@pytest.mark.slow
@pytest.mark.parametrize("kind", MP_KINDS)
def test_client_kill_engine_exits(kind: str) -> None:
    cf.check_client_kill_engine_exits(CONFIG_KW, is_async=kind == "async")


@pytest.mark.slow
@pytest.mark.parametrize("kind", cf.CLIENT_KINDS)
def test_construction_failure_leaks_nothing(kind: str) -> None:
    cf.check_construction_failure_leaks_nothing(
        factory_for(kind), EngineConfig(model="no-such-model"))


def test_inproc_scenarios_report_not_applicable() -> None:
    """A scenario that needs an engine process says so at once on an in-process client: it
    raises NotApplicable (a skip), neither passing silently nor waiting for an engine."""
    import unittest

    assert issubclass(cf.NotApplicable, unittest.SkipTest)
    factory = factory_for("inproc")
    start = time.monotonic()
    for check in (cf.check_kill_during_handshake, cf.check_engine_fatal_error):
        with pytest.raises(cf.NotApplicable, match="no engine process"):
            check(factory)
    assert time.monotonic() - start < 10


# --- client-specific behaviour outside the shared scenarios ----------------------------------


def test_asyncio_without_multiprocess_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="multiprocess=True"):
        make_client(CONFIG, multiprocess=False, asyncio=True)


def test_async_client_built_inside_the_loop() -> None:
    with cf.open_client("async", CONFIG, construct_in_loop=True) as cut:
        cf.check_generate(cut, n=2, max_tokens=5)


def test_ready_timeout_names_the_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINEWIRE_ENGINE_READY_TIMEOUT_S", "0.5")
    start = time.monotonic()
    with pytest.raises(EngineStartupError, match="ENGINEWIRE_ENGINE_READY_TIMEOUT_S"):
        make_client(CONFIG, multiprocess=True, asyncio=False, engine_startup_delay_s=30.0)
    assert time.monotonic() - start < 15


def test_utility_timeout_leaves_no_entry(warm: cf.ClientUnderTest) -> None:
    if not warm.multiprocess:
        pytest.skip("in-process utilities are direct calls")
    from enginewire.spec import UtilityTimeoutError

    client = warm.client
    # A sleep in "wait" mode is deferred while a long request runs: a tiny timeout expires.
    warm.add_request(cf.request("timeout-0", 200))
    with pytest.raises(UtilityTimeoutError):
        warm.call_utility("sleep", 0, "wait", timeout=0.001)
    assert client.pending_utility_calls() == 0
    cf.collect(warm, ["timeout-0"])
    # The late reply was dropped; the engine is paused (level 0): wake it.
    assert warm.wake_up() is True
    assert warm.call_utility("echo", 1) == 1
    assert client.pending_utility_calls() == 0
    assert client.state in (ClientState.RUNNING, ClientState.READY)
    cf.check_trace(warm)


def test_async_cancelled_call_late_reply_is_dropped() -> None:
    """vLLM's cancelled-utility test: the reader survives the late reply, no entry is left."""
    import asyncio

    with cf.open_client("async", CONFIG) as cut:
        client = cut.client

        async def scenario() -> None:
            await client.add_request_async(cf.request("long", 120))
            # Deferred until "long" drains: pending long enough to cancel.
            task = asyncio.ensure_future(client.call_utility_async("pause_scheduler", "wait"))
            while client.pending_utility_calls() == 0:
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert client.pending_utility_calls() == 0
            finished = False
            while not finished:
                batch = await client.get_output_async(timeout=30)
                finished = any(o.finished for o in batch.outputs)
            # The late pause reply is dropped; the client still answers within a second.
            assert await asyncio.wait_for(client.echo_async("alive"), 1.0) == "alive"
            await client.resume_scheduler_async()

        assert cut.loop is not None
        cut.loop.run(scenario())
        cf.check_trace(cut)
        events = [(e[1], e[2], e[3]) for e in cut.trace or [] if e[0] == "utility"]
        assert ("PENDING", "CANCEL", "CANCELLED") in events


def test_engine_survives_exit_of_the_thread_that_built_the_client() -> None:
    """PR_SET_PDEATHSIG fires when the spawning *thread* exits: that must not stop it."""
    import threading

    box: list[cf.ClientUnderTest] = []
    t = threading.Thread(target=lambda: box.append(cf.open_client("sync", CONFIG)))
    t.start()
    t.join(120)
    (cut,) = box
    with cut:
        # The deathsig (if any) was delivered when the thread ended; the engine ignored it.
        assert cut.call_utility("echo", "still here", timeout=10) == "still here"
        cf.check_generate(cut, n=1, max_tokens=3, prefix="thread")
