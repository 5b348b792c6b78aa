"""``client = await make_client_async(cfg); del client`` with no further await: the engine
exits (vLLM's delete test has this shape). The awaited future used to hold the client while
the task ran on, so its finalizer never ran and the engine outlived every reference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

BOUND_S = 10.0

SCRIPT = textwrap.dedent('''
    import asyncio, gc, os, sys, time
    from enginewire import EngineConfig, make_client_async

    def gone(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    async def main(shape):
        client = await make_client_async(EngineConfig(model="null"))
        pid = client.engine_pid
        if shape == "gc":  # a cycle through the client: only the collector frees it
            client.me = client
        del client
        if shape == "gc":
            gc.collect()
        deadline = time.monotonic() + BOUND
        while time.monotonic() < deadline:  # no await: the task never yields again
            if gone(pid):
                print("gone", flush=True)
                return
            time.sleep(0.05)
        print("still running", pid, flush=True)

    if __name__ == "__main__":
        BOUND = float(sys.argv[2])
        asyncio.run(main(sys.argv[1]))
''')


def _run(tmp_path: Path, shape: str) -> str:
    script = tmp_path / "delete_shape.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "ENGINEWIRE_ENGINE_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), shape, str(BOUND_S)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_engine_exits_when_the_client_is_dropped_without_another_await(tmp_path: Path) -> None:
    assert _run(tmp_path, "plain") == "gone"


def test_engine_exits_when_a_client_in_a_cycle_is_collected(tmp_path: Path) -> None:
    assert _run(tmp_path, "gc") == "gone"
