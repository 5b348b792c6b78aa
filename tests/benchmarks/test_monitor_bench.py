"""``enginewire bench --only monitor`` (issue 48's cost row) in a tiny configuration: the rows
have the promised shape, both paths delivered every token, the monitor judged the traffic
clean, and the clients, engines and the monitor's process are gone afterwards. No speed is
asserted (speed targets never live in timed tests: on a shared 2-vCPU runner these figures
are noise)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from enginewire.benchmarks import monitor, run
from enginewire.benchmarks.ipc import MAX_TOKENS
from enginewire.testing._harness import ResourceSnapshot, assert_released

_ROW_KEYS = {"section", "name", "unit", "ours", "ours_spread", "floor", "floor_spread", "ratio"}


@pytest.fixture(autouse=True, scope="module")
def _resource_tracker() -> None:
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # kept by the first spawn: not a leak


def _check(rows: list[dict[str, Any]], ks: tuple[int, ...], reps: int) -> None:
    # The echo rows (through the monitor / direct, direct / raw; p50 and p99), then per K
    # the delivery rows (through the monitor / direct, direct / floor).
    assert len(rows) == 4 + 2 * len(ks), [r["name"] for r in rows]
    for row in rows:
        assert _ROW_KEYS <= row.keys(), row
        assert row["section"] == "monitor"
        for x in (row["ours"], row["floor"], row["ratio"]):
            assert math.isfinite(x) and x > 0, row
        lo, hi = row["ours_spread"]
        assert lo <= row["ours"] <= hi or math.isclose(lo, hi), row
        # The monitor judged everything it relayed, and found nothing wrong with it.
        verdict = row["monitor"]
        assert verdict["violations"] == [] and verdict["internal_errors"] == [], verdict
        assert verdict["frames"]["output"] > 0 and verdict["frames"]["to_engine"] > 0
    echo = rows[:4]
    assert [r["unit"] for r in echo] == ["µs"] * 4
    assert [r["name"].rsplit(" / ", 1)[1] for r in echo] == ["direct", "direct", "raw", "raw"]
    assert [r.get("key") for r in echo] == ["monitor_echo_p50", None, None, None]
    assert echo[0]["floor"] == echo[2]["ours"]  # the same direct samples, against both
    assert echo[0]["added_us"] == pytest.approx(echo[0]["ours"] - echo[0]["floor"])
    for k, (through, direct) in zip(ks, zip(rows[4::2], rows[5::2], strict=True), strict=True):
        assert through["key"] == f"monitor_delivery_{k}" and direct.get("key") is None
        assert f"K={k}" in through["name"] and f"K={k}" in direct["name"]
        assert through["floor"] == direct["ours"]  # the same direct rounds, against both
        # Every token of every round, on both paths (the prefill step's are outside the
        # window on both).
        assert through["tokens_expected"] == k * (MAX_TOKENS - 1)
        assert through["tokens"] == {"direct": [k * (MAX_TOKENS - 1)] * reps,
                                     "monitor": [k * (MAX_TOKENS - 1)] * reps}


def test_monitor_rows() -> None:
    before = ResourceSnapshot.take()
    rows = monitor.bench_monitor(ks=(8, 16), reps=2, echo=(40, 20))
    _check(rows, (8, 16), 2)
    assert_released(before, kinds=("processes", "threads"))


def test_the_targets_are_counted_and_judged() -> None:
    assert run.TARGETS["monitor_echo_p50"] == ("<=", 1.5, 1.5, "ratio")
    for k in (256, 1024):
        assert run.TARGETS[f"monitor_delivery_{k}"] == (">=", 0.7, 0.7, "ratio")
    rows = [{"key": "monitor_echo_p50", "ratio": 2.0, "ours": 1.0},
            {"key": "monitor_delivery_256", "ratio": 0.9, "ours": 1.0}]
    assert not run.judge(rows)
    assert [r["pass"] for r in rows] == [False, True]


@pytest.mark.parametrize("kw", [{"reps": 0}, {"ks": ()}, {"ks": (0,)}, {"echo": (0, 10)},
                                {"reps": True}])
def test_bad_counts_are_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                       kw: dict[str, Any]) -> None:
    def no_start(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("started something before checking the arguments")

    monkeypatch.setattr(monitor, "peers", no_start)
    with pytest.raises(ValueError, match="monitor section needs"):
        monitor.bench_monitor(**kw)
