"""Several front ends over one standalone engine (spec/session.py, issue 47): each front end
attaches on its own address pair under its own ``client_index``, sees only its own work, and
learns of the others' power changes; one front end's loss ends its work and nobody else's.

The engine runs in a process of its own (``process_main``, as ``enginewire engine`` does);
the front ends are clients in this process, and one of them, for the SIGKILL test, in a
spawned process. Every wait is bounded."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from enginewire import make_client
from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine_proc import process_main
from enginewire.spec.client import ClientState
from enginewire.spec.errors import EngineDeadError, EngineWireError
from enginewire.testing._harness import ResourceSnapshot, assert_released, wait_until

# Slowed steps: a long request (LONG tokens) stays live for the whole of a test.
NULL = EngineConfig(model="null", max_model_len=2048, null_step_delay_s=0.02)
LONG = 2000
BOUND_S = 30.0
FRONT_END_TIMEOUT_S = 1.5  # the engine's deadline on a silent front end
# A killed front end's requests end within its deadline plus the input thread's idle poll.
GONE_BOUND_S = FRONT_END_TIMEOUT_S + 5.0
DEATH_BOUND_S = 5.0  # the dead sentinel on every channel; a launched engine's client: ~1 s


@pytest.fixture(autouse=True, scope="module")
def _resource_tracker() -> None:
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # kept by the first spawn: not a leak


def _pairs(tmp_path: Path, k: int) -> list[tuple[str, str]]:
    return [(f"ipc://{tmp_path}/in{i}", f"ipc://{tmp_path}/out{i}") for i in range(k)]


@contextlib.contextmanager
def standalone_engine(tmp_path: Path, k: int = 2, timeout: float = FRONT_END_TIMEOUT_S,
                      **extra: Any) -> Iterator[
        tuple[multiprocessing.process.BaseProcess, list[tuple[str, str]]]]:
    pairs = _pairs(tmp_path, k)
    mp = multiprocessing.get_context("spawn")
    proc = mp.Process(target=process_main, args=(type(NULL), msgspec.msgpack.encode(NULL), {
        "input_address": [p[0] for p in pairs], "output_address": [p[1] for p in pairs],
        "heartbeat_interval_s": 0.25, "front_end_timeout_s": timeout, **extra}),
        daemon=True)
    proc.start()
    try:
        yield proc, pairs
    finally:
        if proc.is_alive():
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGTERM)
            proc.join(BOUND_S)
        if proc.is_alive():
            proc.kill()
            proc.join(BOUND_S)
        proc.close()


def front_end(pairs: list[tuple[str, str]], index: int, *, pair: int | None = None,
              asyncio: bool = False, **options: Any) -> Any:
    inp, out = pairs[index if pair is None else pair]
    return make_client(NULL, multiprocess=True, asyncio=asyncio, launch_engine=False,
                       input_address=inp, output_address=out, client_index=index,
                       ready_timeout_s=BOUND_S, engine_heartbeat_timeout_s=DEATH_BOUND_S,
                       **options)


def req(rid: str, max_tokens: int = 8) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens))


def collect(client: Any, ids: set[str]) -> dict[str, tuple[list[int], Any]]:
    """Every output of ``ids`` until each finished: tokens and finish reason per id; fails
    on an output for any other id (isolation)."""
    got: dict[str, tuple[list[int], Any]] = {r: ([], None) for r in ids}
    deadline = time.monotonic() + BOUND_S
    while any(reason is None for _, reason in got.values()):
        assert time.monotonic() < deadline, f"unfinished: {got}"
        for o in client.get_output(timeout=BOUND_S).outputs:
            assert o.request_id in got, f"an output for {o.request_id!r}, not this front end's"
            got[o.request_id][0].extend(o.new_token_ids)
            if o.finish_reason is not None:
                got[o.request_id] = (got[o.request_id][0], o.finish_reason)
    return got


def wait_for(pred: Any, bound: float = BOUND_S, what: str = "") -> None:
    """The harness's bounded wait, with this file's default bound."""
    wait_until(pred, bound, what or "the condition", poll=0.02)


def test_two_front_ends_stream_at_once_with_the_same_request_id(tmp_path: Path) -> None:
    before = ResourceSnapshot.take()
    with standalone_engine(tmp_path) as (_, pairs):
        with front_end(pairs, 0) as a, front_end(pairs, 1) as b:
            a.add_request(req("r1", 6))
            b.add_request(req("r1", 9))
            got_a, got_b = collect(a, {"r1"}), collect(b, {"r1"})
            assert len(got_a["r1"][0]) == 6 and got_a["r1"][1].name == "LENGTH"
            assert len(got_b["r1"][0]) == 9 and got_b["r1"][1].name == "LENGTH"
            # Utility replies reach only their caller (call ids overlap across front ends).
            assert a.echo("from a", timeout=BOUND_S) == "from a"
            assert b.echo("from b", timeout=BOUND_S) == "from b"
    assert_released(before, kinds=("processes", "threads"))


def test_two_front_ends_with_frame_integrity(tmp_path: Path) -> None:
    """Each front end's link numbers its own messages (runtime/integrity.py): a shared
    counter made each see the other's messages as lost within a few. Garbage on one front
    end's input fails its check: its session ends, the other serves on."""
    with standalone_engine(tmp_path, integrity=True) as (_, pairs):
        with front_end(pairs, 0, frame_integrity=True) as a, \
                front_end(pairs, 1, frame_integrity=True) as b:
            a.add_request(req("r1", 60))
            b.add_request(req("r1", 60))
            assert len(collect(a, {"r1"})["r1"][0]) == 60
            assert len(collect(b, {"r1"})["r1"][0]) == 60
            assert a.echo(1, timeout=BOUND_S) == 1 and b.echo(2, timeout=BOUND_S) == 2
            b.add_request(req("r2", LONG))
            wait_for(lambda: a.get_stats(timeout=BOUND_S).num_live == 1, what="b's r2 live")
            b.send_raw_frames([b"\x07\x90"])
            with pytest.raises(EngineDeadError):
                b.echo(3, timeout=BOUND_S)
            wait_for(lambda: a.get_stats(timeout=BOUND_S).num_live == 0, what="b's r2 ended")
            assert a.echo(4, timeout=BOUND_S) == 4


