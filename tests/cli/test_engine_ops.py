"""`enginewire engine` as a supervisor runs it: no TTY, stdin from /dev/null, logs to a pipe,
signals to stop it, front ends attached while it goes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from enginewire import EngineDeadError, make_client
from enginewire.runtime.config import EngineConfig

BOUND_S = 60.0


def _engine(tmp_path: Path) -> tuple[subprocess.Popen[str], str, str]:
    inp, out = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "enginewire.cli", "engine", "--model", "null",
         "--input-address", inp, "--output-address", out],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, inp, out


def _attach(inp: str, out: str) -> Any:
    # No heartbeat deadline: the engine's own word is then the only way its exit is seen.
    return make_client(EngineConfig(model="null"), multiprocess=True, asyncio=False,
                       launch_engine=False, input_address=inp, output_address=out,
                       ready_timeout_s=BOUND_S)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_is_a_clean_exit_logged_and_told_to_the_front_end(
        tmp_path: Path, sig: signal.Signals) -> None:
    proc, inp, out = _engine(tmp_path)
    try:
        with _attach(inp, out) as client:
            assert client.call_utility("echo", "up", timeout=BOUND_S) == "up"
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=BOUND_S)
            assert proc.returncode == 0, err
            # Seen at once from the engine's sentinel, not from a deadline (there is none).
            with pytest.raises(EngineDeadError):
                client.get_output(timeout=BOUND_S / 2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=BOUND_S)
    lines = err.splitlines()
    assert "Traceback" not in err, err
    assert [ln for ln in lines if f"received {sig.name}; shutting down" in ln], err
    assert [ln for ln in lines if "engine core up (model null)" in ln and inp in ln], err
    assert len([ln for ln in lines if "a front end attached" in ln]) == 1, err


def test_a_bad_log_level_is_a_usage_error(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "enginewire.cli", "engine", "--model", "null",
         "--input-address", f"ipc://{tmp_path}/in", "--output-address", f"ipc://{tmp_path}/out"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=BOUND_S,
        env={**os.environ, "ENGINEWIRE_ENGINE_LOG_LEVEL": "LOUD"})
    assert res.returncode == 2, res.stderr
    assert "ENGINEWIRE_ENGINE_LOG_LEVEL" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
