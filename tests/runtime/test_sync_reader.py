"""SyncMPClient's reader: whichever thread waits reads the output socket (no hand-off), other
waiters get what it routes for them, and the background thread takes the socket only when no
caller has read for a while. Every wait here is bounded."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.sync_mp_client import SyncMPClient

NULL = EngineConfig(model="null", device="cpu")
BOUND_S = 20.0


@pytest.fixture(scope="module")
def client() -> Iterator[SyncMPClient]:
    c = SyncMPClient(NULL)
    try:
        yield c
    finally:
        c.shutdown()


def _request(rid: str, n: int) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [5, 6, 7], SamplingParams(max_tokens=n, ignore_eos=True))


def _until_finished(client: SyncMPClient, rid: str) -> list[int]:
    tokens: list[int] = []
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        for o in client.get_output(timeout=1.0).outputs:
            if o.request_id == rid:
                tokens += o.new_token_ids
                if o.finished:
                    return tokens
    raise AssertionError(f"{rid} did not finish within {BOUND_S} s")


def test_a_reader_routes_replies_for_another_thread(client: SyncMPClient) -> None:
    # One thread sits in get_output (holding the socket) while another makes utility calls:
    # their replies are read by the first thread and must still reach the caller.
    got: list[list[int]] = []
    errors: list[BaseException] = []
    waiting = threading.Event()

    def consume() -> None:
        try:
            waiting.set()
            got.append(_until_finished(client, "r1"))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=consume)
    t.start()
    assert waiting.wait(BOUND_S)
    for i in range(50):
        assert client.call_utility("echo", i, timeout=BOUND_S) == i
    client.add_request(_request("r1", 7))
    t.join(BOUND_S)
    assert not t.is_alive() and not errors
    assert len(got[0]) == 7


def test_call_while_the_background_thread_holds_the_socket(client: SyncMPClient) -> None:
    reader = client._reader
    assert reader is not None
    deadline = time.monotonic() + BOUND_S
    with reader.cv:  # idle: the background thread takes over after IDLE_TAKEOVER_S
        while not reader._bg_reading and time.monotonic() < deadline:
            reader.cv.wait(0.05)
        assert reader._bg_reading
    assert client.call_utility("echo", "kicked", timeout=BOUND_S) == "kicked"


def test_timeout_zero_polling_sees_outputs(client: SyncMPClient) -> None:
    client.add_request(_request("r0", 3))
    tokens = 0
    deadline = time.monotonic() + BOUND_S
    while tokens < 3 and time.monotonic() < deadline:
        tokens += sum(len(o.new_token_ids) for o in client.get_output(timeout=0).outputs
                      if o.request_id == "r0")
    assert tokens == 3


def test_many_threads_calling_at_once(client: SyncMPClient) -> None:
    results: dict[int, list[object]] = {}
    errors: list[BaseException] = []

    def caller(k: int) -> None:
        try:
            results[k] = [client.call_utility("echo", (k, i), timeout=BOUND_S)
                          for i in range(30)]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    assert not errors and all(not t.is_alive() for t in threads)
    assert results == {k: [[k, i] for i in range(30)] for k in range(4)}


def test_sync_call_outcome_is_set_once() -> None:
    """The lock-free outcome slot of a sync utility call: one outcome, read after it is set."""
    import concurrent.futures

    from enginewire.runtime.sync_mp_client import _SyncCall

    call = _SyncCall()
    assert not call.done()
    with pytest.raises(RuntimeError, match="before it was set"):
        call.result()
    call.set_result({"ok": 1})
    assert call.done() and call.result() == {"ok": 1}
    with pytest.raises(concurrent.futures.InvalidStateError):
        call.set_exception(ValueError("late"))
    assert call.result() == {"ok": 1}  # unchanged by the refused second outcome

    failed = _SyncCall()
    failed.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        failed.result()
    with pytest.raises(concurrent.futures.InvalidStateError):
        failed.set_result(1)


def test_utility_timeout_then_next_call(client: SyncMPClient) -> None:
    """A call that times out leaves no entry, and the next call gets its own reply."""
    from enginewire.spec import UtilityTimeoutError

    client.add_request(_request("slow-wait", 250))  # sleep(wait) waits for it to finish
    with pytest.raises(UtilityTimeoutError):
        client.call_utility("sleep", 0, "wait", timeout=0.001)
    assert client.pending_utility_calls() == 0
    assert len(_until_finished(client, "slow-wait")) == 250
    assert client.wake_up(None) is True
    assert client.call_utility("echo", "after") == "after"


def test_a_receive_timeout_is_honoured_then_cleared(client: SyncMPClient) -> None:
    """Readers block in a receive bounded by the socket's RCVTIMEO: a caller's timeout ends
    its wait on time, and the next caller without one still blocks until its reply."""
    for timeout in (0.2, 0.05):
        t0 = time.monotonic()
        assert not client.get_output(timeout=timeout).outputs
        assert timeout <= time.monotonic() - t0 < timeout + 2.0
    assert client.call_utility("echo", b"after") == b"after"
    assert client._reader is not None and client._reader._rcvtimeo == -1


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_shutdown_wakes_a_reader_blocked_without_timeout(transport: str) -> None:
    """A caller blocked in a receive with no timeout is woken by the reader's own wake token
    when another thread shuts the client down: it raises at once, and no thread is left
    behind. Over tcp the PULL is a CURVE server; the token, sent over inproc, still gets
    through (inproc skips the handshake)."""
    c = SyncMPClient(NULL, transport=transport)
    reader = c._reader
    assert reader is not None
    assert (c.resources.guard.curve is not None) == (transport == "tcp")
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            c.get_output()
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=wait)
    t.start()
    deadline = time.monotonic() + BOUND_S
    while not (reader._reading and reader._holder == t.ident) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reader._reading and reader._holder == t.ident, "the caller never took the socket"
    t0 = time.monotonic()
    c.shutdown()
    t.join(BOUND_S)
    # Without the token, shutdown would wait out its bound (5 s) for the blocked caller.
    assert not t.is_alive() and time.monotonic() - t0 < 2.0
    assert not reader.thread.is_alive()
    assert outcome and type(outcome[0]).__name__ == "ClientClosedError"


def test_a_blocked_call_shares_the_socket_with_a_thread_that_arrives() -> None:
    """A utility call that took the socket alone (its reply deferred until the running
    request finishes) must not hold back another thread's outputs: once that thread waits,
    the holder hands the socket over after the next message, as ``wait_for`` does."""
    c = SyncMPClient(EngineConfig(model="null", device="cpu", null_step_delay_s=0.01))
    try:
        c.add_request(_request("long", 150))  # about 1.5 s of steps
        first = c.get_output(timeout=BOUND_S)
        assert first.outputs, "the request never started"
        done = threading.Event()

        def pause() -> None:
            c.call_utility("pause_scheduler", "wait")  # replies once the request finished
            done.set()

        t = threading.Thread(target=pause)
        t.start()
        reader = c._reader
        assert reader is not None
        deadline = time.monotonic() + BOUND_S
        while not (reader._reading and reader._holder == t.ident) and time.monotonic() < deadline:
            time.sleep(0.005)
        t0 = time.monotonic()
        got = c.get_output(timeout=BOUND_S)
        waited = time.monotonic() - t0
        assert got.outputs and not done.is_set(), "outputs were held until the call returned"
        assert waited < 0.5, waited
        t.join(BOUND_S)
        assert done.is_set()
    finally:
        c.shutdown()
