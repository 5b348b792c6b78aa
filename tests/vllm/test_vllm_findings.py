"""docs/vllm.md's findings, each as its reproducer: the spec's property, asserted on vLLM
0.33's real clients, and marked ``xfail(strict=True)`` with the exception vLLM's behaviour
raises, so a vLLM that fixes one (or a harness change that hides one) fails here and the
findings table must be updated. Finding 4 is declared (``zmq_context_outlives_shutdown``):
its test pins what the declaration says, so the leak check's excuse cannot grow unnoticed.

Skipped where vLLM is not installed. By hand, in the vLLM environment::

    nice -n 10 /work/vllm-venv/bin/python -m pytest tests/vllm -p no:cacheprovider
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import os
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from enginewire.spec.client import ClientState
from enginewire.spec.errors import ClientClosedError, EngineDeadError, ProtocolError
from enginewire.testing._harness import ResourceSnapshot, fd_targets, left_behind, wait_until
from enginewire.testing.bounds import RULE_DEATH_BOUND_S
from enginewire.testing.conformance import (
    ClientUnderTest,
    collect,
    request,
    stop_process,
)
from enginewire.testing.interposer import (
    Direction,
    FrameAction,
    FrameKind,
    FrameRule,
    Interposer,
)
from enginewire.testing.vllm_factory import VllmFactory, vllm_available

_WHY = vllm_available()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"needs vLLM 0.33 ({_WHY})")

# A woken call answers within the death bound; past this it was never woken.
_WOKEN_S = RULE_DEATH_BOUND_S + 2.0


@pytest.fixture
def cut(request: pytest.FixtureRequest) -> Iterator[ClientUnderTest]:
    client = VllmFactory(request.param)()
    try:
        yield client
    finally:
        pid = client.engine_pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        client.shutdown()


def _wait_pending(cut: ClientUnderTest, n: int) -> None:
    deadline = time.monotonic() + 10.0
    while cut.client.pending_utility_calls() < n:
        assert time.monotonic() < deadline, "the call never reached vLLM's utility_results"
        time.sleep(0.01)


def _held_call(cut: ClientUnderTest) -> tuple[int, concurrent.futures.Future[Any]]:
    """A utility call held pending by a SIGSTOPped engine."""
    pid = cut.engine_pid
    assert pid is not None
    assert cut.call_utility("echo", 0) == 0
    stop_process(pid)
    fut = cut.submit("call_utility", "echo", "pending")
    _wait_pending(cut, 1)
    return pid, fut


@pytest.mark.parametrize("cut", ["async"], indirect=True)
@pytest.mark.xfail(strict=True, raises=TimeoutError,
                   reason="finding 1: a utility call pending at the engine's death is never"
                          " failed (reference §6.3, PR #56416)")
def test_finding_1_pending_call_fails_on_engine_death(cut: ClientUnderTest) -> None:
    pid, fut = _held_call(cut)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        fut.result(timeout=_WOKEN_S)


@pytest.mark.parametrize("cut", ["sync"], indirect=True)
@pytest.mark.xfail(strict=True, raises=TimeoutError,
                   reason="finding 2: the sync receiver stops on a monitor-detected death"
                          " without queueing an error (reference §6.2)")
def test_finding_2_blocked_read_wakes_on_engine_death(cut: ClientUnderTest) -> None:
    pid = cut.engine_pid
    assert pid is not None
    fut = cut.submit("get_output")
    time.sleep(0.2)  # blocked in vLLM's outputs_queue (nothing is live: nothing comes)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        fut.result(timeout=_WOKEN_S)


@pytest.mark.parametrize("cut", ["sync", "async"], indirect=True)
@pytest.mark.xfail(strict=True, raises=TimeoutError,
                   reason="finding 3: a utility call pending at shutdown is never failed"
                          " (PR #56416's 'on shutdown' case)")
def test_finding_3_pending_call_fails_at_shutdown(cut: ClientUnderTest) -> None:
    # Once, this returned 'pending': the factory's engine manager resumed the stopped engine
    # before its SIGTERM (vLLM's does not), and the engine answered. Now it stays blocked.
    pid, fut = _held_call(cut)
    try:
        cut.client.shutdown(timeout=0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    with pytest.raises((ClientClosedError, EngineDeadError)):  # Declared.CLOSED_IS_DEAD
        fut.result(timeout=_WOKEN_S)


@pytest.mark.parametrize("cut", ["sync"], indirect=True)
def test_finding_4_shutdown_leaves_exactly_the_zmq_context(cut: ClientUnderTest) -> None:
    # What Declared.ZMQ_CONTEXT_OUTLIVES_SHUTDOWN excuses, and no more: the context of a
    # client that ran a request (io_threads=2: three pollers, four mailboxes) stays open
    # after shutdown and goes when the client object is collected.
    cut.shutdown()  # the fixture's client: its first-use costs are paid
    del cut
    gc.collect()
    before = ResourceSnapshot.take()
    client = VllmFactory("sync")()
    client.add_request(request("r", 4))
    collect(client, ["r"])
    client.shutdown()
    kept = Counter({"anon_inode:[eventfd]": 4, "anon_inode:[eventpoll]": 3})
    # Whatever shutdown closes goes within the bound; the context's fds stay.
    wait_until(lambda: fd_targets() - before.fd_targets == kept, 5.0,
               "only the zmq context's fds left after shutdown")
    assert fd_targets() - before.fd_targets == kept
    del client
    gc.collect()
    assert left_behind(before, kinds=("fds",)) == {}


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="finding 5: an undecodable output ends vLLM's receiver but not the"
                          " client: engine_dead stays False (reference §6.8's path)")
def test_finding_5_undecodable_output_kills_the_client(kind: str) -> None:
    rule = FrameRule(action=FrameAction.TRUNCATE, direction=Direction.TO_CLIENT,
                     kind=FrameKind.TOKENS, skip=1)
    d = tempfile.mkdtemp(prefix="ew-vllm-test-")
    proxy = Interposer([rule], wire="vllm").start()
    client = None
    try:
        inp, out = f"ipc://{d}/in", f"ipc://{d}/out"
        proxy.attach(inp, out)
        client = VllmFactory(kind)(input_address=inp, output_address=out,
                                   engine_connect=proxy.engine_addresses)
        client.add_request(request("r", 8))
        deadline = time.monotonic() + 30.0
        with pytest.raises(ProtocolError):
            while time.monotonic() < deadline:
                client.get_output(timeout=0.2)
        assert proxy.events == [("to_client", "tokens", "truncate")]
        # The spec: a link that delivered garbage is dead, and says so from then on.
        assert client.client.state is ClientState.DEAD, (
            f"after the decode error vLLM's client is {client.client.state}")
    finally:
        if client is not None:
            client.shutdown()
        proxy.close()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("cut", [
    pytest.param("sync", marks=pytest.mark.xfail(
        strict=True, raises=TimeoutError,
        reason="finding 6: a sync read issued after shutdown never ends (the receiver thread"
               " is gone and queued nothing)")),
    "async",  # refused: AsyncMPClient's read fails once its output task is gone
], indirect=True)
def test_finding_6_read_after_shutdown_is_refused(cut: ClientUnderTest) -> None:
    cut.add_request(request("r", 4))
    collect(cut, ["r"])
    cut.client.shutdown()
    fut = cut.submit("get_output")
    with pytest.raises((ClientClosedError, EngineDeadError)):  # Declared.CLOSED_IS_DEAD
        fut.result(timeout=_WOKEN_S)
