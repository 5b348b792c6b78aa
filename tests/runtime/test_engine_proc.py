"""EngineCoreProc: the engine behind raw sockets (a hand-driven peer), signals, parent death,
attached engines with a heartbeat, and the private ipc directory."""

from __future__ import annotations

import multiprocessing
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from enginewire.protocol.codec import (
    Encoder,
    Limits,
    decode_outputs,
    decode_ready,
    encode_input,
)
from enginewire.protocol.messages import (
    ENGINE_DEAD_SENTINEL,
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ReadyResponse,
    RequestType,
    SamplingParams,
    UtilityOutput,
    UtilityRequest,
)
from enginewire.runtime import IpcDir, cleanup_stale_dirs, make_client
from enginewire.runtime._engine_output import Retired
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine_proc import (
    Control,
    EngineCoreProc,
    process_main,
    run_engine_core,
)
from enginewire.spec import (
    ENGINE,
    UTILITY,
    ClientClosedError,
    EngineDeadError,
    EngineStartupError,
    EngineState,
    ProtocolError,
    UtilityError,
    validate_trace,
)
from enginewire.spec.engine import EngineEvent
from enginewire.testing._harness import wait_until
from enginewire.testing.conformance import open_client, request

torch.set_num_threads(1)
os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")

CONFIG = EngineConfig(model="tiny", max_num_seqs=8)
BOUND_S = 30.0


class Peer:
    """The client's two sockets, driven by hand (h11's ConnectionPair in spirit)."""

    def __init__(self, tmp: Path) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.SNDHWM, 0)  # as the clients: a full ROUTER drops silently
        self.router.bind(f"ipc://{tmp}/in")
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(f"ipc://{tmp}/out")
        self.input_address = f"ipc://{tmp}/in"
        self.output_address = f"ipc://{tmp}/out"
        self.identity = (0).to_bytes(2, "little")
        self.encoder = Encoder()

    def send(self, kind: RequestType, obj: object) -> None:
        self.router.send_multipart([self.identity, *encode_input(self.encoder, kind, obj)])

    def send_raw(self, *frames: bytes) -> None:
        self.router.send_multipart([self.identity, *frames])

    def recv(self, timeout: float = BOUND_S) -> EngineCoreOutputs:
        if not self.pull.poll(int(timeout * 1000)):
            raise AssertionError(f"no output within {timeout} s")
        return decode_outputs(self.pull.recv_multipart()).expanded()

    def until(self, pred: Any, timeout: float = BOUND_S) -> list[EngineCoreOutputs]:
        got: list[EngineCoreOutputs] = []
        deadline = time.monotonic() + timeout
        while True:
            got.append(self.recv(max(0.01, deadline - time.monotonic())))
            if pred(got[-1]):
                return got

    def close(self) -> None:
        self.router.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Peer, EngineCoreProc, list[Any]]]:
    """An EngineCoreProc whose busy loop runs on a thread, facing a hand-driven peer."""
    peer = Peer(tmp_path)
    trace: list[Any] = []
    proc = EngineCoreProc(CONFIG, input_address=peer.input_address,
                          output_address=peer.output_address, trace=trace)
    identity, *frames = peer.router.recv_multipart()
    assert identity == peer.identity
    ready = decode_ready(frames)
    assert ready.num_gpu_blocks > 0 and ready.block_size == CONFIG.block_size
    loop = threading.Thread(target=proc.run_busy_loop, daemon=True)
    loop.start()
    try:
        yield peer, proc, trace
    finally:
        proc.input_queue.put((Control.SHUTDOWN, None))
        loop.join(BOUND_S)
        assert not loop.is_alive()
        proc.close()
        peer.close()
        assert proc.engine.lifecycle.state is EngineState.SHUTDOWN
        validate_trace(ENGINE, trace)


def _finished(rid: str) -> Any:
    return lambda b: any(o.request_id == rid and o.finished for o in b.outputs)


def test_handshake_then_loop_in_trace(served: Any) -> None:
    peer, _proc, trace = served
    peer.send(RequestType.ADD, request("a", 5))
    outs = peer.until(_finished("a"))
    assert sum(len(o.new_token_ids) for b in outs for o in b.outputs) == 5
    events = [e[2] for e in trace if e[0] == "engine"]
    assert events[:3] == ["BUILT", "HANDSHAKE_SENT", "LOOP_STARTED"]


def test_abort_right_after_add_is_never_lost(served: Any) -> None:
    peer, _proc, _trace = served
    for i in range(5):
        peer.send(RequestType.ADD, request(f"r{i}", 200))
        peer.send(RequestType.ABORT, [f"r{i}"])
    done: dict[str, FinishReason] = {}
    deadline = time.monotonic() + BOUND_S
    while len(done) < 5 and time.monotonic() < deadline:
        for o in peer.recv().outputs:
            if o.finish_reason is not None:
                done[o.request_id] = o.finish_reason
    assert done == {f"r{i}": FinishReason.ABORT for i in range(5)}


def test_token_ids_outside_the_vocabulary_are_refused_over_the_wire_as_in_process(
        served: Any) -> None:
    """The input thread's decoder checks ADDs' ids against the vocabulary (the busy loop then
    skips its scan); one outside it still ends with the same ERROR, and the engine serves on."""
    peer, proc, _trace = served
    vocab = proc.engine.arch.vocab_size
    peer.send(RequestType.ADD, EngineCoreRequest("oov", [1, vocab], SamplingParams(max_tokens=2)))
    peer.send(RequestType.ADD, EngineCoreRequest("neg", [-1, 1], SamplingParams(max_tokens=2)))
    peer.send(RequestType.ADD, EngineCoreRequest("top", [0, vocab - 1],
                                                 SamplingParams(max_tokens=2)))
    done: dict[str, EngineCoreOutput] = {}
    deadline = time.monotonic() + BOUND_S
    while len(done) < 3 and time.monotonic() < deadline:
        done.update((o.request_id, o) for o in peer.recv().outputs if o.finished)
    assert done["oov"].finish_reason is FinishReason.ERROR
    assert f"token id {vocab} is outside the vocabulary" in (done["oov"].error or "")
    assert done["neg"].finish_reason is FinishReason.ERROR
    assert "token id -1 is outside the vocabulary" in (done["neg"].error or "")
    assert done["top"].finish_reason is FinishReason.LENGTH


