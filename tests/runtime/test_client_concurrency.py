"""Several callers at once, and calls interrupted by an exception raised into them (Ctrl-C):
batches are tracked in the order they were queued, a zero timeout takes what is queued, and
an interrupted call leaves the client usable."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections import Counter
from typing import Any

import pytest

from enginewire import EngineConfig, EngineCoreRequest, SamplingParams
from enginewire.runtime import make_client
from enginewire.spec import ClientClosedError, EngineDeadError

NULL = EngineConfig(model="null", max_num_seqs=64)


def req(rid: str, n: int = 2) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True))


def test_concurrent_async_getters_track_batches_in_queue_order() -> None:
    """One getter waits without a timeout, another with a short one: before the fix the timed
    getter dequeued in a task of its own and the batches were tracked out of order."""
    n = 400

    async def main() -> tuple[Counter[str], set[str], list[str]]:
        client = make_client(NULL, multiprocess=True, asyncio=True)
        tokens: Counter[str] = Counter()
        done: set[str] = set()
        errors: list[str] = []
        all_done = asyncio.Event()

        async def getter(timeout: float | None) -> None:
            while len(done) < n:
                try:
                    out = await client.get_output_async(timeout=timeout)  # type: ignore[attr-defined]
                except Exception as e:  # recorded, and asserted on below
                    errors.append(repr(e))
                    all_done.set()
                    return
                for o in out.outputs:
                    tokens[o.request_id] += len(o.new_token_ids)
                    if o.finished:
                        done.add(o.request_id)
            all_done.set()  # the other getter may wait for a batch that never comes

        try:
            tasks = [asyncio.create_task(getter(None)), asyncio.create_task(getter(0.01))]
            for i in range(n):
                await client.add_request_async(req(f"r{i}"))  # type: ignore[attr-defined]
                if i % 50 == 0:
                    await asyncio.sleep(0)
            await asyncio.wait_for(all_done.wait(), 60)
        finally:
            for t in tasks:
                t.cancel()
            client.shutdown()
        return tokens, done, errors

    tokens, done, errors = asyncio.run(main())
    assert not errors, errors[:3]
    assert len(done) == n and set(tokens.values()) == {2}


def test_an_async_zero_timeout_takes_what_is_queued_and_sees_death() -> None:
    async def main() -> None:
        client = make_client(NULL, multiprocess=True, asyncio=True)
        try:
            await client.add_request_async(req("a", 1))  # type: ignore[attr-defined]
            got: list[Any] = []
            for _ in range(2000):  # the output arrives within a few ms; bounded anyway
                got += (await client.get_output_async(timeout=0)).outputs  # type: ignore[attr-defined]
                if any(o.finished for o in got):
                    break
                await asyncio.sleep(0.005)
            assert any(o.finished for o in got)
            os.kill(client.engine_pid, signal.SIGKILL)  # type: ignore[attr-defined]
            with pytest.raises(EngineDeadError):
                for _ in range(2000):
                    await client.get_output_async(timeout=0)  # type: ignore[attr-defined]
                    await asyncio.sleep(0.005)
        finally:
            client.shutdown()

    asyncio.run(main())


class Interrupt(BaseException):
    """Stands in for KeyboardInterrupt raised into a blocking call by a signal handler."""


def test_calls_interrupted_anywhere_leave_the_sync_client_usable() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")

    def raise_interrupt(*_: object) -> None:
        raise Interrupt

    old = signal.signal(signal.SIGALRM, raise_interrupt)
    client = make_client(NULL, multiprocess=True, asyncio=False)
    try:
        for i in range(60):
            # A short alarm lands at a varying point of an echo: in a send, in a receive,
            # between a message's parts, in the reader's bookkeeping.
            signal.setitimer(signal.ITIMER_REAL, 0.0005 + (i % 13) * 0.0001)
            try:
                while True:
                    client.echo(i)
            except Interrupt:
                pass
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            assert client.echo("next", timeout=10) == "next", f"after interrupt {i}"
        client.add_request(req("after", 3))
        outs: list[Any] = []
        for _ in range(100):
            outs += client.get_output(timeout=5).outputs
            if any(o.finished for o in outs):
                break
        assert sum(len(o.new_token_ids) for o in outs if o.request_id == "after") == 3
        assert client.pending_utility_calls() == 0  # type: ignore[attr-defined]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        client.shutdown()


def test_a_deferred_call_sees_an_engine_stopped_from_outside_as_dead() -> None:
    """SIGTERM to the engine (Ctrl-C reaching its process group) while a pause waits for
    requests: the call fails with EngineDeadError like every other, not a UtilityError."""
    client = make_client(EngineConfig(model="null", null_step_delay_s=0.005),
                         multiprocess=True, asyncio=False)
    outcome: list[BaseException | None] = []

    def pause_and_wait() -> None:
        try:
            client.pause_scheduler("wait")
            outcome.append(None)
        except BaseException as e:  # recorded, and asserted on below
            outcome.append(e)

    try:
        client.add_request(req("long", 100_000))
        waiter = threading.Thread(target=pause_and_wait)
        waiter.start()
        for _ in range(1000):  # the call is registered within milliseconds; bounded anyway
            if client.pending_utility_calls():  # type: ignore[attr-defined]
                break
            threading.Event().wait(0.01)
        os.kill(client.engine_pid, signal.SIGTERM)  # type: ignore[attr-defined]
        waiter.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], EngineDeadError), outcome
    finally:
        client.shutdown()


def _finish_all(client: Any, ids: set[str]) -> set[str]:
    done: set[str] = set()
    for _ in range(500):  # bounded: a lost request must fail, not hang
        done |= {o.request_id for o in client.get_output(timeout=0.5).outputs if o.finished}
        if ids <= done:
            break
    return done


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
@pytest.mark.parametrize("part", ["last", "first"])
@pytest.mark.usefixtures("default_sigint")  # a batch job starts pytest with SIGINT ignored
def test_ctrl_c_during_an_add_leaves_the_request_live_and_the_client_whole(
        part: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGINT landing while add_request sends: the ADD goes out whole, then the
    KeyboardInterrupt is raised. Raised right after the last part (before the fix), the
    request was forgotten while the engine ran it, and every later get_output raised a
    SpecViolation for its outputs, losing the other requests' outputs with them."""
    with make_client(NULL, multiprocess=True, asyncio=False) as client:
        real = client._sock_send
        calls: list[int] = []

        def send(sock: Any, frame: Any, *flags: Any) -> Any:
            result = real(sock, frame, *flags)
            calls.append(1)
            last = not flags or not flags[0]
            if (part == "last" and last) or (part == "first" and len(calls) == 1):
                os.kill(os.getpid(), signal.SIGINT)  # its handler runs at the next check
            return result

        monkeypatch.setattr(client, "_sock_send", send)
        with pytest.raises(KeyboardInterrupt):
            client.add_request(req("a", 4))
        monkeypatch.setattr(client, "_sock_send", real)
        assert client.live_requests() == ["a"]
        client.add_request(req("b", 4))
        assert _finish_all(client, {"a", "b"}) >= {"a", "b"}
        assert client.live_requests() == []
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_inproc_client_called_from_several_threads_at_once() -> None:
    """The docs let any number of threads call a sync client at once. Before the fix the
    in-process client stepped its engine from each caller's thread at the same time: the
    scheduler finished a request twice (SpecViolation) and the engine was declared dead."""
    client = make_client(EngineConfig(model="null", max_num_seqs=8), multiprocess=False,
                         asyncio=False)
    tokens: Counter[str] = Counter()
    finished: set[str] = set()
    errors: list[str] = []
    seen = threading.Lock()

    def take(out: Any) -> None:
        with seen:
            for o in out.outputs:
                tokens[o.request_id] += len(o.new_token_ids)
                if o.finished:
                    finished.add(o.request_id)

    def worker(k: int) -> None:
        try:
            for i in range(150):
                client.add_request(req(f"{k}-{i}", 3))
                for _ in range(3):
                    take(client.get_output())
                if i % 7 == 0:
                    assert client.echo(i) == i
                if i % 11 == 0:
                    client.abort_requests([f"{k}-{i}"])
        except Exception as e:  # recorded, and asserted on below
            errors.append(repr(e))

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches inside steps: the race shows at once
    try:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        sys.setswitchinterval(switch)
        assert not errors, errors[:3]
        for _ in range(100):  # what is still running finishes within a few steps
            if not client.live_requests():
                break
            take(client.get_output())
        assert not client.live_requests()
        assert len(finished) == 450
        # Aborted ones may have ended early; every other got all its tokens, once.
        assert all(n <= 3 for n in tokens.values())
        assert sum(n == 3 for n in tokens.values()) >= 450 - 3 * 14
    finally:
        sys.setswitchinterval(switch)
        client.shutdown()


