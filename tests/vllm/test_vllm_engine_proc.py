"""The vLLM 0.33 wire's engine process, driven by hand the way vLLM's client drives it: the
ready, ADD/ABORT/UTILITY frames, refusals, malformed input and the dead sentinel. Needs no
vLLM (tests/vllm/test_vllm_wire.py runs vLLM's real client where it is installed), so the
profile's engine side runs everywhere."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine_proc import Control
from enginewire.runtime.vllm_wire import (
    VLLM_DEAD_SENTINEL,
    VLLM_VERSION,
    VllmEngineCoreOutputs,
    VllmEngineCoreRequest,
    VllmSamplingParams,
    VllmWireEngineProc,
)
from enginewire.spec import EngineState

CONFIG = EngineConfig(model="null", device="cpu")
BOUND_S = 30.0
ADD, ABORT, UTILITY = b"\x00", b"\x01", b"\x03"


class VllmPeer:
    """vLLM's client sockets: a ROUTER the engine's DEALER connects to, a PULL for outputs."""

    def __init__(self, tmp: Path) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"ipc://{tmp}/in")
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(f"ipc://{tmp}/out")
        self.input_address, self.output_address = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
        self.identity = (0).to_bytes(2, "little")

    def send(self, *frames: bytes) -> None:
        self.router.send_multipart([self.identity, *frames])

    def add(self, rid: str, max_tokens: int, **sp: Any) -> None:
        req = VllmEngineCoreRequest(rid, [1, 2, 3], None, VllmSamplingParams(
            max_tokens=max_tokens, **sp), None, time.time(), None, None, None)
        self.send(ADD, msgspec.msgpack.encode(req))

    def recv(self, timeout: float = BOUND_S) -> bytes:
        if not self.pull.poll(int(timeout * 1000)):
            raise AssertionError(f"no output within {timeout} s")
        frames = self.pull.recv_multipart()
        assert len(frames) == 1, frames
        return frames[0]

    def outputs(self, timeout: float = BOUND_S) -> VllmEngineCoreOutputs:
        return msgspec.msgpack.decode(self.recv(timeout), type=VllmEngineCoreOutputs)

    def until(self, pred: Callable[[VllmEngineCoreOutputs], bool]) -> list[VllmEngineCoreOutputs]:
        got: list[VllmEngineCoreOutputs] = []
        deadline = time.monotonic() + BOUND_S
        while True:
            got.append(self.outputs(max(0.01, deadline - time.monotonic())))
            if pred(got[-1]):
                return got

    def call(self, call_id: int, method: str, *args: Any) -> list[Any]:
        self.send(UTILITY, msgspec.msgpack.encode([0, call_id, method, list(args)]))
        out = self.until(lambda b: b.utility_output is not None)[-1].utility_output
        assert out is not None and out.call_id == call_id
        return [out.failure_message, out.result]

    def close(self) -> None:
        self.router.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[VllmPeer, VllmWireEngineProc]]:
    peer = VllmPeer(tmp_path)
    proc = VllmWireEngineProc(CONFIG, input_address=peer.input_address,
                              output_address=peer.output_address)
    loop = threading.Thread(target=proc.run_busy_loop, daemon=True)
    loop.start()
    try:
        yield peer, proc
    finally:
        proc.input_queue.put((Control.SHUTDOWN, None))
        loop.join(BOUND_S)
        assert not loop.is_alive()
        proc.close()
        peer.close()


def _ready(peer: VllmPeer) -> dict[str, Any]:
    assert peer.router.poll(int(BOUND_S * 1000))
    identity, frame = peer.router.recv_multipart()
    assert identity == peer.identity
    ready = msgspec.msgpack.decode(frame)
    assert isinstance(ready, dict)
    return ready


def _finished(rid: str) -> Callable[[VllmEngineCoreOutputs], bool]:
    return lambda b: any(o.request_id == rid and o.finish_reason is not None
                         for o in b.outputs)


def test_the_ready_is_vllms_map_and_comes_first(served: Any) -> None:
    peer, _proc = served
    ready = _ready(peer)
    assert ready["vllm_version"] == VLLM_VERSION and ready["data_parallel_rank"] == 0
    assert ready["num_gpu_blocks"] > 0 and ready["kv_cache_size_tokens"] > 0


def test_requests_calls_and_aborts_are_served_on_vllms_wire(served: Any) -> None:
    peer, proc = served
    _ready(peer)
    assert peer.call(1, "echo", [1, "x"]) == [None, [None, [1, "x"]]]
    peer.add("a", 4)
    outs = [o for b in peer.until(_finished("a")) for o in b.outputs if o.request_id == "a"]
    assert sum(len(o.new_token_ids) for o in outs) == 4 and outs[-1].finish_reason == 1
    # Held by a paused scheduler, then aborted: an ABORT finish, nothing else.
    assert peer.call(2, "pause_scheduler", "keep", False)[0] is None
    peer.add("b", 50)
    peer.send(ABORT, msgspec.msgpack.encode(["b"]))
    [last] = [o for o in peer.until(_finished("b"))[-1].outputs if o.request_id == "b"]
    assert last.finish_reason == 2
    assert peer.call(3, "resume_scheduler")[0] is None
    failure, _ = peer.call(4, "no_such_method")
    assert "no such utility" in (failure or "")
    assert proc.engine.lifecycle.state is EngineState.IDLE


def test_refused_and_malformed_input_is_answered_or_dropped_and_the_engine_serves_on(
        served: Any) -> None:
    peer, _proc = served
    _ready(peer)
    peer.add("two", 4, n=2)  # decodes, but this engine cannot serve it
    [out] = [o for o in peer.until(_finished("two"))[-1].outputs if o.request_id == "two"]
    assert out.finish_reason == 3 and out.error is not None and "n=2" in out.error.message
    peer.send(ADD, msgspec.msgpack.encode(["bad", "not a token list"]))  # malformed, id kept
    [out] = [o for o in peer.until(_finished("bad"))[-1].outputs if o.request_id == "bad"]
    assert out.finish_reason == 3 and "malformed request" in (out.error.message if out.error
                                                               else "")
    for frames in ([ADD, b"\xc1"], [ABORT, msgspec.msgpack.encode([1])],
                   [UTILITY, msgspec.msgpack.encode([0, "id", "echo", []])], [b"\x07", b""],
                   [b"\x02", msgspec.msgpack.encode([0, 1])]):
        peer.send(*frames)  # dropped (logged): no id to answer
    assert peer.call(9, "echo", 5) == [None, [None, 5]]
    peer.add("after", 2)
    peer.until(_finished("after"))


def test_death_is_vllms_sentinel(tmp_path: Path) -> None:
    peer = VllmPeer(tmp_path)
    proc = VllmWireEngineProc(CONFIG, input_address=peer.input_address,
                              output_address=peer.output_address)
    _ready(peer)
    try:
        proc.send_engine_dead()
        frames = []
        deadline = time.monotonic() + BOUND_S
        while VLLM_DEAD_SENTINEL not in frames and time.monotonic() < deadline:
            frames.append(peer.recv(max(0.01, deadline - time.monotonic())))
        assert frames[-1] == VLLM_DEAD_SENTINEL
    finally:
        proc.close()
        peer.close()