def test_aborts_to_an_idle_engine_are_not_kept_for_a_step(served: Any) -> None:
    """Each ABORT's ids were also kept for a step that might be running; an idle engine never
    stepped, so millions of no-op aborts grew it by ~120 B per id."""
    peer, proc, _trace = served
    for i in range(300):
        peer.send(RequestType.ABORT, [f"nope-{i}-{j}" for j in range(20)])
    peer.send(RequestType.UTILITY, UtilityRequest(0, 7, "echo", ["after"]))
    reply = peer.until(lambda b: b.utility_output is not None)[-1].utility_output
    assert reply is not None and reply.result == "after"  # queued behind every abort
    assert len(proc.engine.mid_step_aborts) == 0


def test_malformed_frames_never_kill_the_input_thread(served: Any) -> None:
    peer, proc, _trace = served
    peer.send_raw(b"\x09junk")
    peer.send_raw(RequestType.ADD.value + b"\xc1")
    peer.send_raw(RequestType.ADD.value)
    peer.send_raw(b"")
    peer.send_raw(b"\x09", b"junk")  # two parts, each rejected as a message of its own
    peer.send_raw(RequestType.ADD.value + msgspec.msgpack.encode(["bad-1", "x"]))
    peer.send_raw(RequestType.UTILITY.value + msgspec.msgpack.encode([0, 77, None]))
    outs = peer.until(lambda b: b.utility_output is not None)
    errors = [o for b in outs for o in b.outputs if o.request_id == "bad-1"]
    if not errors:
        errors = [o for b in peer.until(_finished("bad-1")) for o in b.outputs]
    assert errors[-1].finish_reason is FinishReason.ERROR and errors[-1].error
    assert outs[-1].utility_output.call_id == 77 and outs[-1].utility_output.failure_message
    assert all(t.is_alive() for t in proc._threads)
    peer.send(RequestType.ADD, request("ok", 3))
    peer.until(_finished("ok"))


def test_a_part_nothing_refers_to_is_rejected_alone_and_loses_nothing(served: Any) -> None:
    """A message's further parts are read only when its payload refers to them. A part sent
    after a complete message is a message of its own: rejected, and the messages around it
    are served, even one whose type byte and payload the stray could be mistaken for."""
    peer, proc, _trace = served
    call = encode_input(peer.encoder, RequestType.UTILITY, UtilityRequest(0, 31, "echo", ["a"]))
    abort = encode_input(peer.encoder, RequestType.ABORT, ["nobody"])
    for stray in (b"\x09?", RequestType.ABORT.value, b"\x93\x00\x20\xa4echo", abort[0]):
        peer.send_raw(*call, stray)
        reply = peer.until(lambda b: b.utility_output is not None)[-1].utility_output
        assert reply == UtilityOutput(31, None, "a")
    # An aux-frame call is read whole (the payload refers to its part), then a stray after it.
    arr = np.arange(64, dtype=np.int64)
    frames = encode_input(peer.encoder, RequestType.UTILITY, UtilityRequest(0, 32, "echo", [arr]))
    assert len(frames) == 2
    peer.send_raw(*frames, b"\x07stray")
    peer.send(RequestType.UTILITY, UtilityRequest(0, 33, "echo", ["after"]))
    got = [b.utility_output for b in peer.until(
        lambda b: b.utility_output is not None and b.utility_output.call_id == 33)
        if b.utility_output is not None]
    assert [u.call_id for u in got] == [32, 33] and got[-1].result == "after"
    assert all(t.is_alive() for t in proc._threads)
    peer.send(RequestType.ADD, request("still", 3))
    peer.until(_finished("still"))


def test_deferred_reply_follows_the_outputs_it_waited_for(served: Any) -> None:
    peer, _proc, _trace = served
    peer.send(RequestType.ADD, request("w", 30))
    peer.send(RequestType.UTILITY, UtilityRequest(0, 5, "pause_scheduler", ["wait"]))
    outs = peer.until(lambda b: b.utility_output is not None)
    finished = [o for b in outs for o in b.outputs if o.finished]
    assert [o.request_id for o in finished] == ["w"], "reply arrived before the drain finished"
    assert outs[-1].utility_output.failure_message is None
    peer.send(RequestType.UTILITY, UtilityRequest(0, 6, "resume_scheduler", []))
    peer.until(lambda b: b.utility_output is not None)


def test_utility_failure_is_a_reply_not_a_crash(served: Any) -> None:
    peer, _proc, _trace = served
    peer.send(RequestType.UTILITY, UtilityRequest(0, 1, "no_such_method", []))
    reply = peer.until(lambda b: b.utility_output is not None)[-1].utility_output
    assert reply.call_id == 1 and "no such utility" in (reply.failure_message or "")
    peer.send(RequestType.UTILITY, UtilityRequest(0, 2, "echo", [[1, 2]]))
    reply = peer.until(lambda b: b.utility_output is not None)[-1].utility_output
    assert reply.result == [1, 2]


def test_idle_calls_take_the_short_path_only_for_plain_results(served: Any) -> None:
    """The input thread's short path sends plain results itself; every other result (arrays,
    containers) goes through the general reply path, and the client sees the same replies
    either way. A result no encoder can send (an int past 64 bits, a str with no UTF-8 form)
    falls back to the general path, which makes it a failure reply."""
    peer, proc, _trace = served
    paths: list[str] = []
    fast, general = proc.output.send_encoded, proc.output.put

    def spy_fast(payload: bytes) -> None:
        paths.append("fast")
        fast(payload)

    def spy_general(item: Any, *, direct: bool) -> None:
        paths.append("general")
        general(item, direct=direct)

    proc.output.send_encoded = spy_fast  # type: ignore[method-assign]
    proc.output.put = spy_general  # type: ignore[method-assign]
    # Results no client could send as an argument: an engine-side utility makes them.
    unsendable = {"huge": 2**70, "surrogate": "\ud800"}
    engine = proc.engine
    engine.UTILITY_METHODS = engine.UTILITY_METHODS | {"unsendable"}
    engine.unsendable = unsendable.__getitem__
    cases: list[tuple[object, object]] = [
        (None, None), (True, True), (2**64 - 1, 2**64 - 1), (-(2**63), -(2**63)), (1.5, 1.5),
        ("text", "text"), (b"\x00\x01", b"\x00\x01"),
        ([1, [2]], [1, [2]]), ({"k": 1}, {"k": 1}),
        ("huge", "cannot be sent"), ("surrogate", "cannot be sent"),
    ]
    for call_id, (value, expected) in enumerate(cases, 1):
        paths.clear()
        method = "unsendable" if expected == "cannot be sent" else "echo"
        peer.send(RequestType.UTILITY, UtilityRequest(0, call_id, method, [value]))
        reply = peer.until(lambda b: b.utility_output is not None)[-1].utility_output
        assert reply.call_id == call_id
        if method == "unsendable":
            assert "cannot be sent" in (reply.failure_message or ""), value
        else:
            assert reply.failure_message is None and reply.result == expected, value
        deadline = time.monotonic() + BOUND_S
        while not paths and time.monotonic() < deadline:
            time.sleep(0.001)
        # A plain reply never reaches the general path; any other one (an unsendable result
        # included) always does, and only a plain one is sent by the short path.
        plain = method == "echo" and type(value) in (type(None), bool, int, float, str, bytes)
        assert ("general" in paths) is not plain, (value, paths)
        assert ("fast" in paths) is plain, (value, paths)
    arr = np.arange(100, dtype=np.int64)
    peer.send(RequestType.UTILITY, UtilityRequest(0, 99, "echo", [arr]))
    reply = peer.until(lambda b: b.utility_output is not None)[-1].utility_output
    assert reply.call_id == 99 and np.array_equal(reply.result, arr)


