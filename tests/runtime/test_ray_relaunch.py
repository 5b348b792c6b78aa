"""A Ray actor's relaunch (runtime/ray_backend.py, Rule 2): the engine an index had is gone
before its replacement starts, even when it is stopped or hung, the replacement has a
channel of its own, and ``RayEngineProcess.kill`` ends a stopped engine. One local Ray (on
127.0.0.1) for the module."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
from enginewire.runtime import ray_backend
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.ray_backend import EngineNanny, RayEngines
from enginewire.runtime.sync_mp_client import SyncMPClient
from enginewire.spec import EngineDeadError, EngineStartupError

os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")  # spawned engines inherit it

NULL = EngineConfig(model="null")
BOUND_S = 30.0
# A relaunch returns only once the previous engine is reaped: no zombie, no process.
REAPED_S = 1.0


def gone(pid: int, bound: float) -> bool:
    deadline = time.monotonic() + bound
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return bound > REAPED_S  # a zombie is gone unless reaping was the point
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def serve_one(client: SyncMPClient, rid: str) -> None:
    client.add_request(EngineCoreRequest(rid, [1, 2], SamplingParams(max_tokens=3,
                                                                      ignore_eos=True)))
    deadline = time.monotonic() + BOUND_S
    while not any(o.finished for o in client.get_output(
            timeout=max(0.0, deadline - time.monotonic())).outputs):
        pass


@pytest.fixture(scope="module")
def engines() -> Iterator[RayEngines]:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("needs Ray not initialized here")
    saved = os.environ.pop("RAY_ADDRESS", None)
    try:
        with RayEngines(1, ready_timeout_s=BOUND_S) as placed:
            yield placed
    finally:
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved


def client_on(engines: RayEngines, launches: list[dict[str, Any]] | None = None, **kw: Any
              ) -> SyncMPClient:
    """A client of actor 0; ``launches`` gets the options each launch hands the engine."""
    launch = engines.launcher(0)

    def launcher(config_type: type, config: bytes, kwargs: dict[str, Any], name: str) -> Any:
        if launches is not None:
            launches.append(dict(kwargs))
        return launch(config_type, config, kwargs, name)

    return SyncMPClient(NULL, transport="tcp", engine_launcher=launcher,
                        ready_timeout_s=BOUND_S, **kw)


def test_a_relaunch_kills_the_stopped_engine_before_its_replacement(
        engines: RayEngines) -> None:
    """The campaign's failure (issue 44): a SIGSTOPped engine, declared dead by its
    heartbeat, is still alive, and the actor refused every replacement beside it."""
    launches: list[dict[str, Any]] = []
    old = client_on(engines, launches, engine_heartbeat_timeout_s=1.0)
    new: SyncMPClient | None = None
    try:
        serve_one(old, "before")
        pid = old.engine_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(EngineDeadError):  # the heartbeat deadline
            old.get_output(timeout=BOUND_S)
        assert old.resources.proc is not None and old.resources.proc.is_alive()
        new = client_on(engines, launches)
        assert gone(pid, REAPED_S), "the stopped engine outlived its replacement's launch"
        assert new.engine_pid != pid
        serve_one(new, "after")
        # A channel of its own: nothing the old engine sent or would send is admitted.
        before, after = launches
        for key in ("input_address", "output_address"):
            assert before[key] != after[key]
        assert before["curve"].keypair.public != after["curve"].keypair.public
    finally:
        old.shutdown()
        if new is not None:
            new.shutdown()


def test_a_relaunch_kills_a_running_engine_its_client_gave_up_on(
        engines: RayEngines) -> None:
    """Not only a stopped one: an engine still running (a bad frame, a deadline) is ended
    too, and its client sees that as its death."""
    old = client_on(engines)
    new: SyncMPClient | None = None
    try:
        pid = old.engine_pid
        assert pid is not None
        new = client_on(engines)
        assert gone(pid, REAPED_S)
        with pytest.raises(EngineDeadError):
            old.get_output(timeout=BOUND_S)
        serve_one(new, "after")
    finally:
        old.shutdown()
        if new is not None:
            new.shutdown()


def test_kill_ends_a_stopped_engine_and_is_idempotent(engines: RayEngines) -> None:
    """What the data-parallel client calls on a dead incarnation: SIGKILL through the actor
    ends a stopped engine; a second kill, and a kill after the exit, do nothing."""
    client = client_on(engines)
    try:
        proc = client.resources.proc
        assert proc is not None and client.engine_pid is not None
        os.kill(client.engine_pid, signal.SIGSTOP)
        proc.kill()
        proc.kill()
        proc.join(BOUND_S)
        assert proc.exitcode == -signal.SIGKILL
        assert gone(client.engine_pid, BOUND_S)
        proc.kill()
        with pytest.raises(EngineDeadError):
            client.get_output(timeout=BOUND_S)
    finally:
        client.shutdown()
    again = client_on(engines)  # the actor launches on
    try:
        serve_one(again, "again")
    finally:
        again.shutdown()


class _Unkillable:
    """An engine handle whose process outlives its SIGKILL (one stuck in the kernel)."""

    name = "stuck"
    pid = 4242

    def __init__(self) -> None:
        self.killed = 0

    def is_alive(self) -> bool:
        return True

    def kill(self) -> None:
        self.killed += 1

    def join(self, timeout: float | None = None) -> None:
        time.sleep(min(timeout or 0.0, 0.05))


def test_a_previous_engine_that_will_not_die_fails_the_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The nanny in this process, no Ray: a bounded wait, then EngineStartupError naming the
    engine that would not die, and nothing started beside it."""
    monkeypatch.setattr(ray_backend, "_PREVIOUS_GONE_S", 0.05)
    nanny = EngineNanny()
    stuck = _Unkillable()
    nanny._procs[0] = stuck
    nanny._next = 1
    launched: list[str] = []
    monkeypatch.setattr("enginewire.runtime.engine_launch.launch_engine_process",
                        lambda *a: launched.append("launched"))
    with pytest.raises(EngineStartupError, match=r"previous engine \(pid 4242, launch 0\) is"
                       r" still alive 0.05 s after its SIGKILL"):
        nanny.start(EngineConfig, b"", {}, "e")
    assert stuck.killed == 1 and not launched and nanny._next == 1
