"""Conformance scenarios that break the engine: each takes a ``ClientFactory`` and a fresh
client (kills during a call, a handshake or a blocked ``get_output``, a fatal engine error,
the front end's death, a construction that fails). Re-exported by ``conformance``, whose
docstring states the contract; the driver and helpers are ``_conformance_driver.py``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

from ..spec import (
    ClientState,
    EngineDeadError,
    EngineStartupError,
)
from ._conformance_driver import (
    WAIT_S,
    ClientFactory,
    NotApplicable,
    check_trace,
    expect_dead,
    request,
    stop_process,
)
from ._harness import (
    ResourceSnapshot,
    assert_released,
    exited,
    new_processes,
    wait_until,
)
from .bounds import DEATH_BOUND_S, ORPHAN_BOUND_S

# --- scenarios that break the engine (fresh client each) --------------------------------------


def check_kill_during_get_output(factory: ClientFactory) -> None:
    """SIGKILL while get_output blocks: it wakes with EngineDeadError within the bound."""
    with factory() as cut:
        if not cut.multiprocess:
            raise NotApplicable("an in-process client has no engine process to kill")
        cut.call_utility("echo", 0)  # the reader is running
        fut = cut.submit("get_output")
        pid = cut.engine_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        expect_dead(fut, time.monotonic(), "blocked get_output")
        try:
            cut.add_request(request("after-death"))
        except EngineDeadError:
            pass
        else:
            raise AssertionError("add_request on a dead engine must raise EngineDeadError")
        cut.abort_requests(["x"])  # silent no-op on a dead engine
        assert cut.client.state is ClientState.DEAD, (
            f"the engine died, yet the client is {cut.client.state.name}")
        check_trace(cut)


def check_kill_during_utility(factory: ClientFactory) -> None:
    """SIGKILL while utility calls are pending: every one fails with EngineDeadError."""
    with factory() as cut:
        if not cut.multiprocess:
            raise NotApplicable("an in-process client has no engine process to kill")
        pid = cut.engine_pid
        assert pid is not None
        cut.call_utility("echo", 0)
        stop_process(pid)  # frozen: the calls below stay pending
        try:
            futs = [cut.submit("call_utility", "echo", i) for i in range(3)]
            try:
                wait_until(lambda: cut.client.pending_utility_calls() == 3, WAIT_S,
                           "3 pending calls")
            except AssertionError as e:
                # Say what became of the calls: a flaky run must explain itself.
                states = [repr(f.exception(0)) if f.done() else "running" for f in futs]
                raise AssertionError(
                    f"{e}: {cut.client.pending_utility_calls()} pending, calls: {states},"
                    f" client {cut.client.state.name}") from None
        finally:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for f in futs:
            expect_dead(f, killed, "pending utility")
        assert cut.client.pending_utility_calls() == 0, (
            f"{cut.client.pending_utility_calls()} utility calls left pending")
        check_trace(cut)


def check_kill_during_handshake(factory: ClientFactory) -> None:
    """SIGKILL before the engine is ready: construction fails at once, nothing leaks."""
    before = ResourceSnapshot.take()

    def new_engines() -> list[int]:  # any new child: what an engine start makes
        return new_processes(before)

    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(factory, engine_startup_delay_s=60.0)
    pool.shutdown(wait=False)
    # The factory may refuse the option (NotApplicable) or fail at once: say so, not wait.
    wait_until(lambda: bool(new_engines()) or fut.done(), WAIT_S, "the engine process")
    if not new_engines():
        cut = fut.result(0)  # the factory's own error, NotApplicable included, raises here
        multiprocess = cut.multiprocess
        cut.shutdown()
        if not multiprocess:
            raise NotApplicable("an in-process client has no engine process to kill")
        raise AssertionError("the factory returned a client before its engine was seen: does"
                             " it honour engine_startup_delay_s?")
    (pid,) = new_engines()
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        cut = fut.result(timeout=DEATH_BOUND_S + 5)
    except EngineStartupError as e:
        seen = time.monotonic() - killed
        assert seen <= DEATH_BOUND_S, f"handshake death seen after {seen:.2f} s"
        assert "initialization failed" in str(e) and "SIGKILL" in str(e), e
    else:
        cut.shutdown()
        raise AssertionError("construction must fail when the engine dies during start-up")
    wait_until(lambda: not new_engines(), WAIT_S, "reaped engine")


def check_engine_fatal_error(factory: ClientFactory) -> None:
    """A fatal engine error: sentinel, in-flight requests wake with EngineDeadError."""
    with factory(engine_fault="forward:3") as cut:
        if not cut.multiprocess:
            raise NotApplicable("an in-process client has no engine process to die")
        pid = cut.engine_pid
        cut.add_request(request("doomed", 50))
        start = time.monotonic()
        try:
            # Short reads, and the engine's exit watched: a client that swallows the death
            # (get_output returning empty batches) fails within the bound, by name, rather
            # than as a request still unfinished after WAIT_S.
            gone_at: float | None = None
            while True:
                batch = cut.get_output(timeout=0.1)
                if any(o.request_id == "doomed" and o.finish_reason is not None
                       for o in batch.outputs):
                    raise AssertionError("'doomed' finished, but the engine was to hit a fatal"
                                         " error in its 3rd forward")
                now = time.monotonic()
                if gone_at is None and pid is not None and exited(pid):
                    gone_at = now
                if gone_at is not None and now - gone_at > DEATH_BOUND_S:
                    raise AssertionError(
                        f"the engine hit a fatal error and its process exited {now - gone_at:.1f}"
                        " s ago, but get_output still returns instead of raising"
                        " EngineDeadError: the client swallowed the engine's death")
                if now - start > WAIT_S:
                    raise AssertionError(f"no EngineDeadError {WAIT_S} s after the request"
                                         " (the engine was to hit a fatal error in its 3rd"
                                         " forward)")
        except EngineDeadError as e:
            # The sentinel (or, if the monitor wins the race, the exit code) is the cause.
            cause = str(e.__cause__)
            assert "sentinel" in cause or "exit code" in cause, cause
        assert cut.client.state is ClientState.DEAD, (
            f"the engine died, yet the client is {cut.client.state.name}")
        check_trace(cut)


ORPHAN_SCRIPT = textwrap.dedent("""
    import sys
    from enginewire.runtime import make_client
    from enginewire.runtime.config import EngineConfig

    config = EngineConfig(**{config!r})
    client = make_client(config, multiprocess=True, asyncio={is_async!r})
    print(client.engine_pid, flush=True)
    sys.stdin.read()  # hold until killed
