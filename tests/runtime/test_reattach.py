"""An engine started on its own serves one front end after another (protocol "Attaching").

A new front end attaches under a fresh session: whatever the previous one left (live and
parked requests, a pending sleep, queued outputs, an engine asleep) is dropped or undone
before the attach marker, and nothing of it reaches the new front end.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from enginewire import make_client
from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine import EngineCore
from enginewire.runtime.engine_proc import process_main
from enginewire.runtime.model import TinyRandomSource, dense_greedy
from enginewire.spec import ENGINE, EngineState, UtilityError, validate_trace

torch.set_num_threads(1)

TINY = EngineConfig(model="tiny", device="cpu", max_model_len=64, block_size=4,
                    kv_cache_memory_bytes=1 << 20)
# Slow enough that a long request is still running when its front end goes.
SLOW_NULL = EngineConfig(model="null", device="cpu", null_step_delay_s=0.01)
BOUND_S = 30.0


def req(rid: str, prompt: list[int], n: int) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))


# -- the engine core: start_session from every state ------------------------------------------


def _idle(eng: EngineCore) -> None:
    pass


def _running(eng: EngineCore) -> None:
    eng.add_request(req("a", [1, 2, 3], 20))
    eng.step()


def _paused_keep(eng: EngineCore) -> None:
    _running(eng)
    eng.pause_scheduler("keep")


def _draining(eng: EngineCore) -> Future[Any]:
    _running(eng)
    fut = eng.sleep(1, "wait")
    assert isinstance(fut, Future)
    return fut


def _asleep(level: int) -> Any:
    def setup(eng: EngineCore) -> None:
        _running(eng)
        eng.sleep(level, "keep")
    return setup


@pytest.mark.parametrize("setup, state, live", [
    (_idle, EngineState.IDLE, 0),
    (_running, EngineState.RUNNING, 1),
    (_paused_keep, EngineState.PAUSED, 1),
    (_draining, EngineState.DRAINING, 1),
    (_asleep(1), EngineState.SLEEPING, 1),
    (_asleep(2), EngineState.SLEEPING, 1),
], ids=["idle", "running", "paused", "draining", "sleep1", "sleep2"])
def test_start_session_leaves_the_engine_as_after_start_up(
        setup: Any, state: EngineState, live: int) -> None:
    trace: list[Any] = []
    eng = EngineCore(TINY, trace=trace)
    arch, params = TinyRandomSource(seed=0).load()
    deferred = setup(eng)
    assert eng.lifecycle.state is state
    assert eng.start_session() == live
    assert eng.lifecycle.state is EngineState.IDLE
    assert not eng.is_sleeping() and not eng.executor.sleeping  # type: ignore[union-attr]
    assert eng.num_live_requests() == 0 and not eng.has_pending_outputs()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks  # no block kept by a dropped request
    if deferred is not None:
        with pytest.raises(UtilityError, match="front end was replaced"):
            deferred.result(0)
    # Serves the new front end as a fresh engine would, same tokens.
    eng.add_request(req("b", [9, 8, 7], 5))
    toks: list[int] = []
    for _ in range(100):
        toks += [t for o in eng.step().outputs for t in o.new_token_ids]
        if not eng.has_unfinished_requests():
            break
    assert toks == dense_greedy(arch, params, [9, 8, 7], 5)
    validate_trace(ENGINE, trace)


# -- an engine process, front end after front end ---------------------------------------------


@contextmanager
def standalone_engine(tmp: Path, config: EngineConfig = SLOW_NULL,
                      **kwargs: Any) -> Iterator[tuple[str, str, Any]]:
    """An engine process that outlives its front ends (what ``enginewire engine`` runs)."""
    inp, out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    mp = multiprocessing.get_context("spawn")
    proc = mp.Process(target=process_main, args=(type(config), msgspec.msgpack.encode(config),
                      {"input_address": inp, "output_address": out,
                       "heartbeat_interval_s": 0.1, **kwargs}), daemon=True)
    proc.start()
    try:
        yield inp, out, proc
        assert proc.is_alive(), "the engine did not survive its front ends"
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(BOUND_S)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(BOUND_S)


def front_end(inp: str, out: str, config: EngineConfig = SLOW_NULL, *, asyncio: bool = False,
              **options: Any) -> Any:
    return make_client(config, multiprocess=True, asyncio=asyncio, launch_engine=False,
                       input_address=inp, output_address=out, engine_heartbeat_timeout_s=5.0,
                       ready_timeout_s=BOUND_S, **options)


def collect(client: Any, rid: str) -> tuple[list[int], set[str]]:
    """``rid``'s tokens, and every request id seen on the way."""
    toks: list[int] = []
    seen: set[str] = set()
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        for o in client.get_output(timeout=1.0).outputs:
            seen.add(o.request_id)
            if o.request_id == rid:
                toks += o.new_token_ids
                if o.finished:
                    return toks, seen
    raise AssertionError(f"{rid} did not finish")


