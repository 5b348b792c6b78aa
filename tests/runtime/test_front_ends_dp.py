"""Several front ends over a data-parallel group (issue 47): K front ends x N engines, each
engine serving every front end on a pair of its own, each front end an ordinary
data-parallel client attached over its N pairs with its own ``client_index``.

Engine i's channel f is front end f's pair (f, i); front end f's client takes its pairs in
engine order. The engines run in processes of their own (``process_main``, as ``enginewire
engine --engine-index i`` does); the front ends are clients in this process. Every wait is
bounded."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
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
from enginewire.testing._harness import ResourceSnapshot, assert_released, wait_until

N, K = 2, 2  # engines, front ends
NULL = EngineConfig(model="null", max_model_len=2048, null_step_delay_s=0.02,
                    data_parallel_size=N)
LONG = 2000
BOUND_S = 30.0
FRONT_END_TIMEOUT_S = 1.5


@pytest.fixture(autouse=True, scope="module")
def _resource_tracker() -> None:
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # kept by the first spawn: not a leak


def pair(tmp_path: Path, f: int, i: int) -> tuple[str, str]:
    return f"ipc://{tmp_path}/in{f}{i}", f"ipc://{tmp_path}/out{f}{i}"


@contextlib.contextmanager
def engines(tmp_path: Path) -> Iterator[list[multiprocessing.process.BaseProcess]]:
    mp = multiprocessing.get_context("spawn")
    procs = []
    for i in range(N):
        pairs = [pair(tmp_path, f, i) for f in range(K)]
        procs.append(mp.Process(target=process_main, args=(
            type(NULL), msgspec.msgpack.encode(NULL), {
                "input_address": [p[0] for p in pairs],
                "output_address": [p[1] for p in pairs], "engine_index": i,
                "heartbeat_interval_s": 0.25, "front_end_timeout_s": FRONT_END_TIMEOUT_S}),
            daemon=True))
    for p in procs:
        p.start()
    try:
        yield procs
    finally:
        for p in procs:
            if p.is_alive():
                assert p.pid is not None
                os.kill(p.pid, signal.SIGTERM)
                p.join(BOUND_S)
            if p.is_alive():
                p.kill()
                p.join(BOUND_S)
            p.close()


def front_end(tmp_path: Path, f: int) -> Any:
    pairs = [pair(tmp_path, f, i) for i in range(N)]
    return make_client(NULL, multiprocess=True, asyncio=False, launch_engine=False,
                       input_address=[p[0] for p in pairs],
                       output_address=[p[1] for p in pairs], client_index=f,
                       ready_timeout_s=BOUND_S, engine_heartbeat_timeout_s=5.0)


def req(rid: str, max_tokens: int, rank: int | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens),
                             data_parallel_rank=rank)


def collect(client: Any, ids: set[str]) -> dict[str, tuple[int, Any, set[int]]]:
    """Every output of ``ids`` until each finished: token count, finish reason and the
    engines it came from; fails on an output for any other id (isolation)."""
    got: dict[str, tuple[int, Any, set[int]]] = {r: (0, None, set()) for r in ids}
    deadline = time.monotonic() + BOUND_S
    while any(reason is None for _, reason, _ in got.values()):
        assert time.monotonic() < deadline, f"unfinished: {got}"
        batch = client.get_output(timeout=BOUND_S)
        for o in batch.outputs:
            assert o.request_id in got, f"an output for {o.request_id!r}, not this front end's"
            n, reason, where = got[o.request_id]
            got[o.request_id] = (n + len(o.new_token_ids), o.finish_reason or reason,
                                 where | {batch.engine_index})
    return got


def live(client: Any) -> list[int]:
    """Live requests per engine, every front end's (get_stats on each engine)."""
    return [s.num_live for s in client.call_utility_all("get_stats", timeout=BOUND_S)]


def wait_for(pred: Any, bound: float = BOUND_S, what: str = "") -> None:
    wait_until(pred, bound, what or "the condition", poll=0.05)


def test_two_data_parallel_front_ends_share_two_engines(tmp_path: Path) -> None:
    """Same ids at both front ends on both engines; each front end sees only its own
    outputs and replies, and an abort touches only its sender's requests."""
    before = ResourceSnapshot.take()
    with engines(tmp_path), front_end(tmp_path, 0) as a, front_end(tmp_path, 1) as b:
        for i in range(N):
            a.add_request(req(f"r{i}", 5 + i, rank=i))
            b.add_request(req(f"r{i}", 7 + i, rank=i))
        got_a, got_b = collect(a, {"r0", "r1"}), collect(b, {"r0", "r1"})
        for i in range(N):
            assert got_a[f"r{i}"][:1] == (5 + i,) and got_a[f"r{i}"][2] == {i}
            assert got_b[f"r{i}"][:1] == (7 + i,) and got_b[f"r{i}"][2] == {i}
            assert got_a[f"r{i}"][1].name == got_b[f"r{i}"][1].name == "LENGTH"
        assert a.call_utility_all("echo", "a", timeout=BOUND_S) == ["a", "a"]
        assert b.call_utility_all("echo", "b", timeout=BOUND_S) == ["b", "b"]
        # An abort of "x" at a ends a's "x" only; b's "x" streams on.
        a.add_request(req("x", LONG, rank=1))
        b.add_request(req("x", LONG, rank=1))
        wait_for(lambda: live(a) == [0, 2], what="both x live on engine 1")
        a.abort_requests(["x"])
        assert collect(a, {"x"})["x"][1].name == "ABORT"
        wait_for(lambda: live(b) == [0, 1], what="b's x alone")
        b.abort_requests(["x"])
        assert collect(b, {"x"})["x"][1].name == "ABORT"
    assert_released(before, kinds=("processes", "threads"))


