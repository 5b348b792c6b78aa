"""The engine's own trace and ``drain_trace`` (issue 30, "the engine's side of the spec"): the
bounded record (runtime/_engine_trace.py), the utility on the engine core, the in-process
client, an engine process in trace mode, and a data-parallel client (one reply per engine)."""

from __future__ import annotations

from typing import Any

import pytest

from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
from enginewire.protocol.records import TraceDrain
from enginewire.runtime._engine_trace import (
    ENGINE_TRACE_ENV,
    TRACE_BOUND,
    EngineTrace,
    trace_from_env,
)
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine import EngineCore
from enginewire.runtime.factory import make_client
from enginewire.spec import MACHINES, EngineState, TraceEntry, UtilityError, validate_trace

NULL = EngineConfig(model="null", device="cpu")


def _records(reply: TraceDrain) -> list[tuple[str, str, str, str, str]]:
    return list(zip(reply.machine, reply.before, reply.event, reply.after, reply.subject,
                    strict=True))


def _run(client: Any, rid: str, n: int = 3) -> None:
    client.add_request(EngineCoreRequest(rid, [3, 4], SamplingParams(max_tokens=n)))
    for _ in range(1000):
        if rid in (client.get_output(timeout=5).finished_requests or ()):
            return
    raise AssertionError(f"{rid} did not finish")


def _entry(machine: str, before: str, event: str, after: str) -> TraceEntry:
    return (machine, before, event, after, 0.0)


# --- the record ------------------------------------------------------------------------------


def test_the_record_is_bounded_and_counts_what_it_drops() -> None:
    sink: list[TraceEntry] = []
    trace = EngineTrace(bound=2, sink=sink)
    trace.append(_entry("engine", "IDLE", "WORK_ARRIVED", "RUNNING"))
    trace.for_request("r1").append(_entry("engine_request", "UNKNOWN", "ADD", "WAITING"))
    trace.append(_entry("engine", "RUNNING", "ALL_FINISHED", "IDLE"))
    assert len(sink) == 3 and len(trace) == 0  # the caller's list gets all; the record none
    first = trace.drain(source="e", state=EngineState.PAUSED)
    assert (first.source, first.state) == ("e", EngineState.PAUSED)  # as the engine says
    assert _records(first) == [("engine", "IDLE", "WORK_ARRIVED", "RUNNING", ""),
                               ("engine_request", "UNKNOWN", "ADD", "WAITING", "r1")]
    assert (first.dropped, first.bound) == (1, 2)
    # A drain forgets what it handed out, drops included.
    again = trace.drain(source="e", state=EngineState.IDLE)
    assert _records(again) == [] and again.dropped == 0


@pytest.mark.parametrize("bound", [0, -1, True, 1.5])
def test_a_bad_bound_is_refused(bound: Any) -> None:
    with pytest.raises(ValueError, match="trace bound"):
        EngineTrace(bound=bound)


@pytest.mark.parametrize(("raw", "bound"), [("", None), ("0", None), ("off", None),
                                            ("1", TRACE_BOUND), ("on", TRACE_BOUND),
                                            ("500", 500)])
def test_trace_mode_from_the_environment(monkeypatch: pytest.MonkeyPatch, raw: str,
                                         bound: int | None) -> None:
    monkeypatch.setenv(ENGINE_TRACE_ENV, raw)
    trace = trace_from_env()
    assert (None if trace is None else trace.bound) == bound


@pytest.mark.parametrize("raw", ["-3", "lots"])
def test_a_bad_trace_setting_names_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                raw: str) -> None:
    monkeypatch.setenv(ENGINE_TRACE_ENV, raw)
    with pytest.raises(ValueError, match=ENGINE_TRACE_ENV):
        trace_from_env()


# --- the engine core and the in-process client ------------------------------------------------


