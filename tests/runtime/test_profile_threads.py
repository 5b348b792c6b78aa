"""``profile`` start and stop on one thread, whatever the engine is doing.

An idle engine served utility calls on its input thread and a busy one on its loop, so a
start and its stop could land on different threads, and torch's trace export then crashed
the engine (SIGSEGV) in most tries. The profiler is now a loop-thread-only utility
(``protocol/utilities.py``): 20 start/stop pairs on an idle, a busy and an alternating
engine each leave a readable trace and a live engine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from enginewire import make_client
from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
from enginewire.protocol.utilities import BY_NAME, LOOP_THREAD_METHODS
from enginewire.runtime.config import EngineConfig

torch.set_num_threads(1)
os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")

PAIRS = 20
BOUND_S = 60.0


def test_the_profiler_is_declared_loop_thread_only() -> None:
    assert BY_NAME["profile"].loop_thread and "profile" in LOOP_THREAD_METHODS


def _busy(client: object, tag: str) -> None:
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    client.add_request(EngineCoreRequest(tag, [1, 2, 3], params))  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["idle", "busy", "alternating"])
def test_start_stop_pairs_leave_a_trace_and_a_live_engine(mode: str, tmp_path: Path) -> None:
    config = EngineConfig(model="tiny", max_num_seqs=4)
    with make_client(config, multiprocess=True, asyncio=False) as client:
        for i in range(PAIRS):
            busy = mode == "busy" or (mode == "alternating" and i % 2 == 1)
            if busy:
                _busy(client, f"{mode}-{i}")
            client.profile(True, str(tmp_path), timeout=BOUND_S)
            if mode == "alternating" and not busy:
                _busy(client, f"{mode}-{i}")  # started idle, stopped busy
            path = client.profile(False, str(tmp_path), timeout=BOUND_S)
            assert path is not None and Path(path).is_file(), path
            with open(path, encoding="utf-8") as f:
                trace = json.load(f)
            assert "traceEvents" in trace, sorted(trace)[:5]
            if busy or mode == "alternating":
                client.abort_requests([f"{mode}-{i}"])
            assert client.echo("alive", timeout=BOUND_S) == "alive"
        assert client.engine_pid is not None