class _SpyQueue:
    """Stands in for an engine's output queue (a C ``SimpleQueue``, whose methods cannot be
    replaced): every item put goes to ``on_put`` first."""

    def __init__(self, inner: Any, on_put: Any) -> None:
        self._inner, self._on_put = inner, on_put

    def put(self, item: Any) -> None:
        self._on_put(item)
        self._inner.put(item)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _spy_output(proc: Any, on_put: Any) -> None:
    # Every put goes through the spy; the output thread reads the queue under it.
    proc.output.output_queue = _SpyQueue(proc.output.output_queue, on_put)


def test_replies_to_a_client_that_stops_reading_arrive_in_order(served: Any) -> None:
    """Direct sends never block: once the pipe to a client that stopped reading is full, the
    idle-call path hands encoded replies to the output thread, and the client still gets
    every reply, once, in order, when it reads again."""
    peer, proc, _trace = served
    handed_over: list[str] = []
    _spy_output(proc, lambda item: handed_over.append(type(item).__name__))
    payload = b"p" * 1024
    n = 4000  # 4 MiB of replies: more than zmq's 1000-message queues and the socket buffers
    for call_id in range(1, n + 1):
        peer.send(RequestType.UTILITY, UtilityRequest(0, call_id, "echo", [payload]))
    deadline = time.monotonic() + BOUND_S
    while "_Encoded" not in handed_over and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "_Encoded" in handed_over, "the pipe never filled: the test did not test the fallback"
    ids = []
    while len(ids) < n:
        reply = peer.recv().utility_output
        if reply is not None:
            assert reply.result == payload
            ids.append(reply.call_id)
    assert ids == list(range(1, n + 1))
    assert all(t.is_alive() for t in proc._threads)


@pytest.mark.parametrize(("delay_s", "via_thread"), [(0.0, False), (0.002, True)])
def test_big_batches_use_the_output_thread_only_when_a_step_leaves_it_time(
        tmp_path: Path, delay_s: float, via_thread: bool) -> None:
    """The output thread exists to encode while the next step computes. A forward that never
    releases the GIL (null model, no delay) leaves it nothing to overlap, so the busy loop
    sends every batch itself; with a delay (standing in for device time) big batches go
    through the thread. Small ones are always sent by the thread that built them."""
    config = EngineConfig(model="null", max_num_seqs=256, max_num_batched_tokens=2048,
                          null_step_delay_s=delay_s)
    peer = Peer(tmp_path)
    proc = EngineCoreProc(config, input_address=peer.input_address,
                          output_address=peer.output_address)
    peer.router.recv_multipart()
    queued: list[int] = []

    def spy(item: Any) -> None:
        if isinstance(item, EngineCoreOutputs):
            queued.append(len(item.outputs) + len(item.stream_ids))

    _spy_output(proc, spy)
    loop = threading.Thread(target=proc.run_busy_loop, daemon=True)
    loop.start()
    try:
        assert proc._overlap is via_thread
        for i in range(200):
            peer.send(RequestType.ADD, request(f"r{i}", 40))  # long enough to overlap
        finished: set[str] = set()
        deadline = time.monotonic() + BOUND_S
        while len(finished) < 200 and time.monotonic() < deadline:
            finished.update(o.request_id for o in peer.recv().outputs if o.finished)
        assert len(finished) == 200
        if via_thread:
            assert any(n > 64 for n in queued), queued
        else:
            assert queued == [], "batches went through the output thread"
    finally:
        proc.input_queue.put((Control.SHUTDOWN, None))
        loop.join(BOUND_S)
        proc.close()
        peer.close()


@pytest.mark.parametrize(("delay_s", "via_thread"), [(0.0, False), (0.002, True)])
def test_finished_requests_are_torn_down_behind_their_batch(
        tmp_path: Path, delay_s: float, via_thread: bool) -> None:
    """A batch that finishes many requests leaves their teardown (milliseconds for a
    thousand) to the output thread, queued behind the batch that carries their finishes, so
    their outputs are sent first; the thread drops them without sending anything. Without a
    step that releases the GIL there is nothing to overlap and nothing is queued."""
    config = EngineConfig(model="null", max_num_seqs=256, max_num_batched_tokens=8192,
                          null_step_delay_s=delay_s)
    peer = Peer(tmp_path)
    proc = EngineCoreProc(config, input_address=peer.input_address,
                          output_address=peer.output_address)
    peer.router.recv_multipart()
    items: list[Any] = []  # a teardown as the ids it carried: holding it would keep them
    _spy_output(proc, lambda item: items.append(
        [r.request_id for r in item.requests] if type(item) is Retired else item))
    loop = threading.Thread(target=proc.run_busy_loop, daemon=True)
    loop.start()
    try:
        # Held until all are in, so they decode as one batch and finish in one step.
        peer.send(RequestType.UTILITY, UtilityRequest(0, 1, "pause_scheduler", ["keep"]))
        for i in range(200):
            peer.send(RequestType.ADD, request(f"r{i}", 8))
        wait_until(lambda: proc.engine.num_live_requests() == 200, BOUND_S)
        held = list(proc.engine.scheduler.requests.values())
        peer.send(RequestType.UTILITY, UtilityRequest(0, 2, "resume_scheduler", []))
        finished: list[str] = []
        deadline = time.monotonic() + BOUND_S
        while len(finished) < 200 and time.monotonic() < deadline:
            finished.extend(o.request_id for o in peer.recv().outputs if o.finished)
        assert sorted(finished) == sorted(f"r{i}" for i in range(200))
        # Once idle, nothing but this test holds them: a busy loop's local still bound to
        # them would tear them down only after the next burst's first step.
        wait_until(lambda: max(sys.getrefcount(r) for r in held) == 3, BOUND_S,
                   "the finished requests were released")
        retired = [(n, item) for n, item in enumerate(items) if type(item) is list]
        if not via_thread:
            assert retired == []
            return
        assert retired, "no teardown reached the output thread"
        for n, item in retired:  # behind the batch that finished them
            ahead = items[n - 1]
            assert isinstance(ahead, EngineCoreOutputs)
            assert set(item) <= set(ahead.finished_requests or ())
        # The thread took them off its queue (sending nothing: the peer saw only batches),
        # and the engine keeps none of them.
        wait_until(lambda: proc.output_queue.qsize() == 0, BOUND_S, "the queue drained")
        assert proc.engine.scheduler.ended == [] and proc.engine.num_live_requests() == 0
    finally:
        proc.input_queue.put((Control.SHUTDOWN, None))
        loop.join(BOUND_S)
        proc.close()
        peer.close()


