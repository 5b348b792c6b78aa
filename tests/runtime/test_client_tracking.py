"""Client-side request tracking (``EngineCoreClient._track_outputs``): the per-token fast path
skips the table on an OUTPUT self-loop, and must change nothing the spec table implies."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enginewire.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from enginewire.runtime.client import _OUTPUT_SELF_LOOPS, InprocClient
from enginewire.runtime.config import EngineConfig
from enginewire.spec import CLIENT_REQUEST, SpecViolation, validate_trace
from enginewire.spec.machine import TraceEntry
from enginewire.spec.request import ClientRequestEvent, ClientRequestState
from enginewire.testing import conformance as cf

NULL = EngineConfig(model="null", device="cpu")
CS = ClientRequestState


def _batch(*outs: EngineCoreOutput) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=list(outs))


@pytest.fixture(params=[False, True], ids=["no-trace", "trace"])
def client(request: pytest.FixtureRequest) -> Iterator[InprocClient]:
    trace: list[TraceEntry] | None = [] if request.param else None
    c = InprocClient(NULL, trace=trace)
    try:
        yield c
    finally:
        c.shutdown()


def test_self_loops_come_from_the_table() -> None:
    table = CLIENT_REQUEST.table()
    expected = {s for s in CS if table.get((s, ClientRequestEvent.OUTPUT, None)) is s}
    assert _OUTPUT_SELF_LOOPS == expected
    assert CS.STREAMING in _OUTPUT_SELF_LOOPS and CS.SENT not in _OUTPUT_SELF_LOOPS


def test_stream_then_finish_then_output_raises(client: InprocClient) -> None:
    client._track_add(EngineCoreRequest("a", [5, 6]))
    client._track_outputs(_batch(EngineCoreOutput("a", [7])))
    assert client._requests["a"].state is CS.STREAMING
    client._track_outputs(_batch(EngineCoreOutput("a", [8]), EngineCoreOutput("a", [9])))
    assert client._requests["a"].state is CS.STREAMING
    client._track_outputs(_batch(EngineCoreOutput("a", [10], FinishReason.LENGTH)))
    assert "a" not in client._requests
    with pytest.raises(SpecViolation):
        client._track_outputs(_batch(EngineCoreOutput("a", [11])))
    with pytest.raises(SpecViolation):
        client._track_outputs(_batch(EngineCoreOutput("a", [11], FinishReason.STOP)))
    if client.trace is not None:
        validate_trace(CLIENT_REQUEST, [e for e in client.trace if e[0] == CLIENT_REQUEST.name])
        outputs = [e for e in client.trace
                   if e[0] == CLIENT_REQUEST.name and e[2] == ClientRequestEvent.OUTPUT.name]
        assert len(outputs) == 3  # every token is recorded when a trace is kept


def test_unknown_id_raises(client: InprocClient) -> None:
    with pytest.raises(SpecViolation):
        client._track_outputs(_batch(EngineCoreOutput("never-sent", [1])))


def test_aborting_request_still_streams(client: InprocClient) -> None:
    client._track_add(EngineCoreRequest("b", [5]))
    client._track_outputs(_batch(EngineCoreOutput("b", [7])))
    client._track_abort(["b"])
    assert client._requests["b"].state is CS.ABORTING
    client._track_outputs(_batch(EngineCoreOutput("b", [8])))  # tokens already in flight
    assert client._requests["b"].state is CS.ABORTING
    client._track_outputs(_batch(EngineCoreOutput("b", [], FinishReason.ABORT)))
    assert client.live_requests() == []


def _stream(*pairs: tuple[str, int], outs: tuple[EngineCoreOutput, ...] = ()) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=list(outs), stream_ids=[p[0] for p in pairs],
                             stream_tokens=[p[1] for p in pairs])


def test_stream_columns_advance_like_outputs(client: InprocClient) -> None:
    client._track_add(EngineCoreRequest("a", [5]))
    client._track_add(EngineCoreRequest("b", [5]))
    client._track_outputs(_stream(("a", 7)))  # first token: SENT -> STREAMING
    assert client._requests["a"].state is CS.STREAMING
    assert client._requests["b"].state is CS.SENT
    client._track_outputs(_stream(("a", 8), ("b", 1)))
    assert client._requests["b"].state is CS.STREAMING
    client._track_outputs(_stream(("a", 9), outs=(EngineCoreOutput("b", [2], FinishReason.STOP),)))
    assert "b" not in client._requests and client._requests["a"].state is CS.STREAMING
    with pytest.raises(SpecViolation):  # a stream token after its request finished
        client._track_outputs(_stream(("b", 3)))
    with pytest.raises(SpecViolation):
        client._track_outputs(_stream(("never-sent", 3)))
    if client.trace is not None:
        outputs = [e for e in client.trace
                   if e[0] == CLIENT_REQUEST.name and e[2] == ClientRequestEvent.OUTPUT.name]
        assert len(outputs) == 4  # a: 7, 8, 9 and b: 1; refused outputs record nothing


def _rows(batch: EngineCoreOutputs) -> list[tuple[str, list[int], FinishReason | None]]:
    return [(o.request_id, list(o.new_token_ids), o.finish_reason) for o in batch.outputs]


def test_forbidden_output_costs_its_batch_nothing_else(client: InprocClient) -> None:
    """[finish of a, output for an unknown id, output of b]: before the fix a's finish was
    tracked (a forgotten) but the batch was lost with the raise, and b's output never
    tracked. Now both advance once, the rest of the batch is queued, and the error names
    the forbidden id only."""
    client._track_add(EngineCoreRequest("a", [5]))
    client._track_add(EngineCoreRequest("b", [5]))
    with pytest.raises(SpecViolation, match="'ghost'") as info:
        client._track_outputs(_batch(EngineCoreOutput("a", [7], FinishReason.LENGTH),
                                     EngineCoreOutput("ghost", [8]), EngineCoreOutput("b", [9])))
    assert "'a'" not in str(info.value) and "'b'" not in str(info.value)
    assert client.live_requests() == ["b"] and client._requests["b"].state is CS.STREAMING
    assert [_rows(b) for b in client._redeliver] == [
        [("a", [7], FinishReason.LENGTH), ("b", [9], None)]]
    if client.trace is not None:
        validate_trace(CLIENT_REQUEST, [e for e in client.trace if e[0] == CLIENT_REQUEST.name])


def test_output_after_a_finish_in_the_same_batch(client: InprocClient) -> None:
    """The same id legal and then forbidden in one batch: only what follows its finish is
    refused."""
    client._track_add(EngineCoreRequest("a", [5]))
    with pytest.raises(SpecViolation, match=r"2 engine output.*'a', 'a'"):
        client._track_outputs(_batch(EngineCoreOutput("a", [7], FinishReason.STOP),
                                     EngineCoreOutput("a", [8]),
                                     EngineCoreOutput("a", [9], FinishReason.STOP)))
    assert client.live_requests() == []
    assert [_rows(b) for b in client._redeliver] == [[("a", [7], FinishReason.STOP)]]


def test_forbidden_stream_tokens_keep_their_neighbours(client: InprocClient) -> None:
    """Stream columns and outputs in one batch, a forbidden token in each part: the legal
    ones are tracked and queued in the order a caller reads them (columns first)."""
    client._track_add(EngineCoreRequest("a", [5]))
    client._track_add(EngineCoreRequest("b", [5]))
    client._track_outputs(_stream(("a", 1)))
    with pytest.raises(SpecViolation, match="'x', 'y'"):
        client._track_outputs(_stream(("x", 2), ("a", 3), ("b", 4),
                                      outs=(EngineCoreOutput("y", [5]),
                                            EngineCoreOutput("a", [6], FinishReason.STOP))))
    assert client.live_requests() == ["b"] and client._requests["b"].state is CS.STREAMING
    assert [_rows(b) for b in client._redeliver] == [
        [("a", [3], None), ("b", [4], None), ("a", [6], FinishReason.STOP)]]


def test_a_batch_only_of_forbidden_outputs_queues_nothing(client: InprocClient) -> None:
    with pytest.raises(SpecViolation, match="'ghost'"):
        client._track_outputs(_batch(EngineCoreOutput("ghost", [1])))
    assert not client._redeliver


@pytest.mark.parametrize("kind", ["inproc", "sync", "async"])
def test_forbidden_output_through_get_output(kind: str) -> None:
    """The same batch through each client's get_output: raised once, the rest next."""
    with cf.open_client(kind, NULL) as cut:
        cf.check_forbidden_output(cut)
    cf.check_trace(cut)