def test_an_abort_touches_only_its_own_front_end(tmp_path: Path) -> None:
    with standalone_engine(tmp_path) as (_, pairs):
        with front_end(pairs, 0) as a, front_end(pairs, 1) as b:
            a.add_request(req("r1", LONG))
            b.add_request(req("r1", 40))
            wait_for(lambda: a.get_stats(timeout=BOUND_S).num_live == 2, what="both live")
            a.abort_requests(["r1"])
            assert collect(a, {"r1"})["r1"][1].name == "ABORT"
            got = collect(b, {"r1"})["r1"]
            assert got[1].name == "LENGTH" and len(got[0]) == 40


def test_a_wrong_client_index_is_refused_and_disturbs_nobody(tmp_path: Path) -> None:
    with standalone_engine(tmp_path) as (_, pairs):
        with front_end(pairs, 0) as a:
            a.add_request(req("r1", LONG))
            # Refused by its marker: the client is dead to it, with the reason as the cause.
            wrong = front_end(pairs, 0, pair=1)
            try:
                with pytest.raises(EngineDeadError) as info:
                    wrong.echo(1, timeout=BOUND_S)
                assert "client_index is 0, but it attached on channel 1" in str(
                    info.value.__cause__)
            finally:
                wrong.shutdown()
            assert a.echo(1, timeout=BOUND_S) == 1
            a.abort_requests(["r1"])
            assert collect(a, {"r1"})["r1"][1].name == "ABORT"
            # The right index on the same pair is then served.
            with front_end(pairs, 1) as b:
                assert b.echo(2, timeout=BOUND_S) == 2


def _doomed_front_end(inp: str, out: str, ready: Any) -> None:
    """A front end in a process of its own: starts a long request, says so, waits to die."""
    with make_client(NULL, multiprocess=True, asyncio=False, launch_engine=False,
                     input_address=inp, output_address=out, client_index=1,
                     ready_timeout_s=BOUND_S) as client:
        for i in range(3):
            client.add_request(req(f"r{i}", LONG))
        client.get_output(timeout=BOUND_S)
        ready.set()
        time.sleep(BOUND_S * 4)