def _spawn_engine(tmp: Path, **kwargs: Any) -> Any:
    mp = multiprocessing.get_context("spawn")
    base = {"input_address": f"ipc://{tmp}/in", "output_address": f"ipc://{tmp}/out"}
    p = mp.Process(target=process_main,
                   args=(EngineConfig, msgspec.msgpack.encode(CONFIG), {**base, **kwargs}),
                   daemon=True)
    p.start()
    return p


def _catches(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler for ``sig`` (Linux: SigCgt in /proc/<pid>/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_sigterm_during_construction_exits_cleanly(tmp_path: Path) -> None:
    p = _spawn_engine(tmp_path, startup_delay_s=60.0)
    try:
        # Before Python runs our code the default action applies; wait (bounded) until the
        # engine catches SIGTERM, i.e. it is inside run_engine_core, holding before the build.
        deadline = time.monotonic() + BOUND_S
        while not _catches(p.pid, signal.SIGTERM):
            assert time.monotonic() < deadline, "engine never installed its SIGTERM handler"
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGTERM)
        p.join(BOUND_S)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join()


def test_sigterm_of_running_engine_is_a_clean_exit() -> None:
    with open_client("sync", CONFIG) as cut:
        pid = cut.engine_pid
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        killed = time.monotonic()
        with pytest.raises(EngineDeadError) as info:
            cut.get_output(timeout=BOUND_S)
        assert time.monotonic() - killed < 2.0
        assert "exit code 0" in str(info.value.__cause__)


def test_attached_engine_with_heartbeat(tmp_path: Path) -> None:
    """An engine started elsewhere: liveness from the heartbeat, not a process handle."""
    ipc = tmp_path
    engine = _spawn_engine(ipc, heartbeat_interval_s=0.1)
    try:
        client = make_client(CONFIG, multiprocess=True, asyncio=False, launch_engine=False,
                             input_address=f"ipc://{ipc}/in", output_address=f"ipc://{ipc}/out",
                             engine_heartbeat_timeout_s=1.0, ready_timeout_s=BOUND_S)
        with client:
            client.add_request(request("hb", 5))
            assert collect_sync(client, "hb") == 5
            os.kill(engine.pid, signal.SIGSTOP)  # alive but silent
            stopped = time.monotonic()
            with pytest.raises(EngineDeadError) as info:
                client.get_output(timeout=BOUND_S)
            assert time.monotonic() - stopped < 2.0
            assert "heartbeat" in str(info.value.__cause__)
    finally:
        engine.kill()
        engine.join(BOUND_S)


def collect_sync(client: Any, rid: str) -> int:
    n = 0
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        for o in client.get_output(timeout=1.0).outputs:
            n += len(o.new_token_ids)
            if o.request_id == rid and o.finished:
                return n
    raise AssertionError("request did not finish")


def test_ipc_dir_is_private_and_removed(tmp_path: Path) -> None:
    d = IpcDir(tmp_path)
    assert stat.S_IMODE(d.path.stat().st_mode) == 0o700
    assert d.address("input").startswith("ipc://")
    d.remove()
    assert not d.path.exists()
    # A directory of a process that no longer runs is stale and reclaimed.
    stale = tmp_path / "enginewire-999999999-1-abcd"
    stale.mkdir()
    (stale / "input").touch()
    mine = IpcDir(tmp_path)  # creating one cleans up the stale ones
    assert not stale.exists() and mine.path.exists()
    assert cleanup_stale_dirs(tmp_path) == []
    mine.remove()


def test_client_ipc_dir_removed_on_shutdown() -> None:
    cut = open_client("sync", CONFIG)
    path = cut.client.resources.ipc_dir.path
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    cut.shutdown()
    assert not path.exists()


def test_outputs_queued_before_death_are_delivered_first() -> None:
    with open_client("sync", CONFIG) as cut:
        client = cut.client
        cut.add_request(request("pre", 5))

        def finish_queued() -> bool:
            return any(o.finished for b in list(client._outputs.queue)
                       if isinstance(b, EngineCoreOutputs) for o in b.outputs)

        deadline = time.monotonic() + BOUND_S
        while not finish_queued():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        os.kill(cut.engine_pid, signal.SIGKILL)
        while not client.is_dead:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        tokens = 0
        with pytest.raises(EngineDeadError):
            for _ in range(100):
                tokens += sum(len(o.new_token_ids) for o in cut.get_output(timeout=1.0).outputs)
        assert tokens == 5


class FakeEngine:
    """A hand-driven engine peer for an attached client (vLLM's fake-engine utility tests).
    After ``ready()`` a thread answers the client's ATTACH with the marker (the client's
    construction waits for it); ``dealer`` and ``push`` are the test's once it has."""

    def __init__(self, tmp: Path) -> None:
        self.input_address = f"ipc://{tmp}/fin"
        self.output_address = f"ipc://{tmp}/fout"
        self.ctx = zmq.Context()
        self._dealer = self.ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, (0).to_bytes(2, "little"))
        self._dealer.connect(self.input_address)
        self._push = self.ctx.socket(zmq.PUSH)
        self._push.connect(self.output_address)
        self.encoder = Encoder()
        self._attacher: threading.Thread | None = None

    def ready(self, version: int = PROTOCOL_VERSION) -> None:
        self._dealer.send(msgspec.msgpack.encode(
            ReadyResponse(version, 0, 64, CONFIG.block_size, 128, "fake", "cpu")))
        if version == PROTOCOL_VERSION:
            self._attacher = threading.Thread(target=self._answer_attach, daemon=True)
            self._attacher.start()

    def _answer_attach(self) -> None:
        if not self._dealer.poll(int(BOUND_S * 1000)):
            return
        first = self._dealer.recv()
        assert first[:1] == RequestType.ATTACH.value
        session = msgspec.msgpack.decode(first[1:])[0]
        self._push.send_multipart(self.encoder.encode(EngineCoreOutputs(session=session)))

    def _attached(self) -> None:
        if self._attacher is not None:
            self._attacher.join(BOUND_S)
            self._attacher = None

    @property
    def dealer(self) -> zmq.Socket[bytes]:
        self._attached()
        return self._dealer

    @property
    def push(self) -> zmq.Socket[bytes]:
        self._attached()
        return self._push

    def recv_input(self) -> tuple[bytes, Any]:
        assert self.dealer.poll(int(BOUND_S * 1000))
        first, *_aux = self.dealer.recv_multipart()
        return first[:1], msgspec.msgpack.decode(first[1:])

    def send_outputs(self, outputs: EngineCoreOutputs) -> None:
        self.push.send_multipart(self.encoder.encode(outputs))

    def close(self) -> None:
        self._attached()
        self._dealer.close(linger=0)
        self._push.close(linger=0)
        self.ctx.term()


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeEngine]:
    f = FakeEngine(tmp_path)
    try:
        yield f
    finally:
        f.close()


