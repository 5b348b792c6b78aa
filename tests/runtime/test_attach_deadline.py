"""The attach marker's deadline is a timer (protocol "Attaching"; runtime/mp_client.py).

A front end whose ATTACH is never answered (the frame was lost on the wire, the engine hangs
right after its ready) reads nothing as its own: every reply and batch is dropped as "before
the marker". Once ``ready_timeout_s`` has passed since the ATTACH the engine is declared dead
even if it then says nothing at all, so no call and no ``get_output`` without a timeout hangs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from enginewire import EngineDeadError, ProtocolError, make_client
from enginewire.faults import Direction, FrameAction, FrameKind, FrameRule, Interposer
from enginewire.protocol.codec import Encoder
from enginewire.protocol.messages import (
    PROTOCOL_VERSION,
    AttachRequest,
    EngineCoreOutputs,
    ReadyResponse,
    RequestType,
    UtilityOutput,
    UtilityRequest,
)
from enginewire.runtime.config import EngineConfig
from enginewire.testing.oracle import ResourceSnapshot, check_released

NULL = EngineConfig(model="null", device="cpu")
# Generous bound on every wait: only to turn a hang into a failure, never a speed check.
BOUND_S = 30.0
# The fake engine answers at once, so a short deadline is safe; a launched engine must start
# within it (the null model takes about 0.5 s), so it gets more.
FAKE_READY_S = 0.5
LAUNCHED_READY_S = 5.0


@pytest.fixture(autouse=True, scope="module")
def _resource_tracker() -> None:
    # Started by the first spawn and kept: started before any snapshot, so not a leak.
    resource_tracker.ensure_running()


class FakeEngine:
    """A standalone engine's sockets driven by hand: it sends its ready and then only what
    the test tells it to."""

    def __init__(self, tmp: Path) -> None:
        self.inp, self.out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
        self.ctx = zmq.Context()
        self.dealer, self.push = self.ctx.socket(zmq.DEALER), self.ctx.socket(zmq.PUSH)
        self.dealer.setsockopt(zmq.IDENTITY, (0).to_bytes(2, "little"))
        self.dealer.connect(self.inp)
        self.push.connect(self.out)
        self.dealer.send(msgspec.msgpack.encode(
            ReadyResponse(PROTOCOL_VERSION, 0, 64, 16, 128, "fake", "cpu")))

    def recv(self, kind: RequestType) -> bytes:
        """The next input's payload, which must be of ``kind``."""
        assert self.dealer.poll(int(BOUND_S * 1000)), f"no {kind.name} reached the engine"
        frame = self.dealer.recv()
        assert frame[:1] == kind.value, (kind, frame[:1])
        return frame[1:]

    def send(self, outputs: EngineCoreOutputs) -> None:
        self.push.send_multipart(Encoder().encode(outputs))

    def close(self) -> None:
        self.dealer.close(0)
        self.push.close(0)
        self.ctx.term()


@contextmanager
def fake_engine(tmp: Path) -> Iterator[FakeEngine]:
    engine = FakeEngine(tmp)
    try:
        yield engine
    finally:
        engine.close()


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException | Any]]:
    """Run ``fn`` in a thread; the list gets its outcome (the result or the exception)."""
    outcome: list[BaseException | Any] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, outcome


def assert_marker_overdue(err: BaseException | Any) -> None:
    assert isinstance(err, EngineDeadError), err
    assert isinstance(err.__cause__, ProtocolError), err.__cause__
    assert "no attach marker" in str(err.__cause__)
    assert "ready_timeout_s" in str(err.__cause__)


# -- a standalone engine that never answers the ATTACH and says nothing after ----------------


@pytest.mark.timeout(120)
def test_sync_client_is_dead_once_the_marker_is_overdue(tmp_path: Path) -> None:
    before = ResourceSnapshot.take()
    with fake_engine(tmp_path) as engine:
        inner = ResourceSnapshot.take()
        start = time.monotonic()
        client = make_client(NULL, multiprocess=True, asyncio=False, launch_engine=False,
                             input_address=engine.inp, output_address=engine.out,
                             ready_timeout_s=FAKE_READY_S)
        try:
            engine.recv(RequestType.ATTACH)  # left unanswered; the engine goes silent
            call, called = in_thread(lambda: client.call_utility("echo", 1))
            engine.recv(RequestType.UTILITY)  # never answered either
            read, got = in_thread(client.get_output)  # no timeout
            call.join(BOUND_S)
            read.join(BOUND_S)
            assert called and got, "a call or get_output still waits: the deadline never fired"
            dead_at = time.monotonic()
            assert_marker_overdue(called[0])
            assert_marker_overdue(got[0])
            # Not before the deadline: the ATTACH went out after ``start``.
            assert dead_at - start >= FAKE_READY_S
            assert client.is_dead
            with pytest.raises(EngineDeadError):
                client.get_output()
            with pytest.raises(EngineDeadError):
                client.call_utility("echo", 2)
        finally:
            client.shutdown()
        check_released(inner, engine_pid=None, ipc_path=None)
    check_released(before, engine_pid=None, ipc_path=None)


