"""The client's lifecycle follows the engine's sleep/wake replies where they are routed, in
the order the engine sent them, not when each caller resumes: concurrent sleep/wake callers,
raw ``call_utility`` calls and replies nobody waits for any more all leave the client in the
engine's state."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from enginewire import EngineConfig, EngineCoreRequest, SamplingParams
from enginewire.runtime import make_client, sync_mp_client
from enginewire.spec import UtilityTimeoutError
from enginewire.spec.client import ClientState

NULL = EngineConfig(model="null")


def test_a_sleeper_resuming_after_a_wake_does_not_put_the_client_back_to_sleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine sleeps, then wakes; the sleeping caller resumes only after the wake-up has
    returned. Applied by the callers, the client ended SLEEPING with the engine awake."""
    replied, woke = threading.Event(), threading.Event()
    result = sync_mp_client._SyncCall.result

    def held_result(call: Any) -> Any:
        if threading.current_thread().name == "sleeper":
            replied.set()
            assert woke.wait(30)
        return result(call)

    monkeypatch.setattr(sync_mp_client._SyncCall, "result", held_result)
    with make_client(NULL, multiprocess=True, asyncio=False) as client:
        errors: list[BaseException] = []

        def sleeper() -> None:
            try:
                client.sleep(0)
            except BaseException as e:  # asserted on below
                errors.append(e)

        t = threading.Thread(target=sleeper, name="sleeper")
        t.start()
        assert replied.wait(30)
        assert client.lifecycle.state is ClientState.SLEEPING  # applied when routed
        assert client.wake_up() is True
        woke.set()
        t.join(30)
        assert not t.is_alive() and not errors
        assert client.is_sleeping() is False
        assert client.lifecycle.state is not ClientState.SLEEPING


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc", "sync"])
def test_raw_sleep_and_wake_calls_move_the_client(multiprocess: bool) -> None:
    with make_client(NULL, multiprocess=multiprocess, asyncio=False) as client:
        client.call_utility("sleep", 0, "abort")
        assert client.lifecycle.state is ClientState.SLEEPING
        assert client.call_utility("wake_up", ["kv_cache"]) is True
        assert client.lifecycle.state is ClientState.RUNNING
        client.call_utility("pause_scheduler", "abort")
        assert client.lifecycle.state is ClientState.SLEEPING
        client.call_utility("resume_scheduler")
        assert client.lifecycle.state is ClientState.RUNNING


def test_async_raw_calls_and_wrappers_move_the_client() -> None:
    async def main() -> list[ClientState]:
        seen = []
        async with make_client(NULL, multiprocess=True, asyncio=True) as client:
            await client.call_utility_async("sleep", 0, "abort")  # type: ignore[attr-defined]
            seen.append(client.lifecycle.state)
            await client.resume_scheduler_async()  # type: ignore[attr-defined]
            seen.append(client.lifecycle.state)
            await client.sleep_async(1)  # type: ignore[attr-defined]
            seen.append(client.lifecycle.state)
            assert await client.wake_up_async(["weights"]) is False  # type: ignore[attr-defined]
            seen.append(client.lifecycle.state)
            assert await client.wake_up_async() is True  # type: ignore[attr-defined]
            seen.append(client.lifecycle.state)
        return seen

    S = ClientState
    assert asyncio.run(main()) == [S.SLEEPING, S.RUNNING, S.SLEEPING, S.SLEEPING, S.RUNNING]


def test_a_sleep_reply_after_its_caller_timed_out_still_moves_the_client() -> None:
    """sleep(mode='wait') replies once the running request has drained; the caller gave up
    at once, yet the engine did fall asleep, and the client must say so."""
    with make_client(NULL, multiprocess=True, asyncio=False) as client:
        client.add_request(EngineCoreRequest(
            "long", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True)))
        with pytest.raises(UtilityTimeoutError):
            client.call_utility("sleep", 1, "wait", timeout=0)
        deadline = time.monotonic() + 30
        while client.lifecycle.state is not ClientState.SLEEPING:
            assert time.monotonic() < deadline, client.lifecycle.state
            client.get_output(timeout=0.05)  # routes the late reply
        assert client.is_sleeping() is True
        assert client.live_requests() == []


def test_a_wake_up_after_a_timed_out_sleep_wait_keeps_the_engine_awake() -> None:
    """The audit's serving-stack case: sleep(mode='wait') times out while a request drains,
    wake_up() says "fully awake", and the engine must then really be scheduling (it used to
    fall asleep once drained, and every new request waited for good)."""
    slow = EngineConfig(model="null", null_step_delay_s=0.002)
    with make_client(slow, multiprocess=True, asyncio=False) as client:
        client.add_request(EngineCoreRequest(
            "long", [1, 2], SamplingParams(max_tokens=300, ignore_eos=True)))
        with pytest.raises(UtilityTimeoutError):
            client.call_utility("sleep", 1, "wait", timeout=0.05)
        assert client.wake_up() is True
        assert client.is_sleeping() is False
        client.add_request(EngineCoreRequest(
            "new", [1], SamplingParams(max_tokens=3, ignore_eos=True)))
        finished: set[str] = set()
        deadline = time.monotonic() + 30
        while finished != {"long", "new"}:
            assert time.monotonic() < deadline, (finished, client.live_requests())
            finished |= {o.request_id for o in client.get_output(timeout=0.1).outputs
                         if o.finished}
        assert client.is_sleeping() is False
        assert client.lifecycle.state is ClientState.RUNNING