def _attach(fake: FakeEngine, **options: Any) -> Any:
    return make_client(CONFIG, multiprocess=True, asyncio=False, launch_engine=False,
                       input_address=fake.input_address, output_address=fake.output_address,
                       ready_timeout_s=BOUND_S, **options)


def test_protocol_version_mismatch_is_refused(fake: FakeEngine) -> None:
    fake.ready(version=PROTOCOL_VERSION + 1)
    with pytest.raises(EngineStartupError, match="protocol version"):
        _attach(fake)


def test_ready_response_is_applied_to_the_config(fake: FakeEngine) -> None:
    fake.ready()
    with _attach(fake) as client:
        assert client.num_gpu_blocks == 64
        assert client.config.max_model_len == 128  # min(ours, the engine's)


def test_a_messages_parts_are_read_only_when_it_has_them(fake: FakeEngine) -> None:
    """The client receives a message's first frame as plain bytes and reads further parts
    only when the message has them: a reply with an aux frame arrives whole. A part that a
    one-frame reply should not have arrives as a message of its own, does not decode, and
    the engine is declared dead: an error, not a hang or a misrouted reply."""
    fake.ready()
    with _attach(fake) as client:
        got: list[Any] = []

        def call(value: Any) -> threading.Thread:
            t = threading.Thread(
                target=lambda: got.append(client.call_utility("echo", value, timeout=BOUND_S)))
            t.start()
            return t

        arr = np.arange(100, dtype=np.int64)  # 800 bytes: sent as an aux frame
        t = call(arr)
        _, req = fake.recv_input()
        frames = fake.encoder.encode(EngineCoreOutputs(utility_output=UtilityOutput(req[1],
                                                                                  result=arr)))
        assert len(frames) == 2
        fake.push.send_multipart(frames)
        t.join(BOUND_S)
        assert not t.is_alive() and np.array_equal(got[0], arr)

        t = call("x")
        _, req = fake.recv_input()
        (payload,) = fake.encoder.encode(EngineCoreOutputs(utility_output=UtilityOutput(
            req[1], result="x")))
        fake.push.send_multipart([payload, b"\xc1 stray"])  # 0xc1: never valid msgpack
        t.join(BOUND_S)
        assert not t.is_alive() and got[1] == "x"
        with pytest.raises(EngineDeadError) as info:
            client.get_output(timeout=BOUND_S)
        assert isinstance(info.value.__cause__, ProtocolError)


def test_replies_of_every_shape_reach_their_caller(fake: FakeEngine) -> None:
    """A plain reply takes the client's short decode; a reply with outputs beside it, one
    over the short decode's size and a failure reply take the general path. Each reaches
    its caller, and the outputs beside a reply are checked as any batch is."""
    from enginewire.runtime.mp_client import _PLAIN_REPLY_BYTES

    fake.ready()
    with _attach(fake) as client:
        got: list[Any] = []

        def call(value: Any) -> threading.Thread:
            def run() -> None:
                try:
                    got.append(client.call_utility("echo", value, timeout=BOUND_S))
                except Exception as e:
                    got.append(e)
            t = threading.Thread(target=run)
            t.start()
            return t

        big = "b" * (_PLAIN_REPLY_BYTES + 10)
        replies = [
            lambda cid: UtilityOutput(cid, result="plain"),
            lambda cid: UtilityOutput(cid, result=big),
            lambda cid: UtilityOutput(cid, failure_message="it failed"),
        ]
        for make in replies:
            t = call("v")
            _, req = fake.recv_input()
            fake.send_outputs(EngineCoreOutputs(utility_output=make(req[1])))
            t.join(BOUND_S)
            assert not t.is_alive()
        assert got[0] == "plain" and got[1] == big
        assert isinstance(got[2], UtilityError) and "it failed" in str(got[2])
        # A small batch bound, so the over-bound message stays under the short decode's size.
        client._out_decoder.limits = Limits(max_batch=2)
        t = call("v")
        _, req = fake.recv_input()
        fake.send_outputs(EngineCoreOutputs(
            outputs=[EngineCoreOutput("nobody", [1])] * 3,
            utility_output=UtilityOutput(req[1], result="with outputs")))
        t.join(BOUND_S)
        assert not t.is_alive()
        # Over the batch bound: the general path refuses the message and the engine is dead.
        assert isinstance(got[3], EngineDeadError)


def test_a_reply_with_over_bound_finished_ids_is_refused(fake: FakeEngine) -> None:
    """Finished ids beside a reply are bounded as in any batch: the reply does not take the
    client's short decode around the post-check."""
    fake.ready()
    with _attach(fake) as client:
        got: list[Any] = []

        def run() -> None:
            try:
                got.append(client.call_utility("echo", "v", timeout=BOUND_S))
            except Exception as e:
                got.append(e)

        # A small batch bound, so the over-bound message stays under the short decode's size.
        client._out_decoder.limits = Limits(max_batch=2)
        t = threading.Thread(target=run)
        t.start()
        _, req = fake.recv_input()
        ids = ["r0", "r1", "r2"]
        fake.send_outputs(EngineCoreOutputs(
            finished_requests=ids, utility_output=UtilityOutput(req[1], result="v")))
        t.join(BOUND_S)
        assert not t.is_alive() and isinstance(got[0], EngineDeadError)


