"""The monitor against vLLM 0.33's real clients (issue 48): a campaign with ``--monitor`` on
the vLLM factory reports the client-side coverage those clients record no trace of
(docs/vllm.md, "Left to do": it was 0). Skipped where vLLM is not installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from enginewire.testing.campaign import run_campaign
from enginewire.testing.vllm_factory import vllm_available

_WHY = vllm_available()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"needs vLLM 0.33 ({_WHY})")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_monitored_campaign_reports_vllm_s_client_side_coverage(kind: str,
                                                                  tmp_path: Path) -> None:
    run_campaign(client=kind, factory=f"enginewire.testing.vllm_factory:vllm_{kind}",
                 examples=2, steps=10, seed=1, faults=False, results_dir=str(tmp_path),
                 monitor=True)
    (path,) = tmp_path.glob("campaign-*.json")
    report = json.loads(path.read_text())
    (client,) = report["clients"]
    assert client["monitor"]["links"] >= 1
    assert client["monitor"]["frames"]["to_engine"] > 0
    reached = report["monitor"]["coverage"]["per_machine"]
    for machine in ("client", "client_request", "utility"):
        assert reached[machine]["reached"] > 0, (machine, reached)