def test_a_sleep_from_one_front_end_puts_the_other_s_group_to_sleep(tmp_path: Path) -> None:
    """A data-parallel client follows its members' power notices: front end 0's sleep over
    both engines makes front end 1's client SLEEPING, and front end 1's wake_up brings both
    back (spec/client.py's power rows, fired by the notices)."""
    with engines(tmp_path), front_end(tmp_path, 0) as a, front_end(tmp_path, 1) as b:
        a.sleep(1)
        wait_for(lambda: b.lifecycle.state is ClientState.SLEEPING, what="b: asleep")
        assert a.lifecycle.state is ClientState.SLEEPING
        b.wake_up()
        wait_for(lambda: a.lifecycle.state in (ClientState.READY, ClientState.RUNNING),
                 what="a: awake")
        b.add_request(req("after", 3))
        assert collect(b, {"after"})["after"][1].name == "LENGTH"


def test_a_front_end_s_loss_ends_its_work_on_every_engine_and_nobody_else_s(
        tmp_path: Path) -> None:
    with engines(tmp_path), front_end(tmp_path, 0) as a:
        b = front_end(tmp_path, 1)
        try:
            for i in range(N):
                b.add_request(req(f"b{i}", LONG, rank=i))
            a.add_request(req("mine", LONG, rank=0))
            wait_for(lambda: live(a) == [2, 1], what="b's two and a's one live")
        finally:
            b.shutdown()  # its goodbye to each engine: its work there ends at once
        wait_for(lambda: live(a) == [1, 0], FRONT_END_TIMEOUT_S * 2, "b's requests ended")
        with front_end(tmp_path, 1) as again:  # a new session on both engines
            assert again.call_utility_all("echo", 1, timeout=BOUND_S) == [1, 1]
        a.abort_requests(["mine"])
        assert collect(a, {"mine"})["mine"][1].name == "ABORT"


def test_an_engine_s_death_reaches_every_data_parallel_front_end(tmp_path: Path) -> None:
    with engines(tmp_path) as procs, front_end(tmp_path, 0) as a, front_end(tmp_path, 1) as b:
        procs[1].kill()
        procs[1].join(BOUND_S)
        wait_for(lambda: a.dead_engines == [1] and b.dead_engines == [1], what="both saw it")
        for c in (a, b):
            c.add_request(req("still", 2))
            got = collect(c, {"still"})["still"]
            assert got[1].name == "LENGTH" and got[2] == {0}


def test_an_async_data_parallel_front_end_beside_a_sync_one(tmp_path: Path) -> None:
    """Front end 1 an ``AsyncDPClient``: the same isolation and the same power notices."""
    import asyncio

    pairs = [pair(tmp_path, 1, i) for i in range(N)]

    async def run(a: Any) -> None:
        async with make_client(NULL, multiprocess=True, asyncio=True, launch_engine=False,
                               input_address=[p[0] for p in pairs],
                               output_address=[p[1] for p in pairs], client_index=1,
                               ready_timeout_s=BOUND_S) as b:
            a.add_request(req("r", 4, rank=1))
            await b.add_request_async(req("r", 6, rank=1))
            tokens, reason = 0, None
            while reason is None:
                for o in (await b.get_output_async(timeout=BOUND_S)).outputs:
                    assert o.request_id == "r"
                    tokens, reason = tokens + len(o.new_token_ids), o.finish_reason
            assert (tokens, reason.name) == (6, "LENGTH")
            assert collect(a, {"r"})["r"][:2] == (4, reason)
            await asyncio.to_thread(a.sleep, 1)
            deadline = time.monotonic() + BOUND_S
            while b.lifecycle.state is not ClientState.SLEEPING:
                assert time.monotonic() < deadline, "b never saw the sleep"
                await asyncio.sleep(0.05)
            await b.call_utility_all_async("wake_up", timeout=BOUND_S)
            wait_for(lambda: a.lifecycle.state in (ClientState.READY, ClientState.RUNNING),
                     what="a: awake")

    with engines(tmp_path), front_end(tmp_path, 0) as a:
        asyncio.run(run(a))