@pytest.mark.timeout(120)
def test_async_client_is_dead_once_the_marker_is_overdue(tmp_path: Path) -> None:
    before = ResourceSnapshot.take()

    async def main(engine: FakeEngine) -> None:
        start = time.monotonic()
        client = make_client(NULL, multiprocess=True, asyncio=True, launch_engine=False,
                             input_address=engine.inp, output_address=engine.out,
                             ready_timeout_s=FAKE_READY_S)
        tasks: list[asyncio.Future[Any]] = []
        try:
            await asyncio.to_thread(engine.recv, RequestType.ATTACH)
            call = asyncio.ensure_future(client.call_utility_async("echo", 1))
            tasks.append(call)
            await asyncio.to_thread(engine.recv, RequestType.UTILITY)
            read = asyncio.ensure_future(client.get_output_async())  # no timeout
            tasks.append(read)
            done, _ = await asyncio.wait([call, read], timeout=BOUND_S)
            assert done == {call, read}, "a call or get_output still waits: no deadline fired"
            assert time.monotonic() - start >= FAKE_READY_S
            assert_marker_overdue(call.exception())
            assert_marker_overdue(read.exception())
            assert client.is_dead
            with pytest.raises(EngineDeadError):
                await client.get_output_async()
        finally:
            await client.shutdown_async()  # ends whatever still waits (a failing run)
            await asyncio.gather(*tasks, return_exceptions=True)

    with fake_engine(tmp_path) as engine:
        asyncio.run(main(engine))
    check_released(before, engine_pid=None, ipc_path=None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_marker_in_time_disarms_the_deadline(tmp_path: Path, use_async: bool) -> None:
    """Once the marker is in, silence past ready_timeout_s is not death (no heartbeat was
    asked for), and replies after the marker are read."""
    with fake_engine(tmp_path) as engine:

        def serve() -> None:
            attach = msgspec.msgpack.decode(engine.recv(RequestType.ATTACH), type=AttachRequest)
            engine.send(EngineCoreOutputs(session=attach.session))
            call = msgspec.msgpack.decode(engine.recv(RequestType.UTILITY), type=UtilityRequest)
            engine.send(EngineCoreOutputs(
                utility_output=UtilityOutput(call.call_id, result=call.args[0])))

        async def use_async_client() -> None:
            client = make_client(NULL, multiprocess=True, asyncio=True, launch_engine=False,
                                 input_address=engine.inp, output_address=engine.out,
                                 ready_timeout_s=FAKE_READY_S)
            async with client:
                server = asyncio.ensure_future(asyncio.to_thread(serve))
                assert await client.echo_async("hi", timeout=BOUND_S) == "hi"
                await server
                # Silence for twice the deadline: an empty batch, not death.
                assert (await client.get_output_async(timeout=2 * FAKE_READY_S)).outputs == []
                assert not client.is_dead

        if use_async:
            asyncio.run(use_async_client())
            return
        client = make_client(NULL, multiprocess=True, asyncio=False, launch_engine=False,
                             input_address=engine.inp, output_address=engine.out,
                             ready_timeout_s=FAKE_READY_S)
        with client:
            server, _ = in_thread(serve)
            assert client.echo("hi", timeout=BOUND_S) == "hi"
            server.join(BOUND_S)
            assert client.get_output(timeout=2 * FAKE_READY_S).outputs == []
            assert not client.is_dead


# -- a launched engine whose ATTACH the wire drops -------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_launched_engine_whose_attach_was_lost_is_dead_and_reaped(
        tmp_path: Path, use_async: bool) -> None:
    """The engine answers the call, but before any marker: the reply is dropped. The engine
    then sends nothing (no heartbeat), yet the client is dead at the deadline, and
    shutdown() still stops and reaps the engine it launched."""
    before = ResourceSnapshot.take()
    drop_attach = FrameRule(action=FrameAction.DROP, direction=Direction.TO_ENGINE,
                            kind=FrameKind.ATTACH)
    inp, out = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    with Interposer([drop_attach]) as proxy:
        proxy.attach(inp, out)
        options: dict[str, Any] = dict(
            multiprocess=True, input_address=inp, output_address=out,
            engine_connect=proxy.engine_addresses, ready_timeout_s=LAUNCHED_READY_S)

        pids: list[int] = []  # the launched engine's, to check it was reaped

        async def use_async_client() -> tuple[BaseException | None, BaseException | None]:
            client = make_client(NULL, asyncio=True, **options)
            pids.append(client.engine_pid)
            call = asyncio.ensure_future(client.call_utility_async("echo", 1))
            read = asyncio.ensure_future(client.get_output_async())
            try:
                await asyncio.wait([call, read], timeout=BOUND_S)
                assert call.done() and read.done(), "still waiting: no deadline fired"
                return call.exception(), read.exception()
            finally:
                await client.shutdown_async()
                await asyncio.gather(call, read, return_exceptions=True)

        if use_async:
            call_error, read_error = asyncio.run(use_async_client())
        else:
            client = make_client(NULL, asyncio=False, **options)
            pids.append(client.engine_pid)
            try:
                call, called = in_thread(lambda: client.call_utility("echo", 1))
                read, got = in_thread(client.get_output)
                call.join(BOUND_S)
                read.join(BOUND_S)
                assert called and got, "still waiting: no deadline fired"
                call_error, read_error = called[0], got[0]
            finally:
                client.shutdown()
        assert [e for _, _, e in proxy.events] == ["drop"]
    assert_marker_overdue(call_error)
    assert_marker_overdue(read_error)
    check_released(before, engine_pid=pids[0], ipc_path=None)