@contextlib.contextmanager
def killed_front_end(pairs: list[tuple[str, str]],
                     before_kill: Any = None) -> Iterator[None]:
    """Front end 1 in a process of its own, with three live requests (``before_kill()`` runs
    once they stream), SIGKILLed: its connection drops and its session (ATTACHED) is gone at
    the first sign of loss (the lost connection, or its heartbeat deadline)."""
    mp = multiprocessing.get_context("spawn")
    ready = mp.Event()
    doomed = mp.Process(target=_doomed_front_end, args=(*pairs[1], ready), daemon=True)
    doomed.start()
    try:
        assert ready.wait(BOUND_S)
        if before_kill is not None:
            before_kill()
        doomed.kill()
        doomed.join(BOUND_S)
        yield
    finally:
        if doomed.is_alive():
            doomed.kill()
            doomed.join(BOUND_S)


def test_a_killed_front_end_s_requests_end_and_the_other_streams_on(tmp_path: Path) -> None:
    with standalone_engine(tmp_path) as (_, pairs), front_end(pairs, 0) as a:
        def mine() -> None:
            a.add_request(req("mine", LONG))
            wait_for(lambda: a.get_stats(timeout=BOUND_S).num_live == 4, what="4 live")

        with killed_front_end(pairs, before_kill=mine):
            killed = time.monotonic()
            # Its three end in the engine (aborted, KV freed) within the deadline, while
            # this front end's request streams on throughout.
            seen = 0
            while a.get_stats(timeout=BOUND_S).num_live != 1:
                assert time.monotonic() - killed < GONE_BOUND_S
                for o in a.get_output(timeout=BOUND_S).outputs:
                    assert o.request_id == "mine" and o.finish_reason is None
                    seen += len(o.new_token_ids)
            assert seen > 0
            stats = a.get_stats(timeout=BOUND_S)
            assert stats.num_running == 1 and stats.num_waiting == 0
        # A front end attached again under index 1 sees nothing of its predecessor.
        with front_end(pairs, 1) as again:
            assert again.echo("fresh", timeout=BOUND_S) == "fresh"
            again.add_request(req("r0", 5))
            got = collect(again, {"r0"})["r0"]
            assert got[1].name == "LENGTH" and len(got[0]) == 5
        a.abort_requests(["mine"])
        assert collect(a, {"mine"})["mine"][1].name == "ABORT"


def refused(client: Any, why: str) -> None:
    try:
        with pytest.raises(EngineDeadError) as info:
            client.echo(1, timeout=BOUND_S)
        assert why in str(info.value.__cause__)
    finally:
        client.shutdown()


def test_a_misplaced_successor_keeps_the_lost_session_s_deadline(tmp_path: Path) -> None:
    """ATTACHED --ATTACH_MISPLACED--> ATTACHED: a front end with another index taking a lost
    front end's pair is refused and changes nothing, so the lost one's heartbeat deadline
    still ends its work (a REFUSED channel has no deadline: its work would run on)."""
    with standalone_engine(tmp_path) as (_, pairs), front_end(pairs, 0) as a:
        with killed_front_end(pairs):
            refused(front_end(pairs, 0, pair=1), "client_index is 0, but it attached on channel 1")
            wait_for(lambda: a.get_stats(timeout=BOUND_S).num_live == 0, GONE_BOUND_S,
                     "the killed front end's requests ended at its deadline")
        with front_end(pairs, 1) as b:
            assert b.echo(2, timeout=BOUND_S) == 2


def test_a_refused_successor_ends_the_lost_session_s_work(tmp_path: Path) -> None:
    """ATTACHED --ATTACH_REFUSED--> REFUSED (frame integrity differs) on a lost front end's
    pair: the served session is cut off and REFUSED has no deadline, so its work ends then;
    after the loss (GONE --ATTACH_REFUSED--> REFUSED) a refusal changes nothing more, and
    the right front end is then served (REFUSED --ATTACH_ACCEPTED--> ATTACHED)."""
    def mismatched() -> Any:
        inp, out = pairs[1]
        return make_client(NULL, multiprocess=True, asyncio=False, launch_engine=False,
                           input_address=inp,
                           output_address=out, client_index=1, frame_integrity=True,
                           ready_timeout_s=BOUND_S)

    with standalone_engine(tmp_path) as (_, pairs), front_end(pairs, 0) as a:
        with killed_front_end(pairs):
            refused(mismatched(), "frame integrity is on at this front end")
            wait_for(lambda: a.get_stats(timeout=BOUND_S).num_live == 0, GONE_BOUND_S,
                     "the lost front end's requests ended")
        with front_end(pairs, 1) as b:  # GONE, then lost again: GONE --ATTACH_REFUSED-->
            b.add_request(req("r1", LONG))
            wait_for(lambda: a.get_stats(timeout=BOUND_S).num_live == 1, what="b's live")
        wait_for(lambda: a.get_stats(timeout=BOUND_S).num_live == 0, what="b said goodbye")
        refused(mismatched(), "frame integrity is on at this front end")
        with front_end(pairs, 1) as b:
            assert b.echo(3, timeout=BOUND_S) == 3


