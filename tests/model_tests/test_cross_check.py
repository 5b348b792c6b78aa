"""The oracle's judgement of the engine's side (issue 30, "the engine's side of the spec"):
drained engine traces replayed through the spec and against what the client saw, each
request's ending, nothing left live at quiescence, the sleep state, an incomplete trace; and
the same on a live in-process client."""

from __future__ import annotations

import pytest

from enginewire.protocol.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from enginewire.protocol.records import TraceDrain
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.factory import make_client
from enginewire.spec import ClientState, EngineState, SpecViolation
from enginewire.testing.oracle import (
    ENGINE_FINISHED,
    DPOracle,
    Oracle,
    OracleViolation,
    engine_trace_entries,
)

RUNNING, SLEEPING, READY = ClientState.RUNNING, ClientState.SLEEPING, ClientState.READY
_ADD = ("engine_request", "UNKNOWN", "ADD", "WAITING")
_SCHEDULE = ("engine_request", "WAITING", "SCHEDULE", "RUNNING")


def reply(*steps: tuple[str, ...], state: EngineState = EngineState.IDLE, source: str = "1.1",
          dropped: int = 0) -> TraceDrain:
    """A drain_trace reply; a step is (machine, before, event, after[, request id])."""
    rows = [(*s, "") if len(s) == 4 else s for s in steps]
    cols = list(zip(*rows, strict=True)) if rows else [(), (), (), (), ()]
    names = ("machine", "before", "event", "after", "subject")
    return TraceDrain(state=state, source=source, dropped=dropped, bound=100,
                      **{n: tuple(c) for n, c in zip(names, cols, strict=True)})


def ran(rid: str, event: str, after: str) -> list[tuple[str, ...]]:
    """A request's whole engine lifecycle, as the engine records it."""
    return [(*_ADD, rid), ("engine", "IDLE", "WORK_ARRIVED", "RUNNING"), (*_SCHEDULE, rid),
            ("engine_request", "RUNNING", event, after, rid),
            ("engine", "RUNNING", "ALL_FINISHED", "IDLE")]


def finished(o: Oracle, rid: str, reason: FinishReason, engine: int = 0) -> None:
    """The client sees ``rid`` end with ``reason`` (a LENGTH finish with all its tokens)."""
    tokens = [5] * o.requests[rid].max_tokens if reason is FinishReason.LENGTH else []
    o.observe(EngineCoreOutputs(engine, [EngineCoreOutput(rid, tokens, reason, error=(
        "why" if reason is FinishReason.ERROR else None))]))


def baseline(o: Oracle, view: ClientState = READY) -> None:
    o.judge_engine_traces([(0, reply(("engine", "CONSTRUCTING", "BUILT", "IDLE")), view)],
                          baseline=True)


def test_the_mapping_follows_the_spec() -> None:
    assert ENGINE_FINISHED == {FinishReason.STOP: "FINISHED_STOPPED",
                               FinishReason.LENGTH: "FINISHED_LENGTH",
                               FinishReason.ABORT: "FINISHED_ABORTED",
                               FinishReason.ERROR: "FINISHED_ERROR"}


def test_both_sides_agreeing_pass_and_the_records_come_back() -> None:
    o = Oracle(exact_tokens=False)
    baseline(o)
    o.add("r1", 4, None, None)
    o.abort(["r1"])
    finished(o, "r1", FinishReason.ABORT)
    got = o.judge_engine_traces([(0, reply(
        (*_ADD, "r1"), ("engine", "IDLE", "WORK_ARRIVED", "RUNNING"),
        ("engine_request", "WAITING", "ABORT", "FINISHED_ABORTED", "r1"),
        ("engine", "RUNNING", "ALL_FINISHED", "IDLE")), RUNNING)])
    assert got[0][:4] == _ADD and [e[4] for e in got] == [0.0, 1.0, 2.0, 3.0]
    assert o.engine_pending == []


def test_an_ending_the_engine_booked_otherwise_names_both_sides() -> None:
    o = Oracle(exact_tokens=False)
    baseline(o)
    o.add("r1", 4, None, None)
    o.abort(["r1"])
    finished(o, "r1", FinishReason.ABORT)
    with pytest.raises(OracleViolation, match="'r1' finished ABORT on the client, but engine 0's"
                       " own lifecycle ended it FINISHED_ERROR") as caught:
        o.judge_engine_traces([(0, reply(
            (*_ADD, "r1"), ("engine", "IDLE", "WORK_ARRIVED", "RUNNING"),
            ("engine_request", "WAITING", "ERROR", "FINISHED_ERROR", "r1"),
            ("engine", "RUNNING", "ALL_FINISHED", "IDLE")), RUNNING)])
    # and the history of each side that led there
    assert ("its steps for that id: UNKNOWN -ADD-> WAITING; WAITING -ERROR-> FINISHED_ERROR;"
            " the client's endings: ABORT from engine 0)") in str(caught.value)


