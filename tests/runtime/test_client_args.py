"""Options, timeouts and teardown under bad input: each is refused with a typed error naming
it, before anything is created or changed, and nothing leaks (the conformance suite's
``check_bad_arguments`` covers the per-call arguments on every client)."""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from typing import Any

import psutil
import pytest

from enginewire.protocol.utilities import UTILITIES
from enginewire.runtime import _background as bg
from enginewire.runtime import make_client
from enginewire.runtime import mp_client as mp
from enginewire.runtime.args import check_option_seconds, check_request_ids, check_timeout
from enginewire.runtime.client import InprocClient
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine_proc import EngineCoreProc
from enginewire.spec import (
    ClientState,
    EngineDeadError,
    EngineStartupError,
    UtilityError,
    UtilityTimeoutError,
)
from enginewire.testing._harness import ResourceSnapshot, assert_released

NULL = EngineConfig(model="null")


@pytest.fixture(autouse=True, scope="module")
def _resource_tracker() -> None:
    # Started by the first spawn and kept (a process and a pipe): start it before any
    # snapshot, so it is not counted as a leak.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def snapshot() -> ResourceSnapshot:
    return ResourceSnapshot.take()


def assert_nothing_leaked(before: ResourceSnapshot) -> None:
    assert_released(before, kinds=("processes", "threads", "fds"))


def test_timeouts_normalize_or_refuse() -> None:
    assert check_timeout(None) is None and check_timeout(math.inf) is None
    assert check_timeout(-3) == 0.0 and check_timeout(-math.inf) == 0.0
    assert check_timeout(2) == 2.0
    for bad, kind in (("1", TypeError), (True, TypeError), ([1], TypeError),
                      (math.nan, ValueError)):
        with pytest.raises(kind, match="timeout"):
            check_timeout(bad)
    assert check_option_seconds(None, "x") is None
    assert check_option_seconds(0, "x", allow_zero=True) == 0.0
    for bad in (0, -1, math.inf, math.nan, "5", True):
        with pytest.raises(ValueError, match=r"^opt="):
            check_option_seconds(bad, "opt")
    assert check_request_ids(("a", "b")) == ["a", "b"]
    for bad in ("ab", b"ab", None, 3, ["a", 1]):
        with pytest.raises(TypeError):
            check_request_ids(bad)


@pytest.mark.parametrize("option,value", [
    ("engine_heartbeat_timeout_s", math.inf),
    ("engine_heartbeat_timeout_s", -1),
    ("engine_heartbeat_interval_s", 0),
    ("shutdown_timeout_s", math.nan),
    ("ready_timeout_s", math.inf),
    ("ready_timeout_s", "soon"),
    ("engine_startup_delay_s", -1),
    ("engine_index", -5),
    ("client_index", 1 << 16),
    # Wrong types: a str read as True, or an AttributeError / a spawned engine failing.
    ("launch_engine", "no"),
    ("frame_integrity", "yes"),
    ("allow_insecure_tcp", 1),
    ("input_address", 5),
    ("engine_connect", "ab"),
    ("curve", "x"),
    ("engine_curve", "x"),
    ("engine_limits", {"max_frame_bytes": 10}),
    ("trace", "x"),
])
def test_bad_client_options_are_refused_before_anything_starts(option: str, value: Any) -> None:
    before = snapshot()
    with pytest.raises(ValueError, match=option):
        make_client(NULL, multiprocess=True, asyncio=False, **{option: value})
    assert_nothing_leaked(before)


@pytest.mark.parametrize("flags", [
    {"multiprocess": "no", "asyncio": False},  # a str read as True: an engine process
    {"multiprocess": True, "asyncio": "no"},  # read as True: an AsyncMPClient
    {"multiprocess": 1, "asyncio": False},
    {"multiprocess": None, "asyncio": False},
])
def test_make_client_refuses_transport_flags_that_are_not_bools(flags: dict[str, Any]) -> None:
    bad = next(name for name, value in flags.items() if not isinstance(value, bool))
    before = snapshot()
    with pytest.raises(ValueError, match=f"{bad}=.*must be True or False"):
        make_client(NULL, **flags)
    assert_nothing_leaked(before)


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc", "mp"])
@pytest.mark.parametrize("config", ["tiny", {"model": "null"}, None])
def test_a_config_that_is_not_an_engine_config_is_a_type_error(multiprocess: bool,
                                                               config: Any) -> None:
    # It was an EngineStartupError about 'resolved_device', after spawning an engine.
    before = snapshot()
    with pytest.raises(TypeError, match="expected an EngineConfig"):
        make_client(config, multiprocess=multiprocess, asyncio=False)
    assert_nothing_leaked(before)


