"""Frame integrity on an engine serving several front ends: each front end's link numbers
its own messages (runtime/integrity.py), so neither sees the other's as lost; and one front
end's input failing the check ends its session only."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import msgspec
import pytest

from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine_proc import process_main
from enginewire.spec.errors import EngineDeadError
from enginewire.testing._harness import wait_until
from enginewire.testing.conformance import collect, open_client

NULL = EngineConfig(model="null", max_model_len=2048, null_step_delay_s=0.01)
BOUND_S = 30.0


@pytest.fixture(autouse=True, scope="module")
def _resource_tracker() -> None:
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def test_two_front_ends_with_frame_integrity(tmp_path: Path) -> None:
    pairs = [(f"ipc://{tmp_path}/in{i}", f"ipc://{tmp_path}/out{i}") for i in range(2)]
    mp = multiprocessing.get_context("spawn")
    proc = mp.Process(target=process_main, daemon=True, args=(
        type(NULL), msgspec.msgpack.encode(NULL), {
            "input_address": [p[0] for p in pairs], "output_address": [p[1] for p in pairs],
            "heartbeat_interval_s": 0.1, "integrity": True, "front_end_timeout_s": 1.5}))
    proc.start()
    cuts = []
    try:
        for i in range(2):
            cuts.append(open_client("sync", NULL, launch_engine=False, client_index=i,
                                    input_address=pairs[i][0], output_address=pairs[i][1],
                                    frame_integrity=True, ready_timeout_s=BOUND_S))
        a, b = cuts
        # Both stream at once, with heartbeats going both ways, for a second: a shared
        # sequence counter made each see the other's messages as lost within a few.
        a.add_request(EngineCoreRequest("r1", [1, 2, 3], SamplingParams(max_tokens=100)))
        b.add_request(EngineCoreRequest("r1", [1, 2, 3], SamplingParams(max_tokens=100)))
        assert len(collect(a, ["r1"], BOUND_S)["r1"].tokens) == 100
        assert len(collect(b, ["r1"], BOUND_S)["r1"].tokens) == 100
        assert a.call_utility("echo", 1) == 1 and b.call_utility("echo", 2) == 2
        # Garbage on b's input fails its check: b's session ends, a serves on.
        b.add_request(EngineCoreRequest("r2", [1, 2, 3], SamplingParams(max_tokens=2000)))
        b.client.send_raw_frames([b"\x07\x90"])
        with pytest.raises(EngineDeadError):
            b.call_utility("echo", 3, timeout=BOUND_S)
        assert wait_until(lambda: a.call_utility("get_stats").num_live == 0, BOUND_S)
        assert a.call_utility("echo", 4) == 4
    finally:
        for cut in cuts:
            cut.shutdown()
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(BOUND_S)
        if proc.is_alive():
            proc.kill()
            proc.join(BOUND_S)