def test_a_batch_is_decoded_once_and_checked_as_any_batch(fake: FakeEngine) -> None:
    """A batch small enough for the client's short decode is decoded there once: the general
    path checks that result instead of decoding the payload again (a second decode was a
    tenth of the client's time per batch at K = 1024). The bounds still apply: stream
    columns of different lengths are refused and the engine declared dead."""
    fake.ready()
    with _attach(fake) as client:
        decodes: list[str] = []
        short, dec = client._decode_reply, client._out_decoder

        def spy(name: str, f: Any) -> Any:
            def counted(*a: Any, **k: Any) -> Any:
                decodes.append(name)
                return f(*a, **k)
            return counted

        client._decode_reply = spy("short", short)
        dec.decode_payload = spy("payload", dec.decode_payload)  # type: ignore[method-assign]
        dec.decode = spy("full", dec.decode)  # type: ignore[method-assign]
        client.add_request(request("a", 5))
        client.add_request(request("b", 5))
        fake.send_outputs(EngineCoreOutputs(stream_ids=["a", "b"], stream_tokens=[1, 2]))
        got = client.get_output(timeout=BOUND_S)
        assert got.outputs == [EngineCoreOutput("a", [1]), EngineCoreOutput("b", [2])]
        assert decodes == ["short"]
        # Shaped as a batch, refused by the post-check that the short decode skips.
        fake.push.send(msgspec.msgpack.encode(EngineCoreOutputs(stream_ids=["a", "b"],
                                                                stream_tokens=[3])))
        with pytest.raises(EngineDeadError) as info:
            client.get_output(timeout=BOUND_S)
        assert isinstance(info.value.__cause__, ProtocolError)
        assert "as many stream tokens as stream ids" in str(info.value.__cause__)


def test_sentinel_fails_every_pending_utility(fake: FakeEngine) -> None:
    fake.ready()
    trace: list[Any] = []
    with _attach(fake, trace=trace) as client:
        pool = [threading.Thread(target=_expect_dead_call, args=(client, i)) for i in range(3)]
        for t in pool:
            t.start()
        for _ in range(3):
            fake.recv_input()  # all three calls are on the wire
        fake.push.send(ENGINE_DEAD_SENTINEL)
        for t in pool:
            t.join(BOUND_S)
            assert not t.is_alive()
        assert client.pending_utility_calls() == 0
        with pytest.raises(EngineDeadError):
            client.call_utility("echo", 1)
    validate_trace(UTILITY, trace)
    assert sum(1 for e in trace if e[0] == "utility" and e[2] == "ENGINE_DIED") == 3


def _expect_dead_call(client: Any, i: int) -> None:
    with pytest.raises(EngineDeadError):
        client.call_utility("echo", i)


def test_unknown_call_id_reply_is_dropped_and_reader_lives(fake: FakeEngine) -> None:
    fake.ready()
    with _attach(fake) as client:
        fake.send_outputs(EngineCoreOutputs(utility_output=UtilityOutput(12345, result=1)))
        done = threading.Event()
        result: list[Any] = []

        def call() -> None:
            result.append(client.call_utility("echo", "x", timeout=BOUND_S))
            done.set()

        t = threading.Thread(target=call)
        t.start()
        _, (_idx, call_id, method, args) = fake.recv_input()
        assert method == "echo"
        fake.send_outputs(EngineCoreOutputs(utility_output=UtilityOutput(call_id, result=args[0])))
        assert done.wait(BOUND_S) and result == ["x"]
        t.join(BOUND_S)


def test_undecodable_output_is_engine_death_with_protocol_cause(fake: FakeEngine) -> None:
    fake.ready()
    with _attach(fake) as client:
        fake.push.send(b"\xc1 definitely not msgpack")
        with pytest.raises(EngineDeadError) as info:
            client.get_output(timeout=BOUND_S)
        assert isinstance(info.value.__cause__, ProtocolError)


def test_shutdown_fails_pending_utility_with_client_closed(fake: FakeEngine) -> None:
    fake.ready()
    client = _attach(fake)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            client.call_utility("echo", 1)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=call)
    t.start()
    fake.recv_input()
    client.shutdown()
    t.join(BOUND_S)
    assert len(errors) == 1 and isinstance(errors[0], ClientClosedError)
    client.shutdown()  # idempotent


def test_shutdown_aborts_what_an_attached_engine_still_runs(fake: FakeEngine) -> None:
    """An attached engine outlives its front end: at shutdown the client aborts the requests
    it still has there (only those), so the engine stops working for nobody."""
    fake.ready()
    client = _attach(fake)
    try:
        client.add_request(request("left", 5))
        client.add_request(request("done", 5))
        assert [fake.recv_input()[0] for _ in range(2)] == [RequestType.ADD.value] * 2
        fake.send_outputs(EngineCoreOutputs(
            outputs=[EngineCoreOutput("done", [1], FinishReason.LENGTH)],
            finished_requests=["done"]))
        deadline = time.monotonic() + BOUND_S
        while "done" in client.live_requests():
            assert time.monotonic() < deadline
            client.get_output(timeout=1.0)
    finally:
        client.shutdown()
    kind, ids = fake.recv_input()
    assert kind == RequestType.ABORT.value and ids == ["left"]


# -- request-scoped and fatal failures, shutdown's last outputs, long ids ---------------------

NULL_CONFIG = EngineConfig(model="null", device="cpu")


