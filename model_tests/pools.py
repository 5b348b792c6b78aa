"""Clients for the stateful machines: the built-in client factory and its warm-up, and
``ClientPool``, which hands one healthy client from example to example and checks, when one
goes, that it released everything (the engine process, ipc files, threads, fds); plus the
orphan check (a client process killed outright: its engine exits by itself)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import conformance as cf
from ._conformance_driver import Declared, declared_contract, left_behind_as_declared
from ._harness import describe_leaks, exited, wait_until
from .bounds import WAIT_S, check_shutdown_took
from .campaign_stats import CampaignStats
from .conformance_breaking import ORPHAN_SCRIPT
from .oracle import OracleViolation, ResourceSnapshot, check_released

ClientFactory = Callable[..., cf.ClientUnderTest]


def builtin_factory(kind: str, config: Any, *, faults: bool = True) -> ClientFactory:
    """A factory for a built-in client with run-time fault arming when ``faults``.

    It meets the conformance ``ClientFactory`` contract: ``config=`` replaces ``config``,
    ``engine_fault=`` replaces the armable plan, ``engine_startup_delay_s=`` is passed on (the
    in-process client raises ``NotApplicable`` for the last two)."""
    from ..runtime.faults import FaultInjector, FaultPlan

    if kind not in cf.CLIENT_KINDS:  # now, not at the first example's engine start
        raise ValueError(f"kind must be one of {cf.CLIENT_KINDS}, got {kind!r}")

    def factory(**options: Any) -> cf.ClientUnderTest:
        built_with = options.pop("config", config)
        if faults and kind != "inproc":
            options.setdefault("engine_fault", FaultPlan(allow_arm=True))
        cut = cf.open_client(kind, built_with, **options)
        if faults and kind == "inproc":
            cut.client.engine.fault_hook = FaultInjector(FaultPlan(allow_arm=True))
        return cut

    # An in-process engine on CUDA creates the CUDA context in this process: some forty
    # driver fds that stay for the process's life. One engine runs a request and a sleep
    # cycle (host copies of the weights) before the first snapshot, so that what CUDA keeps
    # is there before and the leak check compares like with like (seen on an H200: "fds
    # leaked: 47 > 5" at the first restart without it).
    if kind == "inproc" and _resolved_device(config).startswith("cuda"):
        factory.warm_up = functools.partial(warm_up_engine, factory)  # type: ignore[attr-defined]
        factory.warm_up_key = ("inproc", _resolved_device(config))  # type: ignore[attr-defined]
    return factory


def warm_up_engine(factory: ClientFactory) -> None:
    """One client's life: a request to its end and a sleep/wake cycle, then shutdown."""
    cut = factory()
    try:
        cut.add_request(cf.request("warm-up", 2))
        cf.collect(cut, ["warm-up"])
        cut.sleep(1)
        cut.wake_up()
    finally:
        cut.shutdown()


def _resolved_device(config: Any) -> str:
    resolve = getattr(config, "resolved_device", None)
    return str(resolve()) if callable(resolve) else "cpu"


# warm_up_key of every factory warm-up this process ran: process-wide state is made once.
WARMED: set[object] = set()


def warm_up_process(factory: Any) -> None:
    """Run ``factory.warm_up()`` once per process and key, where the factory declares one: a
    client whose first start creates state that outlives it (a CUDA context) builds one
    throwaway client first, so a leak check's snapshot already includes that state."""
    warm_up = getattr(factory, "warm_up", None)
    key = getattr(factory, "warm_up_key", warm_up)
    if warm_up is None or key in WARMED:
        return
    warm_up()
    WARMED.add(key)


def ensure_resource_tracker() -> None:
    """Start multiprocessing's resource tracker before a leak check's first snapshot: it is
    process-wide and started once, so not a leak of whichever client would start it."""
    with contextlib.suppress(Exception):
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()


@dataclass
class Live:
    """One client incarnation and what its teardown must check."""

    cut: cf.ClientUnderTest
    before: ResourceSnapshot
    engine_pid: int | None
    ipc_path: str | None
    # What its factory declares (``declared_contract`` (_conformance_driver.py)): the release check
    # follows it (a declared leftover is excused, by kind).
    contract: Mapping[str, str] = field(default_factory=dict)


class ClientPool:
    """Keeps one healthy client between examples; builds a new one when none is left."""

    def __init__(self, factory: ClientFactory, stats: CampaignStats) -> None:
        self.factory = factory
        self.stats = stats
        self._idle: Live | None = None

    def acquire(self) -> Live:
        if self._idle is not None:
            live, self._idle = self._idle, None
            return live
        if self.factory is not None:
            ensure_resource_tracker()
            start = time.monotonic()
            warm_up_process(self.factory)
            self.stats.seconds["(engine start)"] += time.monotonic() - start
        before = ResourceSnapshot.take()
        start = time.monotonic()
        cut = self.factory()
        self.stats.engines_started += 1
        self.stats.seconds["(engine start)"] += time.monotonic() - start
        res = getattr(cut.client, "resources", None)
        ipc = getattr(getattr(res, "ipc_dir", None), "path", None)
        return Live(cut, before, cut.engine_pid, None if ipc is None else str(ipc),
                    declared_contract(self.factory))

    def release(self, live: Live) -> None:
        if self._idle is not None:
            close_and_check(self._idle)
        self._idle = live

    def close(self) -> None:
        if self._idle is not None:
            live, self._idle = self._idle, None
            close_and_check(live)


def close_and_check(live: Live, *, check: bool = True) -> float:
    """Shut the client down; check that everything was released. Returns the seconds taken."""
    start = time.monotonic()
    live.cut.shutdown()
    took = time.monotonic() - start
    if check:
        check_shutdown_took(took)
        declared = Declared.ZMQ_CONTEXT_OUTLIVES_SHUTDOWN in live.contract
        check_released(live.before, engine_pid=live.engine_pid, ipc_path=live.ipc_path,
                       threads_fds=not declared)
        if declared:  # threads and fds, less the leftover the factory declares
            leaks = left_behind_as_declared(live.before, live.contract,
                                            kinds=("threads", "fds"))
            if leaks:
                raise OracleViolation("; ".join(describe_leaks(leaks, live.before)))
    return took


def check_orphan_exits(config_kwargs: dict[str, Any]) -> None:
    """SIGKILL a client process; its engine must exit by itself within ORPHAN_BOUND_S. An
    engine that does not is killed here, so a failing check leaks nothing."""
    import subprocess
    import sys

    script = ORPHAN_SCRIPT.format(config=config_kwargs, is_async=False)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    engine_pid = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise OracleViolation(f"orphan check: the client script failed: {line!r}")
        engine_pid = int(line)
        proc.kill()
        proc.wait(WAIT_S)
        if not wait_until(functools.partial(exited, engine_pid), cf.ORPHAN_BOUND_S,
                          poll=0.02):
            raise OracleViolation(
                f"orphaned engine {engine_pid} still running {cf.ORPHAN_BOUND_S} s after"
                " its client process was killed")
        engine_pid = None
    finally:
        if engine_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine_pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