def test_an_engine_without_a_trace_refuses_to_drain() -> None:
    engine = EngineCore(NULL)
    try:
        with pytest.raises(UtilityError, match="records no trace"):
            engine.call_utility("drain_trace")
    finally:
        engine.shutdown()


def test_the_engine_core_hands_out_its_records_in_order() -> None:
    trace: list[TraceEntry] = []
    engine = EngineCore(NULL, trace=trace)
    try:
        engine.add_request(EngineCoreRequest("a", [3, 4], SamplingParams(max_tokens=2)))
        engine.reject_request("bad", "malformed request: test")
        while engine.has_unfinished_requests() or engine.has_pending_outputs():
            engine.step()
        reply = engine.call_utility("drain_trace")
        assert isinstance(reply, TraceDrain)
        recs = _records(reply)
        assert recs[0] == ("engine", "CONSTRUCTING", "BUILT", "IDLE", "")
        assert [r[2] for r in recs if r[4] == "a"] == ["ADD", "SCHEDULE", "LENGTH"]
        assert [r[2:] for r in recs if r[4] == "bad"] == [("REJECT", "FINISHED_ERROR", "bad")]
        assert reply.state is EngineState.IDLE and reply.dropped == 0
        # The caller's own list got the same steps, timestamps and all.
        assert [e[:4] for e in trace] == [r[:4] for r in recs]
        other = EngineCore(NULL, trace=[])
        assert other.call_utility("drain_trace").source != reply.source
        other.shutdown()
    finally:
        engine.shutdown()


def test_the_in_process_client_drains_its_engine_in_trace_mode() -> None:
    with make_client(NULL, multiprocess=False, asyncio=False, trace=[]) as client:
        _run(client, "a")
        reply = client.drain_trace(timeout=5)
        assert ("engine_request", "RUNNING", "LENGTH", "FINISHED_LENGTH", "a") in _records(reply)
        assert client.drain_trace().machine == ()
    with make_client(NULL, multiprocess=False, asyncio=False) as client:
        with pytest.raises(UtilityError, match="records no trace"):
            client.drain_trace()


# --- an engine process, and one per engine of a data-parallel client --------------------------


def test_an_engine_process_in_trace_mode_drains_its_start_and_session(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_TRACE_ENV, "on")
    with make_client(NULL, multiprocess=True, asyncio=False) as client:
        _run(client, "a")
        reply = client.drain_trace(timeout=30)
        recs = _records(reply)
        steps = [r[:4] for r in recs]
        for step in [("engine", "CONSTRUCTING", "BUILT", "CONSTRUCTING"),
                     ("engine", "CONSTRUCTING", "HANDSHAKE_SENT", "READY"),
                     ("engine", "READY", "LOOP_STARTED", "IDLE"),
                     ("session", "NO_FRONT_END", "ATTACH_ACCEPTED", "ATTACHED"),
                     ("engine_request", "RUNNING", "LENGTH", "FINISHED_LENGTH")]:
            assert step in steps
        entries = [(*r[:4], float(i)) for i, r in enumerate(recs)]
        for machine in MACHINES:
            validate_trace(machine, entries)
        # Rebuilt from the wire as the record, its state the enum member.
        assert isinstance(reply, TraceDrain) and reply.state is EngineState.IDLE


def test_past_the_bound_an_engine_process_counts_its_drops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_TRACE_ENV, "3")
    with make_client(NULL, multiprocess=True, asyncio=False) as client:
        _run(client, "a")
        first = client.drain_trace(timeout=30)
        assert len(first.machine) == 3 and first.dropped > 0 and first.bound == 3
        _run(client, "b")  # ADD, WORK_ARRIVED, SCHEDULE, LENGTH, ALL_FINISHED: 5 > 3
        second = client.drain_trace(timeout=30)
        assert _records(second)[0] == ("engine_request", "UNKNOWN", "ADD", "WAITING", "b")
        assert second.dropped == 2


