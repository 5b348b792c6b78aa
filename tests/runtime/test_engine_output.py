"""``EngineOutput`` (runtime/_engine_output.py) against a bare PULL. The direct send is
differential-tested against the queue, its general path, as the decode batch is against the
full pass (tests/runtime/test_scheduler.py): the same items either way reach the peer as the
same bytes, in the order they were handed over."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from enginewire.protocol.codec import Encoder
from enginewire.protocol.messages import (
    ENGINE_DEAD_SENTINEL,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    UtilityOutput,
)
from enginewire.runtime._engine_output import (
    DIRECT_SEND_MAX_OUTPUTS,
    STOP_OUTPUT,
    EngineOutput,
    goes_direct,
)
from enginewire.runtime.security import TransportGuard
from enginewire.testing._harness import wait_until

BOUND_S = 30.0
ITEMS = [
    EngineCoreOutputs(engine_index=2, outputs=[EngineCoreOutput("a", [1, 2])], timestamp=1.0),
    EngineCoreOutputs(engine_index=2, outputs=[EngineCoreOutput("a", [3], FinishReason.LENGTH)],
                      finished_requests=["a"], timestamp=2.0),
    EngineCoreOutputs(engine_index=2, utility_output=UtilityOutput(7, None, [1, "x"]),
                      timestamp=3.0),
]


class _Counted:
    """The output queue, counting what is put on it (a C ``SimpleQueue`` takes no spy); while
    ``open`` is clear, the output thread holds what it took instead of sending it."""

    def __init__(self) -> None:
        self.inner: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.puts = 0
        self.open = threading.Event()
        self.open.set()

    def put(self, item: Any) -> None:
        self.puts += 1
        self.inner.put(item)

    def get(self, timeout: float | None = None) -> Any:
        item = self.inner.get(timeout=timeout)
        assert self.open.wait(BOUND_S)
        return item


@pytest.fixture
def wired(tmp_path: Path) -> Iterator[tuple[EngineOutput, zmq.Socket[Any], _Counted]]:
    ctx: zmq.Context[Any] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/out"
    pull.bind(address)
    guard = TransportGuard(ctx, None, side="engine")
    counted = _Counted()
    out = EngineOutput(ctx, guard, Encoder(), engine_index=2,
                       output_queue=counted,  # type: ignore[arg-type]
                       input_queue=queue.SimpleQueue())
    thread = threading.Thread(target=out.run, args=(address,), daemon=True)
    thread.start()
    try:
        out.peer_seen.set()  # the input thread's word, in the engine: flush on close
        yield out, pull, counted
    finally:
        counted.put(STOP_OUTPUT)
        thread.join(BOUND_S)
        assert not thread.is_alive()
        pull.close(linger=0)
        guard.close()
        ctx.term()


def _received(pull: zmq.Socket[Any], n: int) -> list[list[bytes]]:
    got = []
    for _ in range(n):
        assert pull.poll(int(BOUND_S * 1000)), "nothing arrived"
        got.append(pull.recv_multipart())
    return got


def test_items_reach_the_peer_as_the_same_bytes_sent_directly_or_queued(wired: Any) -> None:
    out, pull, counted = wired
    wait_until(lambda: out.sends_now(True), BOUND_S, "the output thread owned its socket")
    for item in ITEMS:
        out.put(item, direct=True)
    assert counted.puts == 0, "a direct send with nothing ahead went through the queue"
    direct = _received(pull, len(ITEMS))
    for item in ITEMS:
        out.put(item, direct=False)
    assert counted.puts == len(ITEMS)
    assert _received(pull, len(ITEMS)) == direct
    assert direct == [[bytes(f) for f in Encoder().encode(item)] for item in ITEMS]


def test_a_payload_encoded_by_the_caller_is_the_same_message_as_its_item(wired: Any) -> None:
    out, pull, counted = wired
    wait_until(lambda: out.sends_now(True), BOUND_S, "the output thread owned its socket")
    reply = ITEMS[2]
    out.send_encoded(msgspec.msgpack.encode(reply))
    out.put(reply, direct=False)
    [fast], [general] = _received(pull, 2)
    assert counted.puts == 1
    assert msgspec.msgpack.decode(fast) == msgspec.msgpack.decode(general)


def test_a_direct_send_behind_queued_items_keeps_their_order(wired: Any) -> None:
    """Nothing queued is overtaken: with an item ahead, ``direct`` queues too (``sends_now``
    is false), and the peer sees the order they were handed over in."""
    out, pull, counted = wired
    wait_until(lambda: out.sends_now(True), BOUND_S, "the output thread owned its socket")
    counted.open.clear()
    out.put(ITEMS[0], direct=False)  # taken by the output thread, held there unsent
    assert not out.sends_now(True)
    out.put(ITEMS[1], direct=True)
    assert counted.puts == 2, "a direct send overtook a queued item"
    counted.open.set()
    wait_until(lambda: out.sends_now(True), BOUND_S, "the queue drained")
    out.put(ITEMS[2], direct=True)
    assert counted.puts == 2
    got = _received(pull, 3)
    assert got == [[bytes(f) for f in Encoder().encode(item)] for item in ITEMS]
    out.put(ENGINE_DEAD_SENTINEL, direct=False)
    assert _received(pull, 1) == [[ENGINE_DEAD_SENTINEL]]


def test_a_big_batch_goes_to_the_output_thread_only_when_a_step_overlaps() -> None:
    assert goes_direct(DIRECT_SEND_MAX_OUTPUTS, overlap=True)
    assert not goes_direct(DIRECT_SEND_MAX_OUTPUTS + 1, overlap=True)
    assert goes_direct(DIRECT_SEND_MAX_OUTPUTS + 1, overlap=False)