def test_a_killed_front_end_s_lost_connection_ends_its_work_before_its_deadline(
        tmp_path: Path) -> None:
    """The connection-loss sign (spec/session.py): a killed front end's socket closes at once,
    so its work ends within CONNECTION_LOSS_S, not at its (here long) heartbeat deadline."""
    from enginewire.runtime._engine_input import CONNECTION_LOSS_S

    deadline = 60.0
    with standalone_engine(tmp_path, timeout=deadline) as (_, pairs), front_end(pairs, 0) as a:
        with killed_front_end(pairs):
            killed = time.monotonic()
            wait_for(lambda: a.get_stats(timeout=BOUND_S).num_live == 0,
                     CONNECTION_LOSS_S + 10.0, "the killed front end's requests ended")
            assert time.monotonic() - killed < deadline / 2
        with front_end(pairs, 1) as b:  # GONE --ATTACH_ACCEPTED--> ATTACHED
            assert b.echo(4, timeout=BOUND_S) == 4


def test_a_front_end_that_shuts_down_ends_its_work_at_once(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Its goodbye ends its work, not a later sign: the engine's log (its stderr, this
    process's fd 2) names the goodbye as the reason, whatever the machine's load."""
    with standalone_engine(tmp_path, timeout=60.0) as (_, pairs):
        with front_end(pairs, 0) as a:
            b = front_end(pairs, 1)
            b.add_request(req("r1", LONG))
            wait_for(lambda: a.get_stats(timeout=BOUND_S).num_live == 1, what="b's live")
            b.shutdown()  # its goodbye: no deadline to wait for
            wait_for(lambda: a.get_stats(timeout=BOUND_S).num_live == 0, what="b's ended")
    err = capfd.readouterr().err
    assert "front end 1 is gone: it said goodbye" in err
    assert "front end 1 is gone: its connection" not in err


def test_a_sleep_from_one_front_end_is_seen_by_the_other(tmp_path: Path) -> None:
    with standalone_engine(tmp_path) as (_, pairs):
        with front_end(pairs, 0) as a, front_end(pairs, 1) as b:
            a.add_request(req("r1", 3))
            collect(a, {"r1"})
            assert b.lifecycle.state is ClientState.READY
            a.sleep(1)
            assert a.lifecycle.state is ClientState.SLEEPING
            wait_for(lambda: b.lifecycle.state is ClientState.SLEEPING, what="b asleep")
            b.wake_up()
            assert b.lifecycle.state is ClientState.RUNNING  # SLEEPING -> RUNNING on a wake
            wait_for(lambda: a.lifecycle.state is ClientState.RUNNING, what="a awake")
            b.pause_scheduler()
            wait_for(lambda: a.lifecycle.state is ClientState.SLEEPING, what="a paused")
            a.resume_scheduler()
            wait_for(lambda: b.lifecycle.state is ClientState.RUNNING, what="b resumed")


def test_a_front_end_attaching_to_a_sleeping_engine_finds_it_asleep(tmp_path: Path) -> None:
    with standalone_engine(tmp_path) as (_, pairs):
        with front_end(pairs, 0) as a:
            a.sleep(1)
            with front_end(pairs, 1) as b:
                wait_for(lambda: b.lifecycle.state is ClientState.SLEEPING, what="b: asleep")
                b.wake_up()
                wait_for(lambda: a.lifecycle.state is ClientState.RUNNING, what="a: awake")


def test_concurrent_sleep_and_wake_from_two_front_ends_terminate(tmp_path: Path) -> None:
    with standalone_engine(tmp_path) as (_, pairs):
        with front_end(pairs, 0) as a, front_end(pairs, 1) as b:
            errors: list[BaseException] = []

            def run(fn: Any) -> None:
                try:
                    for _ in range(10):
                        fn()
                except EngineWireError as e:  # a SpecViolation of the engine's is a reply
                    errors.append(e)

            threads = [threading.Thread(target=run, args=(lambda: a.sleep(1),)),
                       threading.Thread(target=run, args=(lambda: b.wake_up(),))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(BOUND_S)
            assert not any(t.is_alive() for t in threads), "a sleep or wake hung"
            # Both views converge to the engine's, whichever came last.
            sleeping = a.get_stats(timeout=BOUND_S).state.name in ("SLEEPING", "PAUSED")
            for c in (a, b):
                wait_for(lambda c=c: (c.lifecycle.state is ClientState.SLEEPING) == sleeping,
                         what=f"{c} follows the engine")
            assert a.echo("ok", timeout=BOUND_S) == "ok" and b.echo("ok", timeout=BOUND_S)


def test_the_engine_s_death_reaches_every_front_end(tmp_path: Path) -> None:
    with standalone_engine(tmp_path) as (proc, pairs):
        with front_end(pairs, 0) as a, front_end(pairs, 1) as b:
            a.add_request(req("r1", LONG))
            assert b.echo(1, timeout=BOUND_S) == 1
            proc.kill()
            killed = time.monotonic()
            for c in (a, b):
                with pytest.raises(EngineDeadError):
                    while True:
                        c.get_output(timeout=BOUND_S)
            assert time.monotonic() - killed < DEATH_BOUND_S + 2.0


def test_a_stopped_engine_tells_every_front_end(tmp_path: Path) -> None:
    with standalone_engine(tmp_path) as (proc, pairs):
        with front_end(pairs, 0) as a, front_end(pairs, 1) as b:
            assert a.echo(1, timeout=BOUND_S) == 1 and b.echo(1, timeout=BOUND_S) == 1
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGTERM)
            stopped = time.monotonic()
            for c in (a, b):
                wait_for(lambda c=c: c.is_dead, DEATH_BOUND_S, f"{c} sees the stop")
            assert time.monotonic() - stopped < DEATH_BOUND_S


def test_the_engine_refuses_unpaired_addresses() -> None:
    from enginewire.runtime.engine_proc import EngineCoreProc

    with pytest.raises(ValueError, match="one pair per front end"):
        EngineCoreProc(NULL, input_address=["ipc:///tmp/x0", "ipc:///tmp/x1"],
                       output_address=["ipc:///tmp/y0"])
    with pytest.raises(ValueError, match="front_end_timeout_s"):
        EngineCoreProc(NULL, input_address="ipc:///tmp/x0", output_address="ipc:///tmp/y0",
                       front_end_timeout_s=0)


def test_the_vllm_wire_refuses_several_front_ends() -> None:
    """vLLM 0.33's wire has no ATTACH, so no session to scope ids or route replies by: an
    engine speaking it serves one front end, refused before anything is built."""
    from enginewire.runtime.vllm_wire import VllmWireEngineProc

    before = ResourceSnapshot.take()
    for kwargs in ({"input_address": ["ipc:///tmp/x0", "ipc:///tmp/x1"],
                    "output_address": ["ipc:///tmp/y0", "ipc:///tmp/y1"]},
                   {"input_address": "ipc:///tmp/x0", "output_address": "ipc:///tmp/y0",
                    "front_end_timeout_s": 5.0}):
        with pytest.raises(ValueError, match="wire has no sessions: it serves one front end"):
            VllmWireEngineProc(NULL, **kwargs)
    assert_released(before, kinds=("threads", "fds"))


def test_enginewire_engine_serves_one_front_end_per_address_pair(tmp_path: Path) -> None:
    import subprocess
    import sys

    pairs = _pairs(tmp_path, 2)
    argv = [sys.executable, "-m", "enginewire", "engine", "--model", "null"]
    for inp, out in pairs:
        argv += ["--input-address", inp, "--output-address", out]
    unpaired = subprocess.run(argv[:-2], capture_output=True, text=True, timeout=BOUND_S)
    assert unpaired.returncode == 2 and "one pair per front end" in unpaired.stderr
    engine = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        cfg = EngineConfig(model="null")
        clients = [make_client(cfg, multiprocess=True, asyncio=False, launch_engine=False,
                               input_address=inp, output_address=out, client_index=i,
                               ready_timeout_s=BOUND_S) for i, (inp, out) in enumerate(pairs)]
        try:
            for i, c in enumerate(clients):
                assert c.ready_response.front_end_timeout_s == 10.0  # the default with two
                c.add_request(req("r1", 4 + i))
            for i, c in enumerate(clients):
                assert len(collect(c, {"r1"})["r1"][0]) == 4 + i
        finally:
            for c in clients:
                c.shutdown()
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(BOUND_S) == 0
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(BOUND_S)
        assert engine.stderr is not None
        engine.stderr.close()