def test_a_bad_ready_timeout_in_the_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw in ("inf", "-2", "x"):
        monkeypatch.setenv(mp.READY_TIMEOUT_ENV, raw)
        with pytest.raises(ValueError, match=mp.READY_TIMEOUT_ENV):
            make_client(NULL, multiprocess=True, asyncio=False)


def test_a_bad_shutdown_timeout_changes_nothing_and_inf_waits_for_a_clean_exit() -> None:
    before = snapshot()
    client = make_client(NULL, multiprocess=True, asyncio=False)
    for bad, kind in (("x", TypeError), (math.nan, ValueError)):
        with pytest.raises(kind):
            client.shutdown(bad)  # type: ignore[arg-type]
        assert client.state is ClientState.READY
    assert client.echo(1) == 1
    proc = client.resources.proc  # type: ignore[attr-defined]
    client.shutdown(math.inf)  # no SIGKILL deadline: joins until the engine exits on SIGTERM
    assert client.state is ClientState.SHUTDOWN
    assert proc is None or proc._closed  # reaped and closed, not a zombie
    assert_nothing_leaked(before)


def test_a_failing_teardown_stage_does_not_skip_the_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    before = snapshot()
    client = make_client(NULL, multiprocess=True, asyncio=False)
    res = client.resources  # type: ignore[attr-defined]
    ipc_dir = res.ipc_dir.path

    def boom() -> None:
        raise RuntimeError("monitor stop failed")

    monkeypatch.setattr(res, "_stop_monitor", boom)
    with pytest.raises(RuntimeError, match="monitor stop failed"):
        client.shutdown()
    assert res.proc is None and res.ctx is None and res.ipc_dir is None
    assert not os.path.exists(ipc_dir)
    # The monitor the failed stage did not stop ends with the engine it watched.
    if res.monitor_thread is not None:
        os.write(res.monitor_pipe[1], b"x") if res.monitor_pipe else None
        res.monitor_thread.join(5.0)
    for fd in res.monitor_pipe or ():
        os.close(fd)
    assert_nothing_leaked(before)


def test_a_monitor_that_fails_declares_the_engine_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    ready = threading.Event()

    def broken(*args: object) -> None:
        ready.wait(30)
        raise OverflowError("timeout value is too large")

    monkeypatch.setattr(bg, "_watch_engine", broken)
    client = make_client(NULL, multiprocess=True, asyncio=False)
    ready.set()
    try:
        with pytest.raises(EngineDeadError) as err:
            for _ in range(1000):  # the monitor reports at once; bounded anyway
                client.echo(1, timeout=5)
        assert "monitor failed" in str(err.value.__cause__)
        assert client.state is ClientState.DEAD
    finally:
        client.shutdown()


def test_an_engine_declared_dead_at_once_after_the_handshake_is_a_ready_clients_death() -> None:
    """A heartbeat deadline shorter than the handshake's last steps: the client is READY
    before its monitor starts, so the verdict is a death, never a SpecViolation and never a
    construction that failed after the engine's ready was in."""
    before = snapshot()
    for _ in range(3):
        client = make_client(NULL, multiprocess=True, asyncio=False,
                             engine_heartbeat_timeout_s=1e-9,
                             engine_heartbeat_interval_s=1.0)
        with pytest.raises(EngineDeadError):
            for _ in range(1000):
                client.echo(1, timeout=5)
        assert client.state is ClientState.DEAD
        client.shutdown()
    assert_nothing_leaked(before)


def test_an_async_call_with_no_time_left_gets_its_reply_or_a_utility_timeout() -> None:
    async def main() -> tuple[int, int]:
        client = make_client(NULL, multiprocess=True, asyncio=True)
        got = timed_out = 0
        try:
            for i in range(60):
                try:
                    assert await client.call_utility_async(  # type: ignore[attr-defined]
                        "echo", i, timeout=0 if i % 2 else -1) == i
                    got += 1
                except UtilityTimeoutError:
                    timed_out += 1
            assert await client.echo_async(7, timeout=math.inf) == 7  # type: ignore[attr-defined]
            assert client.pending_utility_calls() == 0  # type: ignore[attr-defined]
        finally:
            client.shutdown()
        return got, timed_out

    got, timed_out = asyncio.run(main())
    assert got + timed_out == 60


