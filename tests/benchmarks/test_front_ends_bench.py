"""``enginewire bench --front-ends K`` (issue 47) in a tiny configuration: the rows have the
promised shape, the front-end and engine processes are gone afterwards, and bad arguments are
refused before anything is measured. No speed is asserted (speed targets never live in timed
tests: on a shared 2-vCPU runner these figures are noise)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from enginewire.benchmarks import front_ends, run
from enginewire.testing._harness import ResourceSnapshot, assert_released

_ROW_KEYS = {"section", "name", "unit", "ours", "ours_spread", "floor", "floor_spread", "ratio"}


@pytest.fixture(autouse=True, scope="module")
def _resource_tracker() -> None:
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # kept by the first spawn: not a leak


def _check(rows: list[dict[str, Any]], front_ends_: int, engines: int) -> None:
    # Per K: one front end / floor, the aggregate / one, each front end / one; then the echo
    # rows: p50 and p99 against the raw floor, then streaming against idle.
    assert len(rows) == 2 + front_ends_ + 4, [r["name"] for r in rows]
    for row in rows:
        assert _ROW_KEYS <= row.keys(), row
        assert row["section"] == "frontends"
        assert (row["front_ends"], row["engines"]) == (front_ends_, engines)
        assert (f"{engines} engines" in row["name"]) == (engines > 1), row["name"]
        for x in (row["ours"], row["floor"], row["ratio"]):
            assert math.isfinite(x) and x > 0, row
        lo, hi = row["ours_spread"]
        assert lo <= row["ours"] <= hi or math.isclose(lo, hi), row
    one, agg, *each = rows[:2 + front_ends_]
    assert one["unit"] == agg["unit"] == "tok/s" and one["key"] == "frontends_one_16"
    assert agg["key"] == ("frontends_scaling_16" if front_ends_ == 2 else None)
    assert agg["floor"] == one["ours"]  # the aggregate is set against one front end's rate
    assert len(agg["per_front_end"]) == front_ends_ == len(each)
    assert len(agg["cores_all"]["front_ends"]) == front_ends_
    assert len(agg["cores_all"]["engines"]) == len(agg["cores_alone"]["engines"]) == engines
    for j, row in enumerate(each):
        assert row["name"].startswith(f"front end {j} of {front_ends_} tokens/s K=16")
    echo = rows[2 + front_ends_:]
    assert [r["unit"] for r in echo] == ["µs"] * 4
    assert [r["name"].rsplit(" / ", 1)[1].split(",")[0] for r in echo] == [
        "raw", "raw", "others idle", "others idle"]
    assert echo[2]["floor"] == echo[0]["ours"]  # streaming against idle, the same samples


# Two engines (a data-parallel client per front end): one more engine process to start.
@pytest.mark.parametrize("engines", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_front_ends_rows(engines: int) -> None:
    before = ResourceSnapshot.take()
    rows = front_ends.bench_front_ends(2, engines, ks=(16,), reps=1, echo=(40, 20))
    _check(rows, 2, engines)
    assert_released(before, kinds=("processes", "threads"))


def test_bad_counts_are_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    def no_start(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("started something before checking the arguments")

    monkeypatch.setattr(front_ends, "_topology", no_start)
    monkeypatch.setattr(run, "_machine", no_start)
    for kw in ({"front_ends": 1}, {"front_ends": True}, {"engines": 0}):
        with pytest.raises(ValueError, match="front-ends section needs"):
            front_ends.bench_front_ends(**kw)
    with pytest.raises(ValueError, match="frontends section compares"):
        run.run_bench(quick=True, only=["frontends"], front_ends=1)
    with pytest.raises(ValueError, match="at least one engine"):
        run.collect(quick=True, only=["frontends"], front_end_engines=0)


def test_the_flags_pick_the_section_and_its_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Any, ...]] = []

    def run_bench(**kw: Any) -> int:
        run._selection(kw["only"], kw["engines"], kw["front_ends"], kw["front_end_engines"])
        seen.append((kw["only"], kw["engines"], kw["front_ends"], kw["front_end_engines"]))
        return 0

    monkeypatch.setattr(run, "run_bench", run_bench)
    for argv in (["--front-ends", "3"], ["--front-ends", "2", "--engines", "2"],
                 ["--front-ends", "2", "--engines", "1"], ["--engines", "3"], [],
                 ["--only", "dp,frontends", "--front-ends", "2", "--engines", "3"]):
        assert run.main(argv) == 0, argv
    assert seen == [(["frontends"], 2, 3, 1), (["frontends"], 2, 2, 2), (["frontends"], 1, 2, 1),
                    (["dp"], 3, 2, 3), (None, 2, 2, 1), (["dp", "frontends"], 3, 2, 3)]
    for argv in (["--front-ends", "1"], ["--front-ends", "2", "--engines", "0"],
                 ["--only", "dp,frontends", "--front-ends", "2", "--engines", "1"]):
        assert run.main(argv) == 2, argv  # bad usage, one line, before anything runs
