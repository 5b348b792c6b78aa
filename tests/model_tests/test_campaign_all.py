"""``--client all`` is every client kind (issue 44): the one-engine kinds, the standalone engine
handed between front ends, and the data-parallel clients on two engines, each an even share of
a duration; ``--engines N`` keeps it to the data-parallel clients, mutant runs to the
one-engine kinds. The plan is checked with the runs stubbed (no engine starts), then once for
real at its smallest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from enginewire.cli import build_parser
from enginewire.testing import campaign
from enginewire.testing.campaign import ALL_CLIENTS, FE_CLIENTS, ClientResult, run_campaign
from enginewire.testing.oracle import Coverage

EVERY_KIND = [("inproc", None), ("sync", None), ("async", None), ("standalone", None),
              ("sync", (2, "mp")), ("async", (2, "mp"))]


class _Clock:
    """campaign's ``time``, advanced only by the stubbed runs: each spends its whole share."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any, float | None]]:
    made: list[tuple[str, Any, float | None]] = []
    clock = _Clock()

    def run_client(kind: str, *, dp: Any = None, duration: float | None = None,
                   **kw: Any) -> tuple[ClientResult, Coverage]:
        made.append((kind, dp, duration))
        clock.now += duration or 0.0
        return ClientResult(kind, examples=1), Coverage()

    monkeypatch.setattr(campaign, "_run_client", run_client)
    monkeypatch.setattr(campaign, "time", clock)
    return made


def _report(results: Path) -> dict[str, Any]:
    (path,) = results.glob("campaign-*.json")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_all_runs_every_client_kind_each_an_even_share(
        runs: list[tuple[str, Any, float | None]], tmp_path: Path) -> None:
    assert run_campaign(client="all", duration=60.0, results_dir=str(tmp_path)) == 0
    assert [(k, dp) for k, dp, _ in runs] == EVERY_KIND
    assert [share for *_, share in runs] == [10.0] * 6
    clients = _report(tmp_path)["clients"]
    assert [c["client"] for c in clients] == list(ALL_CLIENTS) == [
        "inproc", "sync", "async", "standalone", "dp-sync", "dp-async"]
    assert [c["engine_cores"] for c in clients] == [1, 1, 1, 1, 2, 2]


def test_all_with_engines_is_the_data_parallel_clients_on_that_many(
        runs: list[tuple[str, Any, float | None]], tmp_path: Path) -> None:
    assert run_campaign(client="all", engines=3, results_dir=str(tmp_path)) == 0
    assert [(k, dp) for k, dp, _ in runs] == [("sync", (3, "mp")), ("async", (3, "mp"))]
    assert [c["client"] for c in _report(tmp_path)["clients"]] == ["sync", "async"]


def test_a_mutant_run_on_all_offers_every_kind(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    asked: list[list[str]] = []

    def run_mutant(name: str, kinds: list[str], **kw: Any) -> dict[str, Any]:
        asked.append(kinds)
        return {"detected": False, "applicable": False, "detail": "stub"}

    monkeypatch.setattr(campaign, "run_mutant", run_mutant)
    run_campaign(client="all", mutant="duplicate_live_id_accepted", results_dir=str(tmp_path))
    # Every kind is offered, the two front ends' machine too; run_mutant keeps those the
    # mutant's bank entry names (the membership class's are the data-parallel ones).
    assert asked == [[*ALL_CLIENTS, FE_CLIENTS[0]]]


def test_the_help_says_what_all_runs() -> None:
    (camp,) = [a for a in build_parser()._actions if getattr(a, "choices", None)
               and "campaign" in a.choices]  # type: ignore[operator]
    text = " ".join(camp.choices["campaign"].format_help().split())  # type: ignore[index]
    for kind in ("inproc", "sync", "async", "standalone", "dp-sync", "dp-async", "2 engines"):
        assert kind in text, kind


@pytest.mark.slow
def test_all_at_its_smallest_runs_and_reports_every_kind(tmp_path: Path) -> None:
    assert run_campaign(client="all", examples=1, steps=3, seed=1,
                        results_dir=str(tmp_path)) == 0
    report = _report(tmp_path)
    assert [c["client"] for c in report["clients"]] == list(ALL_CLIENTS)
    assert all(c["failure"] is None and c["steps"] >= 1 for c in report["clients"])
    per = report["coverage"]["per_machine"]
    assert per["membership"]["reached"] >= 1 and per["attach"]["reached"] >= 1