# -- the tracking fast path against the general path -------------------------------------------

_RID = st.integers(0, 2).map(lambda i: f"r{i}")
_REASON = st.sampled_from([None, None, None, FinishReason.STOP, FinishReason.LENGTH,
                           FinishReason.ABORT, FinishReason.ERROR])
_OP = st.one_of(
    st.tuples(st.just("add"), _RID),
    st.tuples(st.just("abort"), st.lists(_RID, max_size=3)),
    st.tuples(st.just("batch"), st.lists(_RID, max_size=6),
              st.lists(st.tuples(_RID, _REASON), max_size=4)),
)


def _tracked(client: InprocClient) -> tuple[object, ...]:
    return ({rid: lc.state for rid, lc in client._requests.items()}, sorted(client._streaming),
            list(client._redeliver), client.live_requests())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OP, max_size=30))
def test_the_tracking_fast_path_leaves_what_the_general_path_leaves(
        ops: list[tuple[object, ...]]) -> None:
    """``_track_outputs`` skips ``_advance`` when ``_only_loops`` holds; a client made to
    take ``_advance`` always must end every step in the same state (request states, the
    streaming set, the batches kept for redelivery) and raise the same errors, on any mix
    of adds, aborts, stream columns and outputs, the forbidden ones included."""
    fast, general = InprocClient(NULL), InprocClient(NULL)
    general._only_loops = lambda *args: False  # type: ignore[method-assign]
    try:
        for op in ops:
            results = []
            for client in (fast, general):
                try:
                    if op[0] == "add":
                        client._track_add(EngineCoreRequest(cast(str, op[1]), [5]))
                    elif op[0] == "abort":
                        client._track_abort(cast("list[str]", op[1]))
                    else:
                        sids = cast("list[str]", op[1])
                        outs = cast("list[tuple[str, FinishReason | None]]", op[2])
                        client._track_outputs(EngineCoreOutputs(
                            outputs=[EngineCoreOutput(r, [7], why) for r, why in outs],
                            stream_ids=list(sids), stream_tokens=[8] * len(sids)))
                    results.append(None)
                except SpecViolation as e:
                    results.append(str(e))
            assert results[0] == results[1], op
            assert _tracked(fast) == _tracked(general), op
    finally:
        fast.shutdown()
        general.shutdown()
