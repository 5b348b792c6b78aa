"""Harness values are checked where they are built: ``Fault``, ``FaultPlan``, ``as_plan``,
``FaultInjector.arm`` (runtime/faults.py) and ``FrameRule``, ``Interposer``
(model_tests/interposer.py). A string works like the enum member it names; anything else fails
at construction with a message naming the field, never later inside an engine or proxy thread.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from enginewire.faults import (
    Direction,
    Fault,
    FaultAction,
    FaultInjector,
    FaultPlan,
    FaultPoint,
    FrameAction,
    FrameKind,
    FrameRule,
    InjectedFault,
    Interposer,
)
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.faults import as_plan
from enginewire.spec import UtilityError
from enginewire.testing.conformance import open_client

os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "faults.md"

# --- Fault and FaultPlan -------------------------------------------------------------------


def test_strings_become_members_and_compare_by_value() -> None:
    by_name = Fault(point="forward", action="delay", arg=0)
    assert by_name.point is FaultPoint.FORWARD and by_name.action is FaultAction.DELAY
    assert by_name == Fault(point=FaultPoint.FORWARD, action=FaultAction.DELAY, arg=0)
    inj = FaultInjector(FaultPlan(faults=[Fault(point="forward")]))
    with pytest.raises(InjectedFault):  # it fires: the audit's AttributeError is gone
        inj("forward")


@pytest.mark.parametrize(("kwargs", "error", "names"), [
    ({"point": "nosuch"}, ValueError, "'before_ready', 'after_ready', 'step'"),
    ({"point": 3}, TypeError, "Fault.point"),
    ({"point": "step", "action": "explode"}, ValueError, "'raise', 'exit', 'sigkill'"),
    ({"point": "step", "at": 0}, ValueError, "Fault.at"),
    ({"point": "step", "at": True}, TypeError, "Fault.at"),
    ({"point": "step", "at": 1.0}, TypeError, "Fault.at"),
    ({"point": "step", "action": "delay", "arg": -1.0}, ValueError, "Fault.arg"),
    ({"point": "step", "action": "delay", "arg": math.nan}, ValueError, "Fault.arg"),
    ({"point": "step", "action": "delay", "arg": math.inf}, ValueError, "Fault.arg"),
    ({"point": "step", "action": "delay", "arg": "1"}, TypeError, "Fault.arg"),
    ({"point": "step", "action": "exit", "arg": 1.5}, ValueError, "exit status"),
    ({"point": "step", "action": "exit", "arg": 256}, ValueError, "exit status"),
    ({"point": "utility", "method": 7}, TypeError, "Fault.method"),
])
def test_bad_fault_fields_are_refused(kwargs: dict[str, Any], error: type[Exception],
                                      names: str) -> None:
    with pytest.raises(error, match=re.escape(names)):
        Fault(**kwargs)


@pytest.mark.parametrize(("kwargs", "error", "names"), [
    ({"faults": "forward:3"}, TypeError, "FaultPlan.parse"),
    ({"faults": ["forward:3"]}, TypeError, "faults[0]"),
    ({"faults": {Fault(point=FaultPoint.STEP)}}, TypeError, "FaultPlan.faults"),
    ({"allow_arm": 1}, TypeError, "allow_arm"),
    ({"record_path": 5}, TypeError, "record_path"),
])
def test_bad_plan_fields_are_refused(kwargs: dict[str, Any], error: type[Exception],
                                     names: str) -> None:
    with pytest.raises(error, match=re.escape(names)):
        FaultPlan(**kwargs)


def test_as_plan_checks_everything_before_any_engine_exists() -> None:
    # What a client calls before it spawns (audit item 7): the error names the problem.
    with pytest.raises(ValueError, match=r"'nosuch:1'.*one of 'before_ready'"):
        as_plan("nosuch:1")
    with pytest.raises(ValueError, match="hit count"):
        as_plan("step:x")
    with pytest.raises(ValueError, match=r"Fault\.arg"):
        as_plan("step:1:delay:-1")
    with pytest.raises(TypeError, match="engine_fault"):
        as_plan(42)
    # A plan whose list was changed after it was built is checked again.
    plan = FaultPlan(faults=[Fault(point=FaultPoint.STEP)])
    plan.faults.append("forward:1")
    with pytest.raises(TypeError, match="Fault values"):
        as_plan(plan)
    good = FaultPlan(faults=[Fault(point=FaultPoint.STEP)], allow_arm=True)
    assert as_plan(good) == good and as_plan("step:1") == FaultPlan.parse("step:1")


@pytest.mark.parametrize("bad", [42, ["step:1"], None, {"point": "nosuch"}, "step:1:delay:-1",
                                 {"point": "step", "action": "delay", "arg": -1}])
def test_arm_refuses_what_it_cannot_fire(bad: object) -> None:
    inj = FaultInjector(FaultPlan(allow_arm=True))
    with pytest.raises((TypeError, ValueError)):
        inj.arm(bad)
    assert inj.armed() == []
    inj("output_send")  # nothing half-armed lies in wait for a fault point


def test_bad_arm_fault_is_a_utility_error_and_the_engine_keeps_serving() -> None:
    # Audit item 5: arm_fault(42) was stored, then crashed the engine's output thread at its
    # next fault point, and every later call got EngineDeadError.
    config = EngineConfig(model="null", max_num_seqs=4)
    with open_client("sync", config, engine_fault=FaultPlan(allow_arm=True),
                     shutdown_timeout_s=5.0) as cut:
        for bad in (42, ["step:1"], {"point": "nosuch"}, "step:1:delay:-1"):
            with pytest.raises(UtilityError):
                cut.call_utility("arm_fault", bad, timeout=10.0)
            assert cut.call_utility("echo", "alive", timeout=10.0) == "alive"
        assert cut.call_utility("arm_fault", "utility:echo:1:delay:0",
                                timeout=10.0) == "utility:echo:1:delay:0"
        assert cut.call_utility("echo", "still", timeout=10.0) == "still"


# --- FrameRule and Interposer --------------------------------------------------------------


def test_frame_rule_strings_become_members() -> None:
    rule = FrameRule(action="drop", direction="to_client", kind="tokens")
    assert (rule.action, rule.direction, rule.kind) == (
        FrameAction.DROP, Direction.TO_CLIENT, FrameKind.TOKENS)
    assert rule.action is FrameAction.DROP and rule.kind is FrameKind.TOKENS
    assert rule == FrameRule(action=FrameAction.DROP, direction=Direction.TO_CLIENT,
                             kind=FrameKind.TOKENS)


@pytest.mark.parametrize(("kwargs", "error", "names"), [
    ({"action": "explode"}, ValueError, "'drop', 'delay', 'duplicate'"),
    ({"action": "drop", "direction": "sideways"}, ValueError, "'to_engine', 'to_client'"),
    ({"action": "drop", "kind": "nosuch"}, ValueError, "'add', 'abort'"),
    ({"action": 1}, TypeError, "FrameRule.action"),
    ({"action": "drop", "probability": 2}, ValueError, "probability"),
    ({"action": "drop", "probability": math.nan}, ValueError, "probability"),
    ({"action": "drop", "skip": -1}, ValueError, "skip"),
    ({"action": "drop", "count": -3}, ValueError, "count"),
    ({"action": "drop", "count": 1.5}, TypeError, "count"),
    ({"action": "delay", "delay_s": -1}, ValueError, "delay_s"),
    ({"action": "delay", "delay_s": math.inf}, ValueError, "delay_s"),
])
def test_bad_frame_rules_are_refused(kwargs: dict[str, Any], error: type[Exception],
                                     names: str) -> None:
    with pytest.raises(error, match=re.escape(names)):
        FrameRule(**kwargs)


def test_interposer_refuses_rules_that_are_not_rules() -> None:
    with pytest.raises(TypeError, match=r"Interposer\.rules"):
        Interposer(FrameRule(action=FrameAction.DROP))
    with pytest.raises(TypeError, match=r"rules\[0\]"):
        Interposer([{"action": "drop"}])


def test_interposer_makes_its_ipc_dir_only_when_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    Interposer([])  # built, never started: leaves nothing behind
    assert list(tmp_path.iterdir()) == []
    proxy = Interposer([]).start()
    inp = proxy.engine_addresses[0]
    assert inp.startswith(f"ipc://{tmp_path}/enginewire-ip-")
    proxy.close()
    proxy.close()  # idempotent
    assert list(tmp_path.iterdir()) == []


def test_an_interposer_never_closed_leaves_no_dir(tmp_path: Path) -> None:
    script = ("from enginewire.testing.interposer import Interposer\n"
              "proxy = Interposer([]).start()\n"
              "print(proxy.engine_addresses[0])\n")  # exits with the proxy thread waiting
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"ipc://{tmp_path}/enginewire-ip-")
    assert list(tmp_path.iterdir()) == []


# --- docs ----------------------------------------------------------------------------------


def test_docs_build_faults_and_rules_by_keyword() -> None:
    # Fault, FaultPlan and FrameRule are keyword-only: a positional example is a TypeError.
    text = DOCS.read_text()
    calls = re.findall(r"\b(Fault|FaultPlan|FrameRule)\(([^()]*)\)", text)
    assert calls
    for name, args in calls:
        for arg in filter(None, (a.strip() for a in args.split(","))):
            assert "=" in arg or arg == "...", f"docs/faults.md: {name}({args}) is positional"