def test_a_finish_the_engine_never_made_is_a_violation() -> None:
    o = Oracle(exact_tokens=False)
    baseline(o)
    o.add("r1", 4, None, None, invalid=True)
    finished(o, "r1", FinishReason.ERROR)
    with pytest.raises(OracleViolation, match="never names it"):
        o.judge_engine_traces([(0, reply(), RUNNING)])


def test_what_came_before_the_baseline_is_not_matched() -> None:
    """A pooled engine's previous example (or a previous front end) used the same ids."""
    o = Oracle(exact_tokens=False)
    o.judge_engine_traces([(0, reply(*ran("r1", "ABORT", "FINISHED_ABORTED")), READY)],
                          baseline=True)
    o.add("r1", 2, None, None)
    finished(o, "r1", FinishReason.LENGTH)
    o.judge_engine_traces([(0, reply(*ran("r1", "LENGTH", "FINISHED_LENGTH")), RUNNING)])
    # A reused id is matched lifecycle by lifecycle, in order.
    o.add("r1", 2, None, None)
    o.abort(["r1"])
    finished(o, "r1", FinishReason.ABORT)
    with pytest.raises(OracleViolation, match="ended it FINISHED_LENGTH"):
        o.judge_engine_traces([(0, reply(*ran("r1", "LENGTH", "FINISHED_LENGTH")), RUNNING)])


def test_a_finish_still_in_flight_waits_for_the_client() -> None:
    o = Oracle(exact_tokens=False)
    baseline(o)
    o.add("r1", 2, None, None)
    o.judge_engine_traces([(0, reply(*ran("r1", "LENGTH", "FINISHED_LENGTH")), RUNNING)])
    finished(o, "r1", FinishReason.LENGTH)  # read after the drain: judged at the next one
    o.judge_engine_traces([(0, reply(), RUNNING)])
    assert o.engine_pending == []


def test_nothing_may_stay_live_in_the_engine_when_nothing_is_on_the_client() -> None:
    o = Oracle(exact_tokens=False)
    baseline(o)
    with pytest.raises(OracleViolation, match=r"trace leaves \['old'\] live"):
        o.judge_engine_traces([(0, reply((*_ADD, "old")), RUNNING)])


def test_the_two_sides_must_agree_about_sleep() -> None:
    o = Oracle(exact_tokens=False)
    baseline(o)
    paused = ("engine", "IDLE", "PAUSE_KEEP", "PAUSED")
    o.judge_engine_traces([(0, reply(paused, state=EngineState.PAUSED), SLEEPING)])
    woke = ("engine", "PAUSED", "WAKE_UP", "IDLE")
    with pytest.raises(OracleViolation, match=r"is PAUSED .* but its client is RUNNING"):
        o.judge_engine_traces([(0, reply(state=EngineState.PAUSED), RUNNING)])
    o.judge_engine_traces([(0, reply(woke), RUNNING)])
    with pytest.raises(OracleViolation, match=r"is IDLE .* but its client is SLEEPING"):
        o.judge_engine_traces([(0, reply(), SLEEPING)])


@pytest.mark.parametrize("case", ["jump", "ends_elsewhere", "request_jump", "relive"])
def test_a_trace_that_does_not_follow_itself_is_refused(case: str) -> None:
    o = Oracle(exact_tokens=False)
    baseline(o)
    bad = {
        "jump": reply(("engine", "RUNNING", "ALL_FINISHED", "IDLE")),
        "ends_elsewhere": reply(("engine", "IDLE", "WORK_ARRIVED", "RUNNING")),
        "request_jump": reply((*_ADD, "x"), ("engine_request", "RUNNING", "STOP",
                                             "FINISHED_STOPPED", "x")),
        "relive": reply((*_ADD, "x"), (*_ADD, "x")),
    }[case]
    with pytest.raises(OracleViolation, match=r"jumps|ends in"):
        o.judge_engine_traces([(0, bad, RUNNING)])


def test_a_step_the_spec_has_not_is_a_spec_violation() -> None:
    o = Oracle(exact_tokens=False)
    with pytest.raises(SpecViolation):
        o.judge_engine_traces([(0, reply(("engine", "IDLE", "DRAINED", "PAUSED")), READY)],
                              baseline=True)


def test_an_incomplete_trace_is_counted_and_no_longer_matched() -> None:
    o = Oracle(exact_tokens=False)
    baseline(o)
    o.add("r1", 2, None, None)
    finished(o, "r1", FinishReason.LENGTH)
    o.judge_engine_traces([(0, reply((*_ADD, "r1"), dropped=7), RUNNING)])
    assert o.trace_incomplete == 7 and o.engine_pending == []
    assert o.engine_sides[0].incomplete