async def collect_async(client: Any, rid: str) -> tuple[list[int], set[str]]:
    """``collect`` for an async client."""
    toks: list[int] = []
    seen: set[str] = set()
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        for o in (await client.get_output_async(timeout=1.0)).outputs:
            seen.add(o.request_id)
            if o.request_id == rid:
                toks += o.new_token_ids
                if o.finished:
                    return toks, seen
    raise AssertionError(f"{rid} did not finish")


def leave_work_behind(client: Any) -> None:
    """Requests running and parked, a sleep pending on them, outputs unread."""
    client.add_request(req("old-run", [1, 2], 10_000))
    client.add_request(req("old-more", [3, 4], 10_000))
    assert collect_some(client, "old-run")


def collect_some(client: Any, rid: str) -> bool:
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if any(o.request_id == rid for o in client.get_output(timeout=1.0).outputs):
            return True
    return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("integrity", [False, True], ids=["plain", "integrity"])
def test_front_ends_take_turns_on_one_engine(tmp_path: Path, integrity: bool) -> None:
    with standalone_engine(tmp_path, integrity=integrity) as (inp, out, _):
        a = front_end(inp, out, frame_integrity=integrity)
        leave_work_behind(a)
        a.shutdown()  # leaves its requests on the engine, and their outputs on the way

        b = front_end(inp, out, frame_integrity=integrity)
        with b:
            # The engine is as after start-up: awake, nothing of a's running.
            assert b.is_sleeping(timeout=BOUND_S) is False
            assert b.get_stats(timeout=BOUND_S).num_live == 0
            b.add_request(req("new", [5, 6, 7], 8))
            toks, seen = collect(b, "new")
            assert len(toks) == 8 and seen == {"new"}
            # b leaves the engine asleep with work parked; the next one finds it awake.
            b.add_request(req("parked", [1], 10_000))
            assert collect_some(b, "parked")
            b.sleep(1, "keep", timeout=BOUND_S)

        c = front_end(inp, out, frame_integrity=integrity)
        with c:
            assert c.is_sleeping(timeout=BOUND_S) is False
            c.add_request(req("last", [2, 3], 4))
            toks, seen = collect(c, "last")
            assert len(toks) == 4 and seen == {"last"}
            assert c.call_utility("echo", "ping", timeout=BOUND_S) == "ping"


@pytest.mark.timeout(120)
def test_a_pending_sleep_of_the_previous_front_end_is_ended(tmp_path: Path) -> None:
    """a's sleep(wait) still drains when a goes: the next front end finds the engine awake
    and scheduling, and an async front end attaches the same way."""
    with standalone_engine(tmp_path) as (inp, out, _):
        a = front_end(inp, out)
        leave_work_behind(a)
        with pytest.raises(Exception):  # noqa: B017 - any timeout error: the wait goes on
            a.sleep(1, "wait", timeout=0.2)
        a.shutdown()

        async def use_b() -> tuple[list[int], bool]:
            b = front_end(inp, out, asyncio=True)
            async with b:
                asleep = await b.is_sleeping_async(timeout=BOUND_S)
                await b.add_request_async(req("b", [4, 5], 6))
                toks, seen = await collect_async(b, "b")
                assert seen == {"b"}
                return toks, asleep

        import asyncio
        toks, asleep = asyncio.run(use_b())
        assert len(toks) == 6 and asleep is False


@pytest.mark.timeout(120)
def test_a_killed_front_end_is_replaced(tmp_path: Path) -> None:
    """A front end that dies without a word (SIGKILL) leaves its requests running; the next
    one attaches, and the engine stops spending steps on them."""
    with standalone_engine(tmp_path) as (inp, out, _):
        _kill_front_end_when_ready(_front_end_that_hangs, inp, out)
        with front_end(inp, out) as b:
            assert b.get_stats(timeout=BOUND_S).num_live == 0
            b.add_request(req("after", [1], 3))
            toks, seen = collect(b, "after")
            assert len(toks) == 3 and seen == {"after"}


