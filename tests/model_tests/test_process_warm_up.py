"""The campaign's leak check against state a client's first start leaves for the process's
life (a CUDA context: about forty driver fds, seen on an H200 as "fds leaked: 47 > 5" at the
first restart of an in-process campaign). The CUDA case is simulated on the CPU with a fake
client whose first start opens a file that stays open."""

from __future__ import annotations

import os
from typing import Any

import pytest

from enginewire.runtime.config import EngineConfig
from enginewire.testing import stateful
from enginewire.testing.oracle import OracleViolation, ResourceSnapshot, check_released
from enginewire.testing.stateful import CampaignStats, ClientPool, builtin_factory


class _Client:
    def __init__(self) -> None:
        self.closed = False


class _Cut:
    engine_pid = None
    trace = None

    def __init__(self) -> None:
        self.client = _Client()

    @property
    def closed(self) -> bool:
        return self.client.closed

    def shutdown(self) -> None:
        self.client.closed = True


class _ContextOnFirstStart:
    """A factory whose first client opens a process-lifetime handle, as CUDA's first use does."""

    def __init__(self, path: str, *, warm: bool) -> None:
        self.path = path
        self.held: list[int] = []
        if warm:
            self.warm_up = lambda: self().shutdown()
            self.warm_up_key = ("test", path)

    def __call__(self, **options: Any) -> _Cut:
        if not self.held:
            self.held.append(os.open(self.path, os.O_RDONLY))
        return _Cut()

    def close(self) -> None:
        for fd in self.held:
            os.close(fd)


def _cycle(factory: _ContextOnFirstStart) -> None:
    pool = ClientPool(factory, CampaignStats())  # type: ignore[arg-type]
    live = pool.acquire()
    stateful.close_and_check(live)


def test_a_first_start_that_keeps_a_handle_is_reported_with_what_it_holds(tmp_path) -> None:
    path = str(tmp_path / "driver-handle")
    open(path, "w").close()
    factory = _ContextOnFirstStart(path, warm=False)
    try:
        with pytest.raises(OracleViolation, match=r"fds leaked: .*driver-handle x1"):
            _cycle(factory)
    finally:
        factory.close()


def test_the_pool_runs_the_factorys_warm_up_once_before_its_snapshot(tmp_path) -> None:
    path = str(tmp_path / "driver-handle")
    open(path, "w").close()
    factory = _ContextOnFirstStart(path, warm=True)
    calls = 0
    inner = factory.warm_up

    def counted() -> None:
        nonlocal calls
        calls += 1
        inner()

    factory.warm_up = counted
    try:
        _cycle(factory)  # the handle predates the snapshot: no leak
        _cycle(factory)
        assert calls == 1
    finally:
        stateful.WARMED.discard(factory.warm_up_key)
        factory.close()


def test_check_released_names_a_leaked_file(tmp_path) -> None:
    before = ResourceSnapshot.take()
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(OracleViolation, match=rf"new: {tmp_path} x1"):
            check_released(before, engine_pid=None, ipc_path=None, bound=0.05)
    finally:
        os.close(fd)
    check_released(before, engine_pid=None, ipc_path=None, bound=0.05)


def test_only_an_in_process_engine_on_cuda_declares_a_warm_up() -> None:
    cuda = EngineConfig(model="tiny", device="cuda")
    cpu = EngineConfig(model="tiny", device="cpu")
    assert builtin_factory("inproc", cuda).warm_up_key == ("inproc", "cuda")  # type: ignore[attr-defined]
    assert not hasattr(builtin_factory("inproc", cpu), "warm_up")
    # A subprocess engine's CUDA context lives in its own process.
    assert not hasattr(builtin_factory("sync", cuda), "warm_up")
    assert not hasattr(builtin_factory("async", cuda), "warm_up")


def test_the_engine_warm_up_runs_a_request_and_a_sleep_cycle_and_leaves_no_client() -> None:
    """The body CUDA runs, on the CPU: after it, a pool's client cycle leaks nothing."""
    factory = builtin_factory("inproc", EngineConfig(model="tiny", device="cpu"))
    built: list[Any] = []

    def recording(**options: Any) -> Any:
        cut = factory(**options)
        built.append(cut)
        return cut

    stateful.warm_up_engine(recording)
    assert len(built) == 1 and built[0].closed
    steps = {entry[:4] for entry in built[0].trace}
    assert ("engine_request", "RUNNING", "LENGTH", "FINISHED_LENGTH") in steps
    assert {e for m, _, e, _ in steps if m == "engine"} >= {"RELEASE_MEMORY", "WAKE_UP",
                                                             "SHUTDOWN"}
    pool = ClientPool(factory, CampaignStats())
    stateful.close_and_check(pool.acquire())
