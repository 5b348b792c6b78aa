"""The data-parallel client (runtime/dp_client.py): one client over two engine cores.

Routing by load, aborts to the owner, broadcast utilities, and the loss of one engine: its
requests end with ERROR, its calls raise EngineDeadError naming it, the other engine serves
on, and only the loss of both is the client's death. Each on the sync and the async client.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from enginewire.protocol.messages import EngineCoreRequest, FinishReason, SamplingParams
from enginewire.runtime import make_client
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.dp_client import AsyncDPClient, SyncDPClient
from enginewire.runtime.faults import Fault
from enginewire.spec import (
    CLIENT,
    CLIENT_REQUEST,
    MEMBERSHIP,
    UTILITY,
    ClientState,
    EngineDeadError,
    EngineStartupError,
    MembershipState,
    SpecViolation,
    validate_trace,
)
from enginewire.testing._harness import ResourceSnapshot, assert_released

BOUND_S = 30.0
DP2 = EngineConfig(model="null", data_parallel_size=2, max_num_seqs=16, null_step_delay_s=0.005)
KINDS = ("sync", "async")


def req(rid: str, n: int = 4, rank: int | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=n),
                             data_parallel_rank=rank)


class Driver:
    """One blocking surface over the sync client or the async one (on a loop thread)."""

    def __init__(self, kind: str, config: EngineConfig = DP2, **options: Any) -> None:
        self.trace: list[Any] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        if kind == "async":
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self._thread.start()
        self.client: Any = make_client(config, multiprocess=True, asyncio=kind == "async",
                                       trace=self.trace, **options)

    def __call__(self, name: str, *args: Any, **kw: Any) -> Any:
        if self.loop is None:
            return getattr(self.client, name)(*args, **kw)
        coro = getattr(self.client, f"{name}_async")(*args, **kw)
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(BOUND_S * 2)

    def collect(self, rids: set[str], bound: float = BOUND_S) -> dict[str, tuple[Any, int]]:
        """Until every id finished: its finish reason and the engine that sent it."""
        done: dict[str, tuple[Any, int]] = {}
        deadline = time.monotonic() + bound
        while set(done) < rids:
            assert time.monotonic() < deadline, f"unfinished: {rids - set(done)}"
            out = self("get_output", timeout=1.0)
            for o in out.outputs:
                if o.finish_reason is not None:
                    done[o.request_id] = (o.finish_reason, out.engine_index)
        return done

    def close(self) -> None:
        self.client.shutdown()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
            self.loop.close()




@pytest.fixture(autouse=True, scope="module")
def _resource_tracker() -> None:
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # started by the first spawn and kept: not a leak


@contextlib.contextmanager
def open_dp(kind: str, **options: Any) -> Iterator[Driver]:
    """A driver whose close leaves no process, fd or thread behind, and a valid trace."""
    before = ResourceSnapshot.take()
    d = Driver(kind, **options)
    try:
        yield d
    finally:
        d.close()
        for machine in (CLIENT, CLIENT_REQUEST, UTILITY, MEMBERSHIP):
            validate_trace(machine, d.trace)
        assert any(name == MEMBERSHIP.name for name, *_ in d.trace)
    assert_released(before, "after the data-parallel client closed", bound=10,
                    kinds=("processes", "threads", "fds"))


@pytest.fixture(params=KINDS)
def dp(request: pytest.FixtureRequest) -> Iterator[Driver]:
    with open_dp(request.param) as d:
        yield d


def test_config_and_factory_refuse_what_cannot_work() -> None:
    for bad in (0, -1, 1.5, True, "2", 10_000):
        with pytest.raises(ValueError, match="data_parallel_size"):
            EngineConfig(data_parallel_size=bad)
    with pytest.raises(ValueError, match="data_parallel_backend"):
        EngineConfig(data_parallel_backend="slurm")
    with pytest.raises(ValueError, match="multiprocess=True"):
        make_client(DP2, multiprocess=False, asyncio=False)
    for option in ("input_address", "engine_index", "engine_launcher"):
        with pytest.raises(ValueError, match=option):
            make_client(DP2, multiprocess=True, asyncio=False, **{option: 1})
    with pytest.raises(ValueError, match="engine_fault"):
        make_client(DP2, multiprocess=True, asyncio=False, engine_fault={-1: "forward:1"})
    with pytest.raises(ValueError, match="restart_dead_engines"):
        make_client(DP2, multiprocess=True, asyncio=False, restart_dead_engines="yes")


def test_idle_engines_fill_evenly_and_outputs_name_their_engine(dp: Driver) -> None:
    assert isinstance(dp.client, SyncDPClient | AsyncDPClient)
    assert dp.client.engines == {0: MembershipState.SERVING, 1: MembershipState.SERVING}
    rids = {f"even-{i}" for i in range(8)}
    for rid in sorted(rids):
        dp("add_request", req(rid))
    done = dp.collect(rids)
    assert Counter(engine for _, engine in done.values()) == {0: 4, 1: 4}
    assert all(reason is FinishReason.LENGTH for reason, _ in done.values())
    for i in range(3):
        dp("add_request", req(f"pin-{i}", rank=1))
    assert {e for _, e in dp.collect({f"pin-{i}" for i in range(3)}).values()} == {1}
    with pytest.raises(ValueError, match="data_parallel_rank"):
        dp("add_request", req("bad-rank", rank=2))
    assert "bad-rank" not in dp.client.live_requests()


def test_load_sends_new_requests_to_the_idle_engine(dp: Driver) -> None:
    # Engine 0 holds long requests; the next ones go to engine 1 while it is busy.
    for i in range(4):
        dp("add_request", req(f"long-{i}", n=200, rank=0))
    for i in range(4):
        dp("add_request", req(f"short-{i}"))
    done = dp.collect({f"short-{i}" for i in range(4)})
    assert {e for _, e in done.values()} == {1}
    dp("abort_requests", [f"long-{i}" for i in range(4)])
    assert {r for r, _ in dp.collect({f"long-{i}" for i in range(4)}).values()} == {
        FinishReason.ABORT}


def test_an_abort_goes_to_the_owner_only(dp: Driver) -> None:
    dp("add_request", req("a0", n=200, rank=0))
    dp("add_request", req("a1", n=30, rank=1))
    dp("abort_requests", ["a0", "never-sent"])
    done = dp.collect({"a0", "a1"})
    assert done == {"a0": (FinishReason.ABORT, 0), "a1": (FinishReason.LENGTH, 1)}


def test_utilities_reach_one_engine_or_every_engine(dp: Driver) -> None:
    assert dp("call_utility_all", "echo", 7) == [7, 7]
    assert dp("echo", 3) == 3
    assert dp("is_sleeping") is False
    dp("sleep", 0)
    assert dp.client.state is ClientState.SLEEPING
    members = [dp.client.engine_client(i) for i in range(2)]
    assert all(m.state is ClientState.SLEEPING for m in members)
    assert dp("is_sleeping") is True
    assert dp("wake_up") is True
    assert dp.client.state is ClientState.RUNNING or dp.client.state is ClientState.READY
    assert dp("is_sleeping") is False
    assert dp("reset_prefix_cache") is True


def test_losing_one_engine_fails_only_its_requests(dp: Driver) -> None:
    dp("add_request", req("doomed", n=10_000, rank=1))
    dp("add_request", req("kept", n=20, rank=0))
    pid = dp.client.engine_client(1).engine_pid
    os.kill(pid, signal.SIGKILL)
    done = dp.collect({"doomed", "kept"})
    assert done == {"doomed": (FinishReason.ERROR, 1), "kept": (FinishReason.LENGTH, 0)}
    assert dp.client.dead_engines == [1]
    assert dp.client.engines[1] is MembershipState.DEAD
    assert dp.client.state not in (ClientState.DEAD, ClientState.SHUTDOWN)
    # New requests go to the engine that is left; a request pinned to the dead one is refused.
    for i in range(3):
        dp("add_request", req(f"after-{i}"))
    assert {e for _, e in dp.collect({f"after-{i}" for i in range(3)}).values()} == {0}
    with pytest.raises(EngineDeadError, match="engine 1"):
        dp("add_request", req("pinned-dead", rank=1))
    assert dp("call_utility_all", "echo", 1) == [1]
    # The last engine's death is the client's.
    os.kill(dp.client.engine_client(0).engine_pid, signal.SIGKILL)
    deadline = time.monotonic() + BOUND_S
    with pytest.raises(EngineDeadError):
        while time.monotonic() < deadline:
            dp("get_output", timeout=0.5)
    assert dp.client.state is ClientState.DEAD


@pytest.mark.parametrize("kind", KINDS)
def test_a_pending_call_on_the_dead_engine_names_it(kind: str) -> None:
    kill_on_stats = Fault(point="utility", action="sigkill", method="get_stats")
    with open_dp(kind, engine_fault={1: kill_on_stats}) as dp:
        with pytest.raises(EngineDeadError, match="engine 1 of 2"):
            dp("call_utility_all", "get_stats")
        assert dp("call_utility_all", "echo", 2) == [2]
        assert dp.client.pending_utility_calls() == 0
        assert dp.client.dead_engines == [1]


@pytest.mark.parametrize("kind", KINDS)
def test_a_restarted_engine_rejoins_under_its_index(kind: str) -> None:
    with open_dp(kind, restart_dead_engines=True) as dp:
        dp("add_request", req("lost", n=10_000, rank=1))
        old = dp.client.engine_client(1).engine_pid
        os.kill(old, signal.SIGKILL)
        assert dp.collect({"lost"}) == {"lost": (FinishReason.ERROR, 1)}
        deadline = time.monotonic() + BOUND_S
        while dp.client.engines[1] is not MembershipState.SERVING:
            assert time.monotonic() < deadline, dp.client.engines
            dp("get_output", timeout=0.1)
        assert dp.client.engine_client(1).engine_pid != old
        for i in range(4):
            dp("add_request", req(f"back-{i}"))
        assert Counter(e for _, e in dp.collect({f"back-{i}" for i in range(4)}).values()) == {
            0: 2, 1: 2}
        assert "lost" not in dp.client.live_requests()  # not replayed


@pytest.mark.parametrize("kind", KINDS)
def test_one_engine_failing_to_start_fails_the_construction_cleanly(kind: str) -> None:
    before = ResourceSnapshot.take()
    with pytest.raises(EngineStartupError, match="engine 1 of 2"):
        Driver(kind, engine_fault={1: Fault(point="before_ready", action="exit")},
               ready_timeout_s=BOUND_S)
    assert_released(before, "after the failed construction", bound=10, kinds=("processes",))


def test_one_engine_clients_answer_call_utility_all() -> None:
    with make_client(EngineConfig(model="null"), multiprocess=True, asyncio=False) as c:
        assert c.call_utility_all("echo", 4) == [4]


def test_an_output_from_an_engine_not_sent_the_request_is_refused() -> None:
    with open_dp("sync") as dp:
        dp("add_request", req("mine", n=10_000, rank=0))
        dp("add_request", req("theirs", n=3, rank=1))
        from enginewire.protocol.messages import EngineCoreOutput, EngineCoreOutputs

        # Engine 1 claims engine 0's request, next to one of its own (as a confused or a
        # restarted engine might): the claim touches nothing, the rest is delivered. (Engine
        # 1's own client refuses it first; the data-parallel client's owner check is the
        # second line.)
        dp.client.engine_client(1)._outputs.put(EngineCoreOutputs(engine_index=1, outputs=[
            EngineCoreOutput("mine", [9], FinishReason.STOP),
            EngineCoreOutput("theirs", [7])]))
        with pytest.raises(SpecViolation, match="'mine'"):
            while True:
                dp("get_output", timeout=1.0)
        assert "mine" in dp.client.live_requests()
        dp("abort_requests", ["mine"])
        assert dp.collect({"mine", "theirs"}) == {
            "mine": (FinishReason.ABORT, 0), "theirs": (FinishReason.LENGTH, 1)}
