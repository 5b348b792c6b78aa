"""runtime/faults.py: fault specs, the injector, and faults fired inside real engines."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import torch

from enginewire.faults import (
    Fault,
    FaultAction,
    FaultInjector,
    FaultPlan,
    FaultPoint,
    InjectedFault,
    InjectedOOM,
)
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.faults import as_plan
from enginewire.spec import EngineDeadError, UtilityError, UtilityTimeoutError
from enginewire.testing.conformance import collect, open_client, request

torch.set_num_threads(1)
os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")
CONFIG = EngineConfig(model="tiny", max_num_seqs=4)


def test_legacy_spec_strings_still_parse() -> None:
    assert Fault.parse("forward:3") == Fault(point=FaultPoint.FORWARD, at=3)
    assert Fault.parse("utility:echo:2") == Fault(point=FaultPoint.UTILITY, method="echo", at=2)
    assert Fault.parse("step") == Fault(point=FaultPoint.STEP)


def test_spec_round_trips_through_str_and_msgpack() -> None:
    f = Fault.parse("output_send:2:delay:0.5")
    assert f.action is FaultAction.DELAY and f.arg == 0.5
    assert Fault.parse(str(f)) == f
    plan = FaultPlan(faults=[f, Fault.parse("step:5:sigkill")], allow_arm=True)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=FaultPlan) == plan
    assert as_plan("forward:3,sleep:1:oom") == FaultPlan.parse("forward:3,sleep:1:oom")
    assert as_plan(f) == FaultPlan(faults=[f])


@pytest.mark.parametrize("bad", ["nowhere:1", "step:0", "step:1:explode", "step:1:raise:1:x"])
def test_bad_specs_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        Fault.parse(bad)


def test_method_only_narrows_the_utility_point() -> None:
    with pytest.raises(ValueError):
        Fault(point=FaultPoint.STEP, method="echo")


def test_injector_fires_once_on_the_nth_hit() -> None:
    inj = FaultInjector(FaultPlan.parse("step:3,utility:echo:1"))
    inj("step")
    inj("step")
    with pytest.raises(InjectedFault):
        inj("step")
    inj("step")  # fired faults are disarmed
    inj("utility:get_stats")  # another utility does not count
    with pytest.raises(InjectedFault):
        inj(FaultPoint.UTILITY.value + ":echo")
    assert [str(f) for f in inj.fired] == ["step:3:raise", "utility:echo:1:raise"]


def test_oom_reads_as_kv_exhaustion_on_cpu_and_delay_returns() -> None:
    inj = FaultInjector(FaultPlan.parse("forward:1:oom,step:1:delay:0.01"), device="cpu")
    t0 = time.monotonic()
    inj("step")
    assert time.monotonic() - t0 >= 0.01
    with pytest.raises(InjectedOOM, match="KV-cache"):
        inj("forward")


def test_oom_on_a_cuda_engine_raises_torchs_cuda_oom_type() -> None:
    # Only the type is chosen here (no CUDA needed); tests/faults/test_cuda_oom.py fires it
    # inside real CUDA engines.
    inj = FaultInjector(FaultPlan.parse("forward:1:oom"), device="cuda:0")
    with pytest.raises(torch.cuda.OutOfMemoryError, match="CUDA out of memory"):
        inj("forward")


def test_record_path_gets_the_fire_time(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "log")
    inj = FaultInjector(FaultPlan(faults=[Fault.parse("step:1:delay:0")], record_path=path))
    before = time.monotonic()
    inj("step")
    stamp, spec = open(path).read().split()
    assert before <= float(stamp) <= time.monotonic() and spec == "step:1:delay:0"


def test_in_process_engine_dies_on_an_injected_forward_fault() -> None:
    with open_client("inproc", CONFIG) as cut:
        cut.client.engine.fault_hook = FaultInjector(FaultPlan.parse("forward:2"))
        cut.add_request(request("r", 10))
        with pytest.raises(EngineDeadError) as info:
            collect(cut, ["r"])
        assert isinstance(info.value.__cause__, InjectedFault)


def test_arm_fault_exists_only_when_the_plan_allows_it() -> None:
    # One engine, two facts: a plan without allow_arm hides the utility (checked on the
    # in-process engine, same allow-list code), a plan with it arms a SIGSTOP at run time;
    # the hung engine then times the call out and the heartbeat declares it dead.
    with open_client("inproc", CONFIG) as cut:
        with pytest.raises(UtilityError, match="no such utility"):
            cut.call_utility("arm_fault", "step:1")
    plan = FaultPlan(allow_arm=True)
    with open_client("sync", CONFIG, engine_fault=plan, engine_heartbeat_timeout_s=1.0,
                     shutdown_timeout_s=1.0) as cut:
        assert cut.call_utility("arm_fault", "utility:echo:1:sigstop") == "utility:echo:1:sigstop"
        t0 = time.monotonic()
        with pytest.raises(UtilityTimeoutError):
            cut.call_utility("echo", 1, timeout=0.3)
        assert cut.get_output(timeout=0.05).outputs == []  # get_output(timeout) returns
        deadline = time.monotonic() + 5.0
        with pytest.raises(EngineDeadError) as info:
            while time.monotonic() < deadline:
                cut.get_output(timeout=0.1)
        assert "heartbeat" in str(info.value.__cause__)
        assert time.monotonic() - t0 < 3.0
        pid = cut.engine_pid
        assert pid is not None
        os.kill(pid, 18)  # SIGCONT: the harness resumes what it stopped