def _kill_front_end_when_ready(target: Any, inp: str, out: str) -> None:
    """Run the front end ``target(inp, out, ready)`` in a spawned child and SIGKILL it once it
    sets ``ready`` (a front end that vanishes mid-work, without a word to the engine)."""
    mp = multiprocessing.get_context("spawn")
    ready = mp.Event()
    child = mp.Process(target=target, args=(inp, out, ready), daemon=True)
    child.start()
    try:
        assert ready.wait(BOUND_S)
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(BOUND_S)
    finally:
        if child.is_alive():
            child.kill()


def _front_end_that_hangs(inp: str, out: str, ready: Any) -> None:
    client = front_end(inp, out)
    leave_work_behind(client)
    ready.set()
    time.sleep(BOUND_S)


@pytest.mark.timeout(120)
def test_a_front_end_waiting_at_the_same_ipc_paths_takes_over(tmp_path: Path) -> None:
    """A handover over ipc: b binds a's paths while a still serves (the engine stays with
    a); a's shutdown leaves b's socket files alone, so the engine comes to b."""
    import threading

    with standalone_engine(tmp_path) as (inp, out, _):
        a = front_end(inp, out)
        leave_work_behind(a)
        # b has bound once the paths are sockets other than a's.
        paths = [p.removeprefix("ipc://") for p in (inp, out)]

        def file_id(path: str) -> tuple[int, int] | None:
            try:
                st = os.lstat(path)
            except FileNotFoundError:  # between libzmq's unlink and bind
                return None
            return st.st_ino, st.st_ctime_ns  # an inode number is soon reused

        mine = [file_id(p) for p in paths]
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(front_end(inp, out)))
        t.start()
        deadline = time.monotonic() + BOUND_S
        while any(file_id(p) in (ours, None) for p, ours in zip(paths, mine, strict=True)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert a.call_utility("echo", "still a", timeout=BOUND_S) == "still a"
        a.shutdown()
        t.join(BOUND_S)
        (b,) = got
        with b:
            b.add_request(req("b", [1, 2], 3))
            toks, seen = collect(b, "b")
            assert len(toks) == 3 and seen == {"b"}


def test_an_unanswered_attach_is_engine_death_not_a_silent_drop(tmp_path: Path) -> None:
    """An engine that keeps talking but never sends this front end's marker (its ATTACH was
    lost, or the engine ignores it) would have every output dropped for good: once the ready
    deadline has passed since the ATTACH, the next message declares the engine dead."""
    import zmq

    from enginewire import EngineDeadError, ProtocolError
    from enginewire.protocol.codec import Encoder
    from enginewire.protocol.messages import PROTOCOL_VERSION, EngineCoreOutputs, ReadyResponse

    inp, out = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    ctx = zmq.Context()
    dealer, push = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
    try:
        dealer.setsockopt(zmq.IDENTITY, (0).to_bytes(2, "little"))
        dealer.connect(inp)
        push.connect(out)
        dealer.send(msgspec.msgpack.encode(
            ReadyResponse(PROTOCOL_VERSION, 0, 64, 16, 128, "fake", "cpu")))
        client = make_client(SLOW_NULL, multiprocess=True, asyncio=False, launch_engine=False,
                             input_address=inp, output_address=out, ready_timeout_s=0.5)
        with client:
            assert dealer.poll(int(BOUND_S * 1000))
            assert dealer.recv()[:1] == b"\x04"  # the ATTACH, left unanswered
            beat = Encoder().encode(EngineCoreOutputs(timestamp=1.0))
            push.send_multipart(beat)  # within the deadline: dropped, nothing else
            assert client.get_output(timeout=0.2).outputs == []
            deadline = time.monotonic() + BOUND_S
            with pytest.raises(EngineDeadError) as info:
                while time.monotonic() < deadline:
                    push.send_multipart(beat)
                    client.get_output(timeout=0.2)
            assert isinstance(info.value.__cause__, ProtocolError)
            assert "no attach marker" in str(info.value.__cause__)
    finally:
        dealer.close(0)
        push.close(0)
        ctx.term()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine_integrity", [True, False], ids=["engine-seals", "engine-plain"])
def test_a_front_end_with_the_other_integrity_setting_is_refused_not_fatal(
        tmp_path: Path, engine_integrity: bool) -> None:
    """A deploy typo (frame integrity on one side only) used to kill an --integrity engine at
    the front end's first message, for every front end after it. The engine now refuses that
    front end at its ATTACH, says why, and serves the next one."""
    from enginewire import EngineDeadError, EngineStartupError, ProtocolError

    with standalone_engine(tmp_path, integrity=engine_integrity) as (inp, out, proc):
        # The refusal answers the ATTACH: it lands during construction or, when the marker
        # wait is already over, as the engine's death at the next call; typed either way.
        with pytest.raises((EngineDeadError, EngineStartupError)) as info:
            wrong = front_end(inp, out, frame_integrity=not engine_integrity)
            with wrong:
                wrong.add_request(req("w", [1], 3))
                deadline = time.monotonic() + BOUND_S
                while time.monotonic() < deadline:
                    wrong.get_output(timeout=1.0)
        cause = info.value.__cause__
        assert isinstance(cause, ProtocolError) and "refused this front end" in str(cause)
        assert "frame integrity" in str(cause)
        assert proc.is_alive()
        with front_end(inp, out, frame_integrity=engine_integrity) as right:
            right.add_request(req("r", [2, 3], 4))
            toks, seen = collect(right, "r")
            assert len(toks) == 4 and seen == {"r"}


@pytest.mark.timeout(60)
def test_a_front_end_expecting_another_engine_index_is_told_so(tmp_path: Path) -> None:
    """An engine answered, under another index: the start-up error says which, instead of
    blaming slow weight loading."""
    from enginewire import EngineStartupError

    with standalone_engine(tmp_path) as (inp, out, _):
        with pytest.raises(EngineStartupError, match=r"engine_index \[0\].*expects 1"):
            make_client(SLOW_NULL, multiprocess=True, asyncio=False, launch_engine=False,
                        input_address=inp, output_address=out, engine_index=1,
                        ready_timeout_s=4.0)  # 1.5 s lost the race at load 4
        with front_end(inp, out) as c:  # the engine serves the right one after it
            assert c.call_utility("echo", "ok", timeout=BOUND_S) == "ok"


# -- attaching: the ready goes out at the handshake -------------------------------------------


def _own_fds() -> int:
    # Collect first: an fd held by an earlier test's garbage may close during this one, so a
    # leak is more fds than before, never merely a different count.
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(120)
def test_the_ready_goes_out_at_a_new_front_ends_handshake(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A front end bound after the first one left gets the ready when its connection
    completes its handshake, not at the engine's next idle wake-up (an hour here, so a ready
    that waits for it never comes); the engine's wake-up pipe closes with it."""
    import threading

    import zmq

    from enginewire.protocol.codec import decode_ready
    from enginewire.runtime import _engine_input, engine_proc

    monkeypatch.setattr(_engine_input, "IDLE_WAKE_S", 3600.0)  # the input thread's idle poll
    inp, out = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    fds, threads = _own_fds(), set(threading.enumerate())

    def bind_front_end() -> tuple[zmq.Context[Any], zmq.Socket[Any]]:
        # A context each: its term() returns once the ipc files are unlinked, so the next
        # front end's bind cannot lose its file to this one's late unlink.
        ctx: zmq.Context[Any] = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # as a front end: the engine reconnects
        router.bind(inp)
        ctx.socket(zmq.PULL).bind(out)
        return ctx, router

    ctx, router = bind_front_end()
    proc = engine_proc.EngineCoreProc(SLOW_NULL, input_address=inp, output_address=out)
    try:
        for turn in range(4):  # the start-up ready, then three front ends in turn
            assert router.poll(int(BOUND_S * 1000)), f"no ready for front end {turn}"
            _identity, *frames = router.recv_multipart()
            assert decode_ready(frames).engine_index == 0
            ctx.destroy(linger=0)
            ctx, router = bind_front_end()
    finally:
        proc.close()
        ctx.destroy(linger=0)
    assert _own_fds() <= fds
    assert set(threading.enumerate()) <= threads


def _engine_fds_threads(proc: Any) -> tuple[int, int]:
    import psutil

    p = psutil.Process(proc.pid)
    return p.num_fds(), p.num_threads()


@pytest.mark.timeout(120)
def test_front_ends_in_turn_leave_the_engine_flat_and_idle(tmp_path: Path) -> None:
    """Each front end attaches and is served, whether it comes at once or late (once the
    engine has given libzmq's own reconnect its grace: mending the link by hand then used to
    leave two connections to the next front end, over which outputs were split); the engine
    comes back to the fds and threads it held for the first one (a replaced connection
    closes a moment after the attach), and an idle engine does not spin (its input thread
    waits in a poll between a receive and the next front end)."""
    import psutil

    from enginewire.runtime.engine_proc import DROP_GRACE_S, IDLE_WAKE_S

    with standalone_engine(tmp_path) as (inp, out, proc):
        first: tuple[int, int] | None = None
        for turn in range(4):
            if turn == 2:
                time.sleep(IDLE_WAKE_S + DROP_GRACE_S + 0.5)  # this one comes late
            with front_end(inp, out) as c:
                assert c.call_utility("echo", turn, timeout=BOUND_S) == turn
                if first is None:
                    first = _engine_fds_threads(proc)
                    # A measurement window, not a wait: an idle engine with a 0.1 s heartbeat
                    # uses a few ms of CPU in it; a spinning thread would use most of it.
                    cpu = psutil.Process(proc.pid).cpu_times()
                    time.sleep(2.0)
                    after = psutil.Process(proc.pid).cpu_times()
                    busy = after.user + after.system - cpu.user - cpu.system
                    assert busy < 0.5, f"the idle engine used {busy:.2f} s of CPU in 2 s"
                deadline = time.monotonic() + BOUND_S
                while (now := _engine_fds_threads(proc)) != first:
                    assert time.monotonic() < deadline, f"turn {turn}: {now}, first {first}"
                    time.sleep(0.05)


# Over pyzmq's copy_threshold (64 KiB): the reply frame goes zero-copy.
BIG_ECHO = "x" * (100 << 10)


def _front_end_killed_mid_calls(inp: str, out: str, ready: Any) -> None:
    """An --integrity front end with work running and big echo calls in flight."""
    import threading

    client = front_end(inp, out, frame_integrity=True)
    leave_work_behind(client)

    def call() -> None:
        while True:
            client.call_utility("echo", BIG_ECHO, timeout=BOUND_S)

    assert client.call_utility("echo", BIG_ECHO, timeout=BOUND_S) == BIG_ECHO
    threading.Thread(target=call, daemon=True).start()
    ready.set()
    time.sleep(BOUND_S)


@pytest.mark.timeout(180)
def test_front_ends_killed_mid_call_leave_an_integrity_engine_flat(tmp_path: Path) -> None:
    """An audit saw an --integrity engine grow by 7 fds and 3 threads at the first front end
    SIGKILLed in the middle of a utility call, and never again. That growth is pyzmq's
    zero-copy garbage collector (a thread with its own context: ZMQbg/Reaper, ZMQbg/IO/0;
    5 eventfds, 2 epolls), started once per process by the engine's first frame over
    copy_threshold, here a big reply (an idle engine without integrity answers on its plain
    path, which copies). Every kill after the first leaves the engine where the first left
    it: nothing is kept per front end, killed or not."""
    with standalone_engine(tmp_path, integrity=True) as (inp, out, proc):
        first: tuple[int, int] | None = None
        for turn in range(3):
            _kill_front_end_when_ready(_front_end_killed_mid_calls, inp, out)
            with front_end(inp, out, frame_integrity=True) as c:
                assert c.call_utility("echo", turn, timeout=BOUND_S) == turn
                if first is None:
                    first = _engine_fds_threads(proc)
                deadline = time.monotonic() + BOUND_S
                while (now := _engine_fds_threads(proc)) != first:
                    assert time.monotonic() < deadline, f"turn {turn}: {now}, first {first}"
                    time.sleep(0.05)


# -- a broken link ends the session, not the engine -------------------------------------------


def break_next_input(client: Any, how: str) -> None:
    """The link loses or corrupts this front end's next message to the engine: the message
    is sealed as the client would (its seq used up), then lost on the way ("drop": the
    engine sees the gap at the next message) or sent with one payload bit flipped."""
    from enginewire.protocol.codec import Encoder, encode_input
    from enginewire.protocol.messages import RequestType

    frames = [bytes(f) for f in encode_input(Encoder(), RequestType.ABORT, ["nothing"])]
    trailer = client._integrity.seal(frames)
    if how == "bitflip":
        frames[0] = frames[0][:-1] + bytes([frames[0][-1] ^ 0x01])
        client.send_raw_frames([*frames, trailer])


def assert_session_ended(error: BaseException, how: str) -> None:
    from enginewire import EngineDeadError, ProtocolError

    assert isinstance(error, EngineDeadError), repr(error)
    cause = error.__cause__
    assert isinstance(cause, ProtocolError), repr(cause)
    assert "ended this session" in str(cause) and "integrity check" in str(cause)
    assert ("checksum" if how == "bitflip" else "lost") in str(cause)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["bitflip", "drop"])
