"""A standalone engine alone for a long time still stops on SIGTERM within its grace.

With no front end attached each heartbeat was queued on the output socket; once the pipe
held its high-water mark (1000 messages: 10 s at a 0.01 s interval, about 17 minutes at the
default) a send blocked and was retried for good while holding the output lock, which the
stop path waits on: SIGTERM never ended the engine. Beats now go only to a connected peer
whose pipe has room, and a stopping engine abandons a send still blocked past its flush
deadline. A front end that attaches after the long wait is served and beaten to as usual."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import msgspec

from enginewire import make_client
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine_proc import process_main

CONFIG = EngineConfig(model="null")
ALONE_S = 14.0  # past the 10 s it took the old engine's pipe to fill at this interval
GRACE_S = 5.0  # docs/runtime.md: within a second or so, 4 s when outputs are flushing


def _start(tmp_path: Path) -> tuple[multiprocessing.process.BaseProcess, str, str]:
    inp, out = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    mp = multiprocessing.get_context("spawn")
    proc = mp.Process(target=process_main, args=(type(CONFIG), msgspec.msgpack.encode(CONFIG),
                      {"input_address": inp, "output_address": out,
                       "heartbeat_interval_s": 0.01}), daemon=True)
    proc.start()
    return proc, inp, out


def _stop(proc: multiprocessing.process.BaseProcess) -> float:
    assert proc.pid is not None
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(GRACE_S + 10)
    took = time.monotonic() - t0
    assert proc.exitcode == 0, f"exit code {proc.exitcode} after {took:.1f} s"
    return took


def test_an_engine_alone_past_its_pipe_limit_stops_on_sigterm(tmp_path: Path) -> None:
    """A front end attached once and left: the output socket keeps a pipe to it, which the
    beats filled (the old engine then ignored SIGTERM: still running 20 s after it)."""
    proc, inp, out = _start(tmp_path)
    try:
        with make_client(CONFIG, multiprocess=True, asyncio=False, launch_engine=False,
                         input_address=inp, output_address=out, ready_timeout_s=30) as client:
            assert client.echo("first", timeout=30) == "first"
        time.sleep(ALONE_S)
        took = _stop(proc)
        assert took < GRACE_S, f"SIGTERM took {took:.1f} s"
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def test_a_front_end_attaching_after_a_wait_alone_gets_heartbeats(tmp_path: Path) -> None:
    proc, inp, out = _start(tmp_path)
    try:
        time.sleep(2.0)
        # Beats start with the connection: a client that got none within its 1 s deadline
        # would be declared dead before the second echo.
        with make_client(CONFIG, multiprocess=True, asyncio=False, launch_engine=False,
                         input_address=inp, output_address=out,
                         engine_heartbeat_timeout_s=1.0, ready_timeout_s=30) as client:
            assert client.echo("late", timeout=30) == "late"
            time.sleep(2.5)
            assert client.echo("still", timeout=30) == "still"
        assert _stop(proc) < GRACE_S
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