@pytest.mark.parametrize("bad", [
    {"machine": ["engine"], "before": []},  # no record: an untyped map
    TraceDrain(state=EngineState.IDLE, machine=("engine",)),  # columns of unequal length
])
def test_a_reply_that_is_no_trace_is_refused(bad: object) -> None:
    with pytest.raises(OracleViolation, match="drain_trace returned no trace"):
        engine_trace_entries(bad)  # type: ignore[arg-type]


def test_a_dead_engine_takes_its_pending_checks_with_it() -> None:
    o = DPOracle(exact_tokens=False, engines=2)
    o.judge_engine_traces([(0, reply(source="a"), READY), (1, reply(source="b"), READY)],
                          baseline=True)
    o.add("r1", 2, None, None)
    o.add("r2", 2, None, None)
    finished(o, "r1", FinishReason.LENGTH, engine=0)
    finished(o, "r2", FinishReason.LENGTH, engine=1)
    assert [p[2] for p in o.engine_pending] == [0, 1]
    o.engine_died(1, restarted=True)
    o.judge_engine_traces([(0, reply(*ran("r1", "LENGTH", "FINISHED_LENGTH"), source="a"),
                            RUNNING), (1, reply(source="c"), READY)])
    assert o.engine_pending == []


def test_a_request_live_when_its_engine_died_is_not_judged() -> None:
    """Its ending may be a batch the dead incarnation queued, read after the replacement (the
    same index, another engine core) was drained: those records went with the old one."""
    o = DPOracle(exact_tokens=False, engines=2)
    o.judge_engine_traces([(0, reply(source="a"), READY), (1, reply(source="b"), READY)],
                          baseline=True)
    o.add("r1", 2, None, None)
    o.engine_died(0, restarted=True)
    finished(o, "r1", FinishReason.LENGTH, engine=0)
    assert o.engine_pending == []
    o.judge_engine_traces([(0, reply(source="c"), RUNNING), (1, reply(source="b"), RUNNING)])


def test_an_ending_another_engine_delivered_is_judged_and_paired() -> None:
    """A request not pinned is live when engine 0 dies, and ends from engine 1: engine 1
    recorded it whole, so it is judged there, and its record is not left to pair with the
    next lifecycle of the reused id (the campaign's false "books disagree": a STOP judged
    against the previous lifecycle's ABORT)."""
    o = DPOracle(exact_tokens=False, engines=2)
    o.judge_engine_traces([(0, reply(source="a"), READY), (1, reply(source="b"), READY)],
                          baseline=True)
    o.add("r2", 50, None, None)
    o.engine_died(0, restarted=False)
    o.abort(["r2"])
    finished(o, "r2", FinishReason.ABORT, engine=1)
    o.add("r2", 2, None, None)  # the id reused once it finished
    finished(o, "r2", FinishReason.LENGTH, engine=1)
    assert [(r, f) for r, f, _ in o.engine_pending] == [("r2", FinishReason.ABORT),
                                                        ("r2", FinishReason.LENGTH)]
    o.judge_engine_traces([(1, reply(*ran("r2", "ABORT", "FINISHED_ABORTED"),
                                     ("engine_request", "UNKNOWN", "ABORT", "UNKNOWN", "r2"),
                                     *ran("r2", "LENGTH", "FINISHED_LENGTH"), source="b"),
                            RUNNING)])
    assert o.engine_pending == []


def test_a_live_in_process_engine_agrees_with_its_client() -> None:
    """The oracle on a real engine: an abort, a finish, a sleep, each side judged."""
    from enginewire.protocol.messages import EngineCoreRequest, SamplingParams

    o = Oracle(exact_tokens=False)
    with make_client(EngineConfig(model="null", device="cpu"), multiprocess=False,
                     asyncio=False, trace=[]) as client:
        o.judge_engine_traces([(0, client.drain_trace(), client.state)], baseline=True)
        for rid, n in (("a", 2), ("b", 500)):
            client.add_request(EngineCoreRequest(rid, [3, 4], SamplingParams(max_tokens=n)))
            o.add(rid, n, None, None)
        client.abort_requests(["b"])
        o.abort(["b"])
        while o.live_ids():
            o.observe(client.get_output())
        o.judge_engine_traces([(0, client.drain_trace(), client.state)])
        client.sleep(1)
        o.pause("abort", 1)
        o.judge_engine_traces([(0, client.drain_trace(), client.state)])
        assert client.state is SLEEPING and o.engine_sides[0].state == "SLEEPING"