def test_a_broken_link_ends_the_session_not_the_engine(tmp_path: Path, how: str) -> None:
    """A front end whose input fails the integrity check used to kill an --integrity engine
    for every front end after it. The engine now ends that session: the front end's pending
    call and get_output fail with EngineDeadError (the cause says why), and the next front
    end attaches to the same process and is served, with nothing of the first one left."""
    from enginewire import EngineDeadError

    with standalone_engine(tmp_path, integrity=True) as (inp, out, proc):
        pid = proc.pid
        a = front_end(inp, out, frame_integrity=True)
        with a:
            leave_work_behind(a)
            break_next_input(a, how)
            # Pending when the engine ends the session (or refused once it has): never hangs.
            with pytest.raises(EngineDeadError) as info:
                a.call_utility("echo", "lost?", timeout=BOUND_S)
            assert_session_ended(info.value, how)
            with pytest.raises(EngineDeadError):
                deadline = time.monotonic() + BOUND_S
                while time.monotonic() < deadline:
                    a.get_output(timeout=1.0)
        assert proc.is_alive() and proc.pid == pid

        with front_end(inp, out, frame_integrity=True) as b:
            assert b.get_stats(timeout=BOUND_S).num_live == 0
            b.add_request(req("next", [5, 6, 7], 6))
            toks, seen = collect(b, "next")
            assert len(toks) == 6 and seen == {"next"}
        assert proc.is_alive() and proc.pid == pid


