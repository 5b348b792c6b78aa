"""A process that holds a multi-process client forks (a pre-forking server, a daemonizing
library): the child's copy of the client must leave the parent's engine, sockets and files
alone, refuse every call with a ClientClosedError that says why, and never hang; the parent's
client must go on working. Each scenario runs in a fresh interpreter: the child exits through
``sys.exit`` so that every exit hook (weakref finalizers, multiprocessing's) runs as in a
real program, which pytest's own process must not do."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

_SCENARIO = textwrap.dedent('''
    import asyncio, os, sys
    from enginewire import (ClientClosedError, EngineConfig, EngineCoreRequest, SamplingParams,
                            make_client, make_client_async)

    KIND = sys.argv[1]
    CONFIG = EngineConfig(model="null")

    def child_checks(calls):
        """Every call refuses at once, naming the fork; shutdown is a no-op."""
        for name, call in calls:
            try:
                call()
            except ClientClosedError as e:
                assert "forked child" in str(e), (name, str(e))
            else:
                raise AssertionError(f"{name} did not raise")

    def parent_checks(client, engine_pid):
        os.kill(engine_pid, 0)  # still alive: the child's exit hooks did not stop it
        assert client.call_utility("echo", "y", timeout=10) == "y"
        client.add_request(EngineCoreRequest("p1", [1, 2], SamplingParams(max_tokens=3)))
        for _ in range(1000):  # p1's finish and the parent's abort of "live" both arrive
            if not client.live_requests():
                break
            client.get_output(timeout=10)
        assert client.live_requests() == []

    def run_sync():
        client = make_client(CONFIG, multiprocess=True, asyncio=False)
        client.add_request(EngineCoreRequest("live", [1], SamplingParams(max_tokens=10**6)))
        pid = os.fork()
        if pid == 0 and KIND == "idle":
            sys.exit(0)  # touches nothing; its exit hooks alone used to kill the parent's engine
        if pid == 0:
            child_checks([
                ("get_output", lambda: client.get_output()),  # no timeout: must not block
                ("call_utility", lambda: client.call_utility("echo", "x")),
                ("add_request", lambda: client.add_request(
                    EngineCoreRequest("c1", [1], SamplingParams(max_tokens=2)))),
                ("abort_requests", lambda: client.abort_requests(["live"])),
            ])
            client.shutdown()  # returns at once, touches nothing of the parent's
            # The way the message says: a client of the child's own works.
            with make_client(CONFIG, multiprocess=True, asyncio=False) as own:
                assert own.call_utility("echo", "c", timeout=30) == "c"
            sys.exit(0)  # every exit hook runs
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        client.abort_requests(["live"])
        parent_checks(client, client.engine_pid)
        client.shutdown()

    def run_async():
        # Each phase on its own asyncio.run: the parent's loop is closed before the fork
        # (a copied open loop is asyncio's own fork hazard: the child's exit unregisters the
        # parent's self-pipe from their shared epoll), and the client moves to the next loop.
        client = asyncio.run(make_client_async(CONFIG))
        pid = os.fork()
        if pid == 0:
            def run(coro_fn):
                return lambda: asyncio.run(coro_fn())
            child_checks([
                ("get_output_async", run(lambda: client.get_output_async())),
                ("call_utility_async", run(lambda: client.call_utility_async("echo", "x"))),
                ("add_request_async", run(lambda: client.add_request_async(
                    EngineCoreRequest("c1", [1], SamplingParams(max_tokens=2))))),
                ("abort_requests_async", run(lambda: client.abort_requests_async(["x"]))),
            ])
            asyncio.run(client.shutdown_async())
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status

        async def parent():
            os.kill(client.engine_pid, 0)
            assert await client.call_utility_async("echo", "y", timeout=10) == "y"
            await client.add_request_async(
                EngineCoreRequest("p1", [1], SamplingParams(max_tokens=3)))
            while client.live_requests():
                await client.get_output_async(timeout=10)
            await client.shutdown_async()
        asyncio.run(parent())

    if __name__ == "__main__":
        run_async() if KIND == "async" else run_sync()
        print("ok")
''')


@pytest.mark.parametrize("kind", ["idle", "sync", "async"])
def test_forked_child_leaves_the_parents_client_alone(kind: str, tmp_path) -> None:
    script = tmp_path / "scenario.py"
    script.write_text(_SCENARIO)
    # Its own session: a hung child is killed with it (a timeout must not leave one spinning).
    proc = subprocess.Popen([sys.executable, str(script), kind], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"hung: {stdout[-2000:]} {stderr[-3000:]}") from None
    assert proc.returncode == 0 and stdout.strip().endswith("ok"), (stdout[-3000:], stderr[-3000:])
    # No teardown ran in the child: nothing it logs on the way out.
    assert "teardown" not in stderr and "Traceback" not in stderr, stderr[-3000:]