""")


def check_client_kill_engine_exits(config_kwargs: dict[str, Any], *, is_async: bool = False
                                   ) -> None:
    """SIGKILL of the client process: its engine exits by itself within ORPHAN_BOUND_S."""
    check_exits_with_parent(ORPHAN_SCRIPT.format(config=config_kwargs, is_async=is_async),
                            "orphaned engine")


def check_exits_with_parent(script: str, what: str, *, bound: float = ORPHAN_BOUND_S,
                            env: dict[str, str] | None = None) -> None:
    """Run ``script`` in its own interpreter: it starts a process, prints that process's pid
    and holds (reading stdin). SIGKILL the interpreter, which runs no cleanup: the process it
    started must exit by itself within ``bound`` s (it is killed afterwards either way)."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    child: int | None = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"the parent script failed: {line!r}"
        child = int(line)
        proc.kill()
        proc.wait(WAIT_S)
        killed = time.monotonic()
        wait_until(lambda: exited(child), bound + 2, f"{what} exit")
        assert time.monotonic() - killed <= bound, f"{what} outlived its parent by > {bound} s"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
        if proc.stdin:
            proc.stdin.close()
        if proc.stdout:
            proc.stdout.close()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def check_construction_failure_leaks_nothing(factory: ClientFactory, bad_config: Any) -> None:
    """A client whose engine fails to build raises EngineStartupError and leaks no process,
    thread or fd (_harness.py: what each one counts)."""

    def attempt() -> None:
        try:
            cut = factory(config=bad_config)
        except EngineStartupError as e:
            assert "initialization failed" in str(e), e
        else:
            cut.shutdown()
            raise AssertionError("a failing engine build must raise EngineStartupError")

    attempt()  # warm-up: first use creates process-wide things (imports, pools)
    before = ResourceSnapshot.take()
    attempt()
    assert_released(before, "after a failed construction", bound=WAIT_S,
                    kinds=("processes", "threads", "fds"))