def test_an_engine_process_not_in_trace_mode_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_TRACE_ENV, raising=False)
    with make_client(NULL, multiprocess=True, asyncio=False) as client:
        with pytest.raises(UtilityError, match="records no trace"):
            client.drain_trace(timeout=30)


def test_a_data_parallel_client_drains_each_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_TRACE_ENV, "on")
    cfg = EngineConfig(model="null", device="cpu", data_parallel_size=2)
    with make_client(cfg, multiprocess=True, asyncio=False) as client:
        replies = client.drain_trace(timeout=30)
        assert isinstance(replies, list) and len(replies) == 2
        assert len({r.source for r in replies}) == 2
        for r in replies:
            assert ("engine", "READY", "LOOP_STARTED", "IDLE", "") in _records(r)


# --- the config option (EngineConfig.engine_trace_records) ----------------------------------


@pytest.mark.parametrize("records", [-1, True, 1.5, 10_000_001])
def test_a_bad_trace_records_setting_is_refused(records: Any) -> None:
    with pytest.raises(ValueError, match="engine_trace_records"):
        EngineConfig(model="null", device="cpu", engine_trace_records=records)


@pytest.mark.parametrize("multiprocess", [False, True])
def test_the_config_asks_for_a_bounded_trace_without_the_environment(
        monkeypatch: pytest.MonkeyPatch, multiprocess: bool) -> None:
    monkeypatch.delenv(ENGINE_TRACE_ENV, raising=False)
    cfg = EngineConfig(model="null", device="cpu", engine_trace_records=4)
    with make_client(cfg, multiprocess=multiprocess, asyncio=False) as client:
        _run(client, "a")
        first = client.drain_trace(timeout=30)
        assert first.bound == 4 and len(first.machine) == 4 and first.dropped > 0
        _run(client, "b")
        recs = _records(client.drain_trace(timeout=30))
        assert recs[0] == ("engine_request", "UNKNOWN", "ADD", "WAITING", "b")


def test_the_environment_still_wins_over_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_TRACE_ENV, "7")
    cfg = EngineConfig(model="null", device="cpu", engine_trace_records=4)
    with make_client(cfg, multiprocess=True, asyncio=False) as client:
        assert client.drain_trace(timeout=30).bound == 7


# --- the no-op abort of an id nobody holds (spec/request.py, rule 2) --------------------------


@pytest.mark.parametrize("multiprocess", [False, True])
def test_an_abort_of_a_finished_or_unknown_id_records_the_unknown_loop_on_both_sides(
        monkeypatch: pytest.MonkeyPatch, multiprocess: bool) -> None:
    monkeypatch.setenv(ENGINE_TRACE_ENV, "on")
    trace: list[TraceEntry] = []
    with make_client(NULL, multiprocess=multiprocess, asyncio=False, trace=trace) as client:
        _run(client, "done")
        client.drain_trace(timeout=30)
        del trace[:]
        # The drain below travels behind the abort on the same input path.
        client.abort_requests(["done", "never-sent", "done"])
        client_loops = [e[:4] for e in trace if e[0] == "client_request"]
        assert client_loops == [("client_request", "UNKNOWN", "ABORT_SENT", "UNKNOWN")] * 3
        recs = [r for r in _records(client.drain_trace(timeout=30))
                if r[0] == "engine_request"]
        assert recs == [("engine_request", "UNKNOWN", "ABORT", "UNKNOWN", rid)
                        for rid in ("done", "never-sent", "done")]
        # A reused id starts a new instance in UNKNOWN on both sides.
        _run(client, "done")
        assert ("client_request", "UNKNOWN", "SEND", "SENT") in [e[:4] for e in trace]


def test_without_a_trace_an_unknown_abort_costs_no_lifecycle() -> None:
    with make_client(NULL, multiprocess=False, asyncio=False) as client:
        client.abort_requests(["never-sent"])  # nothing to record, nothing raised
        assert client.get_output().outputs == []