def test_engine_config_names_every_bad_field() -> None:
    cases: dict[str, list[Any]] = {
        "device": [None, 5, "tpu"],
        "gpu_memory_utilization": [None, "0.5", 0, 1.5, math.nan],
        "null_step_delay_s": [None, "1", -1, math.inf, math.nan],
        "enable_prefix_caching": ["yes", None, 1],
        "num_gpu_blocks_override": ["3", 1.5, True, 0],
        "seed": [-1, 1 << 70, 1.0],
        "max_num_seqs": [1 << 70, 0, True],
        "max_model_len": [1 << 70, "256"],
        "scheduling_policy": [None, ["fcfs"]],
    }
    for field, values in cases.items():
        for value in values:
            with pytest.raises(ValueError, match=f"EngineConfig.{field}="):
                EngineConfig(**{field: value})  # type: ignore[arg-type]
    assert EngineConfig(seed=(1 << 64) - 1, gpu_memory_utilization=1).seed == (1 << 64) - 1


@pytest.mark.parametrize("interval", [0, -1, math.nan, math.inf])
def test_the_engine_refuses_a_heartbeat_interval_it_would_spin_on(interval: float) -> None:
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        EngineCoreProc(NULL, input_address="ipc:///nonexistent/in",
                       output_address="ipc:///nonexistent/out", heartbeat_interval_s=interval)


def test_a_bad_profile_directory_is_refused_with_the_session_intact(tmp_path: Any) -> None:
    client = InprocClient(NULL)
    try:
        with pytest.raises(UtilityError, match=r"not writable|Permission|No such"):
            client.profile(True, "/proc/enginewire-forbidden/x")
        client.profile(True, str(tmp_path / "ok"))  # nothing was started by the refusal
        with pytest.raises(UtilityError):
            client.profile(False, "/proc/enginewire-forbidden/x")
        out = client.profile(False)  # the session survived the refused stop
        assert out is not None and out.startswith(str(tmp_path / "ok")) and os.path.isfile(out)
        with pytest.raises(UtilityError, match="not running"):
            client.profile(False)
    finally:
        client.shutdown()


@pytest.mark.parametrize("address", ["bogus", "in-use"])
def test_an_address_that_cannot_be_bound_is_named(address: str) -> None:
    import zmq

    ctx = zmq.Context()
    taken = ctx.socket(zmq.PULL)
    try:
        if address == "in-use":
            port = taken.bind_to_random_port("tcp://127.0.0.1")
            address = f"tcp://127.0.0.1:{port}"
        before = snapshot()
        with pytest.raises(ValueError, match=r"input_address=.*cannot bind"):
            make_client(NULL, multiprocess=True, asyncio=False, launch_engine=False,
                        input_address=address, output_address="tcp://127.0.0.1:*",
                        allow_insecure_tcp=True, ready_timeout_s=5)
        assert_nothing_leaked(before)
    finally:
        taken.close(0)
        ctx.term()


