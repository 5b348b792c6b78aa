"""The OOM fault on a CUDA engine: torch's own CUDA out-of-memory type, fatal in the forward,
a failed call inside a utility. Skipped without CUDA; ``scripts/gpu_check.sh`` runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from enginewire.faults import (
    Cell,
    Fault,
    FaultAction,
    FaultInjector,
    FaultPlan,
    FaultPoint,
    run_fault_matrix,
)
from enginewire.runtime.config import EngineConfig
from enginewire.spec import EngineDeadError, UtilityError
from enginewire.testing.conformance import collect, open_client, request
from enginewire.testing.fault_matrix import DEATH_BOUND_S, Scenario

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_config() -> EngineConfig:
    # A small KV share: the GPU may be shared, and the tiny model needs little.
    return EngineConfig(model="tiny", device="cuda", gpu_memory_utilization=0.05,
                        max_num_gpu_blocks=1 << 12, max_num_seqs=4)


def test_in_process_forward_oom_is_torchs_cuda_oom() -> None:
    with open_client("inproc", cuda_config()) as cut:
        engine = cut.client.engine
        assert str(engine.device).startswith("cuda")
        engine.fault_hook = FaultInjector(FaultPlan.parse("forward:2:oom"),
                                          device=str(engine.device))
        cut.add_request(request("r", 10))
        with pytest.raises(EngineDeadError) as info:
            collect(cut, ["r"])
        assert isinstance(info.value.__cause__, torch.cuda.OutOfMemoryError)


def test_in_process_utility_oom_fails_only_the_call() -> None:
    with open_client("inproc", cuda_config()) as cut:
        engine = cut.client.engine
        engine.fault_hook = FaultInjector(FaultPlan.parse("utility:echo:1:oom"),
                                          device=str(engine.device))
        with pytest.raises(UtilityError, match="OutOfMemoryError"):
            cut.call_utility("echo", 1)
        assert cut.call_utility("echo", 2) == 2


def test_cuda_oom_cells_of_the_matrix_on_a_subprocess_engine(tmp_path: Path) -> None:
    # The engine process builds its injector with its own device, so OOM there is CUDA OOM:
    # fatal in the forward (seen within the death bound), a failed call in sleep.
    cells = [
        Cell("sync", Scenario.GENERATE, Fault(point=FaultPoint.FORWARD, at=3,
                                              action=FaultAction.OOM)),
        Cell("sync", Scenario.SLEEP, Fault(point=FaultPoint.SLEEP, action=FaultAction.OOM)),
    ]
    status = run_fault_matrix(["sync"], results_dir=str(tmp_path), config=cuda_config(),
                              cells=cells, extra_cells=[], echo=None)
    report = json.loads((tmp_path / "fault_matrix.json").read_text())
    assert status == 0, report
    dead, failed_call = report["results"]
    assert dead["outcome"] == "dead" and dead["latency_ms"] <= DEATH_BOUND_S * 1000
    assert failed_call["outcome"] == "utility_error"
    assert "OutOfMemoryError" in failed_call["detail"]