def test_an_inproc_shutdown_from_another_thread_ends_a_driven_wait() -> None:
    """A raw in-process ``sleep(0, "wait")`` steps the engine inside the call until the
    drain ends; a shutdown from another thread ends that call with ClientClosedError (a
    pending call at shutdown) instead of waiting out the drain and reporting success."""
    client = make_client(EngineConfig(model="null", null_step_delay_s=0.05),
                         multiprocess=False, asyncio=False)
    outcome: list[object] = []

    def wait_for_drain() -> None:
        try:
            outcome.append(client.call_utility("sleep", 0, "wait"))
        except BaseException as e:  # recorded, and asserted on below
            outcome.append(e)

    client.add_request(req("long", 100_000))  # max_model_len steps of 50 ms
    waiter = threading.Thread(target=wait_for_drain)
    try:
        waiter.start()
        for _ in range(1000):  # the drive starts within a step; bounded anyway
            if client.queued_outputs():  # outputs buffered while the call drives the engine
                break
            threading.Event().wait(0.01)
        client.shutdown()
        waiter.join(60)
        assert len(outcome) == 1 and isinstance(outcome[0], ClientClosedError), outcome
    finally:
        client.shutdown()
        waiter.join(60)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
@pytest.mark.usefixtures("default_sigint")  # a batch job starts pytest with SIGINT ignored
def test_ctrl_c_after_get_output_took_a_batch_loses_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGINT landing after get_output took and tracked a batch: the caller gets its
    KeyboardInterrupt and the next get_output returns that batch. It was lost, with its
    tokens, and a finish in it left the request live for good."""
    with make_client(NULL, multiprocess=True, asyncio=False) as client:
        real = client._track_outputs
        fired: list[int] = []

        def track(batch: Any) -> None:
            real(batch)
            if not fired and (batch.outputs or batch.stream_ids):
                fired.append(1)
                os.kill(os.getpid(), signal.SIGINT)  # its handler runs at the next check

        monkeypatch.setattr(client, "_track_outputs", track)
        client.add_request(req("a", 8))
        tokens: list[int] = []
        finished = False
        interrupted = 0
        for _ in range(500):  # bounded: a lost finish must fail, not hang
            try:
                batch = client.get_output(timeout=0.5)
            except KeyboardInterrupt:
                interrupted += 1
                continue
            for o in batch.outputs:
                tokens += o.new_token_ids
                finished = finished or o.finished
            if finished:
                break
        assert interrupted == 1
        assert finished and len(tokens) == 8, tokens
        assert client.live_requests() == []