def test_a_stopped_engine_is_stopped_by_sigterm_not_after_the_grace(
        caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import signal

    before = snapshot()
    client = make_client(NULL, multiprocess=True, asyncio=False)
    pid = client.engine_pid  # type: ignore[attr-defined]
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    with caplog.at_level(logging.WARNING, "enginewire.runtime.mp_client"):
        client.shutdown()
    assert "did not stop within" not in caplog.text  # SIGTERM was handled, no SIGKILL
    assert_nothing_leaked(before)


def test_a_bad_fault_spec_is_refused_before_the_engine_is_spawned() -> None:
    before = snapshot()
    with pytest.raises(ValueError, match="nosuch"):
        make_client(NULL, multiprocess=True, asyncio=False, engine_fault="nosuch:1")
    assert_nothing_leaked(before)


def test_ipc_socket_files_at_given_addresses_are_removed_at_shutdown(tmp_path: Any) -> None:
    inp, out = tmp_path / "in", tmp_path / "out"
    client = make_client(NULL, multiprocess=True, asyncio=False,
                         input_address=f"ipc://{inp}", output_address=f"ipc://{out}")
    assert inp.exists() and out.exists()
    assert client.echo(3) == 3
    client.shutdown()
    assert not inp.exists() and not out.exists()
    keep = tmp_path / "keep"  # a regular file is never touched, whatever address named it
    keep.write_text("x")
    st = keep.stat()
    client = make_client(NULL, multiprocess=True, asyncio=False)
    client.resources.bound_ipc_paths.append(  # type: ignore[attr-defined]
        (str(keep), (st.st_dev, st.st_ino, st.st_ctime_ns)))
    client.shutdown()
    assert keep.read_text() == "x"


def test_every_concurrent_shutdown_returns_once_the_engine_is_gone() -> None:
    for _ in range(3):
        client = make_client(NULL, multiprocess=True, asyncio=False)
        pid = client.engine_pid  # type: ignore[attr-defined]
        gone: list[bool] = []

        def close(client: Any = client, gone: list[bool] = gone, pid: int = pid) -> None:
            client.shutdown()
            gone.append(not psutil.pid_exists(pid))

        threads = [threading.Thread(target=close) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert gone == [True, True, True]


def test_an_engine_that_fails_to_start_says_why_to_the_client() -> None:
    before = snapshot()
    with pytest.raises(EngineStartupError, match="unknown model") as err:
        make_client(EngineConfig(model="no-such-model"), multiprocess=True, asyncio=False)
    assert isinstance(err.value.__cause__, bg.EngineProcessDied)
    assert "exit code 1" in str(err.value)
    assert_nothing_leaked(before)


# Every declared utility with arguments safe on any engine (protocol/utilities.py): a new
# utility is called here without anyone adding it to a list.
_WRAPPERS: list[tuple[str, tuple[Any, ...]]] = [
    (u.name, u.example) for u in UTILITIES if u.example is not None]


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc", "sync"])
def test_every_utility_wrapper_takes_a_timeout(multiprocess: bool) -> None:
    """Only echo and collective_rpc did: sleep(..., timeout=5) was a TypeError."""
    with make_client(NULL, multiprocess=multiprocess, asyncio=False) as client:
        for name, args in _WRAPPERS:
            getattr(client, name)(*args, timeout=30)
        with pytest.raises(ValueError):  # checked as call_utility checks it
            client.get_stats(timeout=math.nan)


def test_every_async_utility_wrapper_takes_a_timeout() -> None:
    async def main() -> None:
        async with make_client(NULL, multiprocess=True, asyncio=True) as client:
            for name, args in _WRAPPERS:
                await getattr(client, f"{name}_async")(*args, timeout=30)

    asyncio.run(main())


@pytest.mark.parametrize("raw", ["0", "0.0", "-0"])
def test_a_zero_ready_timeout_in_the_environment_is_named_before_any_spawn(
        monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """A zero wait for the engine could only ever end in EngineStartupError after a spawn: it is
    a configuration error, named as such, and no engine is started for it."""
    before = snapshot()
    monkeypatch.setenv(mp.READY_TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=f"{mp.READY_TIMEOUT_ENV}={raw!r}: must be"):
        make_client(NULL, multiprocess=True, asyncio=False)
    assert_nothing_leaked(before)


def test_a_sentinel_readable_before_the_exit_is_polled_not_spun_on() -> None:
    """vLLM #54184: a process sentinel that reads ready while the process lives. The monitor
    must neither call it dead nor spin on the still-readable sentinel (join(1.0) returns at
    once on it): it polls the exit instead, and reports the real one."""
    r, w = os.pipe()
    os.close(w)  # the read end is readable (EOF) for good, as a sentinel closed early
    stop_r, stop_w = os.pipe()

    class FakeProc:
        pid, sentinel, checks = 4242, r, 0

        def join(self, timeout: float | None = None) -> None:
            pass  # a readable sentinel: multiprocessing's join returns at once

        @property
        def exitcode(self) -> int | None:
            self.checks += 1
            return -9 if self.checks > 5 else None

    proc = FakeProc()
    try:
        t0 = time.monotonic()
        cause = bg._watch_engine(proc, stop_r, None, [time.monotonic()], [math.inf])
        took = time.monotonic() - t0
    finally:
        for fd in (r, stop_r, stop_w):
            os.close(fd)
    assert isinstance(cause, bg.EngineProcessDied) and "SIGKILL" in str(cause), cause
    assert proc.checks <= 8  # one look per poll (and one to describe the exit)
    assert took >= 4 * bg._SENTINEL_POLL_S * 0.9  # it waited between looks
