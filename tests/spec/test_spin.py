"""SPIN on the committed Promela model: every property holds; negative controls are rejected.

Skipped where SPIN is not installed, except in CI (``CI`` set), where that is a failure.
The full sweep of negative controls runs in ``enginewire spec check`` and under ``-m slow``.
"""

from __future__ import annotations

import inspect
import os
import re

import pytest

from enginewire._tools.generate import ROOT
from enginewire.spec.compose import BUGS
from enginewire.spec.explore import ExploreResult
from enginewire.spec.properties import PROPERTIES, control_targets
from enginewire.testing import spec_check
from enginewire.testing.spec_check import run_spin, spin_available

if not spin_available():
    if os.environ.get("CI"):
        raise RuntimeError("SPIN and gcc are required in CI (apt-get install spin)")
    pytest.skip("spin not installed", allow_module_level=True)

PML = (ROOT / "spec" / "enginewire.pml").read_text()
# One control per kind of breakage in the default run: a safety flag, a state invariant and
# two liveness obligations; the rest are marked slow.
QUICK = ("late_reply_resolves", "forget_pending_on_death", "drop_failed_reply", "shutdown_no_kill",
         "cancelled_wait_unanswered")


@pytest.mark.slow
def test_spin_proves_every_property_of_the_committed_model(composed: ExploreResult) -> None:
    results = run_spin([p.name for p in PROPERTIES], pml=PML)
    failed = [r for r in results if r.errors]
    assert not failed, "\n\n".join(f"{r.prop}:\n{r.output[-3000:]}" for r in failed)
    # The explorer and SPIN see the same model: same number of reachable worlds (SPIN adds
    # the init process's two table-filling states).
    safety_states = {r.states for r in results if r.prop == "spec_conformance"}
    assert safety_states == {composed.states + 2}


@pytest.mark.parametrize(
    "bug", [pytest.param(b, marks=() if b in QUICK else pytest.mark.slow) for b in BUGS]
)
def test_spin_rejects_each_negative_control(bug: str) -> None:
    targets = control_targets()[bug]
    results = run_spin(list(targets), bug, pml=PML, jobs=1)
    for r in results:
        assert r.errors > 0, f"SPIN accepts {bug} for {r.prop}: the property is vacuous"
        # The trail replays (spin -t) into the actor steps that lead to the violation.
        assert f"SPIN trail for {r.prop}:" in r.output, r.output[-2000:]
        assert re.search(r"\n\s+1\. \w+ ", r.output), r.output[-2000:]


def test_the_header_command_names_the_fairness_bound_pan_needs() -> None:
    # pan's default NFAIR=2 cannot hold the seven processes ("too many processes"); the
    # two-engine model's ten need 4, and the front-end model's nine take 4 too.
    from enginewire.spec import promela, promela_dp, promela_fe

    assert (promela.NFAIR, promela_dp.NFAIR, promela_fe.NFAIR) == (3, 4, 4)
    header = PML.split("*/", 1)[0]
    assert "gcc -O2 -DNFAIR=3 -o pan pan.c" in header
    dp_header = (ROOT / "spec" / "enginewire_dp.pml").read_text().split("*/", 1)[0]
    assert "gcc -O2 -DNFAIR=4 -o pan pan.c" in dp_header
    assert "-DNFAIR={nfair}" in inspect.getsource(spec_check._compile)
    fe_header = (ROOT / "spec" / "enginewire_fe.pml").read_text().split("*/", 1)[0]
    assert "gcc -O2 -DNFAIR=4 -o pan pan.c" in fe_header
    assert ("nfair=promela_fe.NFAIR if fe else promela_dp.NFAIR if dp"
            in inspect.getsource(spec_check.run_spin))