def test_a_request_the_engine_raises_on_ends_with_error_and_the_engine_serves_on(
        served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected exception from EngineCore.add_request is request-scoped: that request
    gets an ERROR output naming it (else its owner waits for it forever) and others run."""
    peer, proc, _trace = served
    validate = proc.engine._validate

    def failing(req: Any) -> Any:
        if list(req.prompt_token_ids) == [7, 7, 7]:
            raise RuntimeError("simulated request-scoped failure")
        return validate(req)

    monkeypatch.setattr(proc.engine, "_validate", failing)
    peer.send(RequestType.ADD, request("bad", 3, prompt=[7, 7, 7]))
    peer.send(RequestType.ADD, request("ok", 3))
    fin: dict[str, EngineCoreOutput] = {}
    deadline = time.monotonic() + BOUND_S
    while len(fin) < 2:
        batch = peer.recv(max(0.01, deadline - time.monotonic()))
        fin.update((o.request_id, o) for o in batch.outputs if o.finished)
    assert fin["bad"].finish_reason is FinishReason.ERROR
    assert "simulated request-scoped failure" in (fin["bad"].error or "")
    assert fin["ok"].finish_reason is FinishReason.LENGTH
    assert all(t.is_alive() for t in proc._threads)


def test_a_dead_input_thread_is_a_fatal_error(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its input thread the engine hears nothing: the busy loop must end with an
    error (run_engine_core then sends the dead sentinel, so the client raises
    EngineDeadError) instead of running on deaf, every call a UtilityTimeoutError."""
    peer = Peer(tmp_path)
    proc = EngineCoreProc(NULL_CONFIG, input_address=peer.input_address,
                          output_address=peer.output_address)
    failure: list[BaseException] = []

    def loop() -> None:  # run_engine_core's handling of a fatal error, on a thread
        try:
            proc.run_busy_loop()
        except Exception as e:
            failure.append(e)
            proc.send_engine_dead()

    thread = threading.Thread(target=loop, daemon=True)
    try:
        peer.router.recv_multipart()  # the ready handshake
        # Looked up per message by the input thread: its next frame kills it (a BaseException
        # no per-frame handler catches).
        def dies(first: bytes, *_: Any) -> Any:
            raise SystemExit("simulated fatal failure in the input thread")

        monkeypatch.setattr(proc.input, "_serve_plain", dies)
        monkeypatch.setattr(proc.input, "accept", dies)
        thread.start()
        peer.send(RequestType.UTILITY, UtilityRequest(0, 1, "echo", ["boom"]))
        thread.join(10.0)
        assert not thread.is_alive(), "engine kept running without its input thread"
        assert len(failure) == 1 and isinstance(failure[0].__cause__, SystemExit)
        assert peer.pull.poll(int(BOUND_S * 1000))
        assert peer.pull.recv_multipart() == [ENGINE_DEAD_SENTINEL]
    finally:
        if thread.is_alive():
            proc.input_queue.put((Control.SHUTDOWN, None))
            thread.join(BOUND_S)
        proc.close()
        peer.close()
    assert not thread.is_alive()


def test_an_engine_terminated_from_outside_aborts_its_parked_requests_first() -> None:
    """SIGTERM (an orchestrator stopping the engine) with a request still live: the docs say
    a live request always ends with an ABORT output, so the client gets it before it sees
    the engine gone; its owner otherwise never learns the request ended."""
    with open_client("sync", NULL_CONFIG) as cut:
        cut.client.pause_scheduler("keep")
        cut.add_request(request("r", 5))  # parked: the scheduler is paused
        assert cut.client.live_requests() == ["r"]
        # The engine holds it before the signal (a call is answered after the ADD before it):
        # a SIGTERM that overtook the ADD would leave nothing to abort.
        assert cut.client.get_stats(timeout=BOUND_S).num_live == 1
        assert cut.engine_pid is not None
        os.kill(cut.engine_pid, signal.SIGTERM)
        seen: list[tuple[str, FinishReason]] = []
        deadline = time.monotonic() + BOUND_S
        with pytest.raises(EngineDeadError):
            while time.monotonic() < deadline:
                seen += [(o.request_id, FinishReason(o.finish_reason))
                         for o in cut.get_output(timeout=5.0).outputs if o.finished]
        assert seen == [("r", FinishReason.ABORT)]


def test_a_refused_add_with_a_long_request_id_still_ends_with_error() -> None:
    """An ADD the engine's decoder refuses (here over engine_limits.max_prompt_tokens) ends
    with an ERROR output whatever its id's length: a 5000-char id is a valid id, and once
    went unanswered (the salvaged id was dropped over 4096 chars), live forever."""
    from enginewire.testing.conformance import collect

    with open_client("sync", NULL_CONFIG, engine_limits=Limits(max_prompt_tokens=10)) as cut:
        for rid in ("short", "L" * 5000):
            cut.add_request(request(rid, 1, prompt=[5] * 20))
            fin = collect(cut, [rid], timeout=BOUND_S)[rid]
            assert fin.reason is FinishReason.ERROR and fin.tokens == []
            assert "prompt tokens" in (fin.error or "")
        assert cut.client.live_requests() == []


def test_an_engine_no_front_end_reached_closes_without_the_flush_linger(tmp_path: Path) -> None:
    """A standalone engine no front end ever connected to has nothing to flush: its close
    must not wait out the output linger and the context's 2 s bound (it took 2.0 s)."""
    proc = EngineCoreProc(NULL_CONFIG, input_address=f"ipc://{tmp_path}/nobody-in",
                          output_address=f"ipc://{tmp_path}/nobody-out",
                          heartbeat_interval_s=0.05)  # as `enginewire engine` beats
    loop = threading.Thread(target=proc.run_busy_loop, daemon=True)
    loop.start()
    time.sleep(0.5)  # beats queue up for a peer that never comes
    proc.input_queue.put((Control.SHUTDOWN, None))
    loop.join(BOUND_S)
    t0 = time.monotonic()
    proc.close()
    took = time.monotonic() - t0
    assert took < 1.5, f"close took {took:.2f} s with no front end ever connected"
    assert not [t for t in threading.enumerate() if t.name.startswith("EngineCore")]


@pytest.mark.parametrize(("kw", "says"), [
    ({"config": "tiny"}, "expected an EngineConfig"),
    ({"limits": {}}, "limits must be a Limits"),
    ({"curve": "x"}, "curve must be a CurveConfig"),
])
def test_run_engine_core_refuses_wrong_types_by_name(kw: dict[str, Any], says: str,
                                                     tmp_path: Path) -> None:
    # They were bare AttributeErrors from deep inside the start-up.
    args: dict[str, Any] = {"config": NULL_CONFIG, **kw}
    with pytest.raises(TypeError, match=says):
        run_engine_core(args.pop("config"), input_address=f"ipc://{tmp_path}/i",
                        output_address=f"ipc://{tmp_path}/o", raise_startup_errors=True, **args)


def _admitted_on(proc: EngineCoreProc, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """request id -> the name of the thread that admitted it (the busy loop's or the input
    thread's), recorded around EngineCoreProc._add."""
    threads: dict[str, str] = {}
    add = proc._add

    def recording(req: EngineCoreRequest) -> None:
        threads[req.request_id] = threading.current_thread().name
        add(req)

    monkeypatch.setattr(proc, "_add", recording)
    return threads


def test_a_parked_loop_leaves_adds_to_the_input_thread_and_wakes_for_work(
        served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the busy loop is parked (idle, or over a paused scheduler's requests) with
    nothing queued, the input thread admits an ADD itself; the loop is woken when the engine
    can schedule it and not before; nothing is reordered or lost either way."""
    peer, proc, _trace = served
    admitted = _admitted_on(proc, monkeypatch)
    # Idle: admitted (most likely by the input thread) and run at once.
    for i in range(3):
        peer.send(RequestType.ADD, request(f"idle{i}", 3))
        [last] = [o for o in peer.until(_finished(f"idle{i}"))[-1].outputs
                  if o.request_id == f"idle{i}"]
        assert last.finish_reason is FinishReason.LENGTH
    # Paused: admitted, held, and run only after the resume, in order.
    peer.send(RequestType.UTILITY, UtilityRequest(0, 1, "pause_scheduler", ["keep"]))
    peer.until(lambda b: b.utility_output is not None)
    ids = [f"held{i}" for i in range(6)]
    for rid in ids:
        peer.send(RequestType.ADD, request(rid, 3))
        time.sleep(0.02)  # the loop parks between them
    peer.send(RequestType.ABORT, [ids[-1]])  # right behind its ADD: never lost
    wait_until(lambda: ids[-1] not in proc.engine.scheduler.requests, BOUND_S)
    assert len(proc.engine.scheduler.requests) == len(ids) - 1
    assert not peer.pull.poll(200) or all(
        o.request_id == ids[-1] for o in peer.recv().outputs), "a paused engine ran a request"
    peer.send(RequestType.UTILITY, UtilityRequest(0, 2, "resume_scheduler", []))
    fin: dict[str, FinishReason] = {}
    deadline = time.monotonic() + BOUND_S
    while len(fin) < len(ids) - 1:
        batch = peer.recv(max(0.01, deadline - time.monotonic()))
        fin.update((o.request_id, o.finish_reason) for o in batch.outputs
                   if o.finish_reason is not None and o.request_id != ids[-1])
    assert fin == {rid: FinishReason.LENGTH for rid in ids[:-1]}
    assert set(admitted) == {f"idle{i}" for i in range(3)} | set(ids)
    # The loop's lock is free in either wait, so the input thread took (nearly) all.
    assert sum(name == "EngineCoreInputThread" for name in admitted.values()) >= 5, admitted
    assert all(t.is_alive() for t in proc._threads)


def test_an_engine_that_dies_admitting_on_the_input_thread_dies_by_its_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fatal error while the input thread admits for the parked loop is the loop's to
    raise (the engine then dies as it would have in the loop); the input thread lives."""
    peer = Peer(tmp_path)
    proc = EngineCoreProc(CONFIG, input_address=peer.input_address,
                          output_address=peer.output_address)
    try:
        peer.router.recv_multipart()  # the ready
        raised: list[BaseException] = []

        def loop() -> None:
            try:
                proc.run_busy_loop()
            except BaseException as e:
                raised.append(e)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        admitted = _admitted_on(proc, monkeypatch)

        def dying(req: EngineCoreRequest) -> None:
            proc.engine.lifecycle.fire(EngineEvent.FATAL_ERROR)
            raise RuntimeError("simulated death while admitting")

        monkeypatch.setattr(proc.engine, "add_request", dying)
        peer.send(RequestType.ADD, request("fatal", 3))
        thread.join(BOUND_S)
        assert not thread.is_alive()
        assert [str(e) for e in raised] == ["simulated death while admitting"]
        assert admitted == {"fatal": "EngineCoreInputThread"}
        assert all(t.is_alive() for t in proc._threads if t.name == "EngineCoreInputThread")
    finally:
        proc.close()
        peer.close()


def _through_engine(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dict[str, str]]:
    """One script of input through a fresh engine: adds to an idle engine, idle calls (plain
    results and not), adds held by a paused scheduler, an abort right behind its ADD, the
    resume. Returns what the peer saw per request (tokens, finish) and per call (result,
    failure), and which thread admitted each request."""
    peer = Peer(tmp)
    proc = EngineCoreProc(NULL_CONFIG, input_address=peer.input_address,
                          output_address=peer.output_address)
    peer.router.recv_multipart()  # the ready
    admitted = _admitted_on(proc, monkeypatch)
    loop = threading.Thread(target=proc.run_busy_loop, name="BusyLoop", daemon=True)
    loop.start()
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    replies: dict[int, tuple[object, object]] = {}

    def read_until(done: Any) -> None:
        deadline = time.monotonic() + BOUND_S
        while not done():
            batch = peer.recv(max(0.01, deadline - time.monotonic()))
            for o in batch.outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finished[o.request_id] = o.finish_reason
            if (u := batch.utility_output) is not None:
                result = u.result.tolist() if isinstance(u.result, np.ndarray) else u.result
                replies[u.call_id] = (result, u.failure_message)

    try:
        for i in range(3):
            peer.send(RequestType.ADD, request(f"idle{i}", 3))
            read_until(lambda i=i: f"idle{i}" in finished)
        for call_id, value in enumerate([7, "text", [1, [2]], np.arange(4)], 1):
            peer.send(RequestType.UTILITY, UtilityRequest(0, call_id, "echo", [value]))
            read_until(lambda c=call_id: c in replies)
        peer.send(RequestType.UTILITY, UtilityRequest(0, 10, "no_such_method", []))
        peer.send(RequestType.UTILITY, UtilityRequest(0, 11, "pause_scheduler", ["keep"]))
        read_until(lambda: {10, 11} <= set(replies))
        held = [f"held{i}" for i in range(4)]
        for rid in held:
            peer.send(RequestType.ADD, request(rid, 3))
        peer.send(RequestType.ABORT, [held[-1]])
        peer.send(RequestType.UTILITY, UtilityRequest(0, 12, "resume_scheduler", []))
        read_until(lambda: set(held) <= set(finished) and 12 in replies)
    finally:
        proc.input_queue.put((Control.SHUTDOWN, None))
        loop.join(BOUND_S)
        proc.close()
        peer.close()
    assert not loop.is_alive()
    seen = {rid: (toks, finished[rid]) for rid, toks in sorted(tokens.items())}
    return (seen, sorted(replies.items())), admitted


def test_parked_admission_and_idle_calls_match_the_loops_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The differential test of the parked paths (``EngineGate.may_run_parked``): the same
    script with the gate open to the input thread and with it shut (every item through the
    busy loop's queue) gives the same tokens, finishes and replies."""
    from enginewire.runtime._engine_shared import EngineGate

    (tmp_path / "parked").mkdir()
    (tmp_path / "loop").mkdir()
    fast, fast_admitted = _through_engine(tmp_path / "parked", monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(EngineGate, "may_run_parked", lambda self: False)
        general, loop_admitted = _through_engine(tmp_path / "loop", monkeypatch)
    assert fast == general
    seen, replies = fast
    assert seen["held3"] == ([], FinishReason.ABORT)
    assert all(reason is FinishReason.LENGTH and len(toks) == 3
               for rid, (toks, reason) in seen.items() if rid != "held3")
    assert [r for _, r in replies][:4] == [(7, None), ("text", None), ([1, [2]], None),
                                           ([0, 1, 2, 3], None)]
    # Each path was taken: the open gate let the input thread admit, the shut one never did.
    assert "EngineCoreInputThread" in fast_admitted.values()
    assert set(loop_admitted.values()) == {"BusyLoop"}