@pytest.mark.timeout(120)
def test_an_async_front_end_with_a_broken_link_ends_only_its_session(tmp_path: Path) -> None:
    """The same with async front ends: the pending call and get_output_async fail, the next
    async front end is served by the same engine process."""
    import asyncio

    from enginewire import EngineDeadError

    async def broken(inp: str, out: str) -> None:
        a = front_end(inp, out, asyncio=True, frame_integrity=True)
        async with a:
            await a.add_request_async(req("old", [1, 2], 10_000))
            await a.get_output_async(timeout=BOUND_S)
            call = asyncio.ensure_future(a.call_utility_async("sleep", 1, "wait",
                                                              timeout=BOUND_S))
            assert await a.call_utility_async("echo", 1, timeout=BOUND_S) == 1
            break_next_input(a, "bitflip")
            with pytest.raises(EngineDeadError) as info:
                await call  # sent before the break, deferred by the engine: fails now
            assert_session_ended(info.value, "bitflip")
            with pytest.raises(EngineDeadError):
                while True:
                    await a.get_output_async(timeout=BOUND_S)

    async def served(inp: str, out: str) -> list[int]:
        b = front_end(inp, out, asyncio=True, frame_integrity=True)
        async with b:
            assert await b.is_sleeping_async(timeout=BOUND_S) is False
            await b.add_request_async(req("b", [4, 5], 5))
            toks, seen = await collect_async(b, "b")
            assert seen == {"b"}
            return toks

    with standalone_engine(tmp_path, integrity=True) as (inp, out, proc):
        pid = proc.pid
        asyncio.run(broken(inp, out))
        assert proc.is_alive() and proc.pid == pid
        assert len(asyncio.run(served(inp, out))) == 5


@pytest.mark.timeout(120)
def test_a_launched_engine_whose_link_breaks_is_dead_to_its_client_and_reaped() -> None:
    """The client's own engine ends the session the same way; to the client it is dead
    (EngineDeadError), and shutdown() stops and reaps the process it launched."""
    import psutil

    from enginewire import EngineDeadError

    client = make_client(SLOW_NULL, multiprocess=True, asyncio=False, frame_integrity=True,
                         ready_timeout_s=BOUND_S)
    pid = client.engine_pid
    try:
        client.add_request(req("r", [1, 2], 10_000))
        assert collect_some(client, "r")
        break_next_input(client, "drop")
        with pytest.raises(EngineDeadError) as info:
            client.call_utility("echo", 1, timeout=BOUND_S)
        assert_session_ended(info.value, "drop")
        assert psutil.pid_exists(pid)  # alive: it ended the session, not itself
    finally:
        client.shutdown()
    assert not psutil.pid_exists(pid)  # reaped (this process is its parent: no zombie)
