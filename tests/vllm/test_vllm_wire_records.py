"""The engine's typed records (protocol/records.py) on vLLM's wire, which has no EXT_STRUCT:
the engine sends each as a map (runtime/vllm_wire.py) and the harness's vLLM adapter
rebuilds the record (model_tests/vllm_factory.py). Needs no vLLM: the wire's mirror structs
stand in for vLLM's decoder."""

from __future__ import annotations

import msgspec
import pytest

from enginewire.protocol.codec import utility_output
from enginewire.protocol.messages import EngineCoreOutputs
from enginewire.protocol.records import UTILITY_RECORDS, EngineStats, TraceDrain
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine import EngineCore
from enginewire.runtime.vllm_wire import VllmEngineCoreOutputs, outputs_to_vllm
from enginewire.spec import EngineState, ProtocolError
from enginewire.testing.vllm_factory import _typed


def _over_vllms_wire(method: str, result: object) -> object:
    """What vLLM's client hands its caller for this reply (type_info nil: the plain value)."""
    batch = EngineCoreOutputs(utility_output=utility_output(3, method, result=result))
    frame = msgspec.msgpack.encode(outputs_to_vllm(batch))
    got = msgspec.msgpack.decode(frame, type=VllmEngineCoreOutputs).utility_output
    assert got is not None and got.failure_message is None and got.result is not None
    return got.result[1]


@pytest.mark.parametrize("method", sorted(UTILITY_RECORDS))
def test_each_record_of_a_real_engine_survives_vllms_wire(method: str) -> None:
    engine = EngineCore(EngineConfig(model="null", device="cpu"), trace=[])
    try:
        record = engine.call_utility(method)
        plain = _over_vllms_wire(method, record)
        assert isinstance(plain, dict)  # no tag on this wire: a map, its state by value
        assert plain["state"] == EngineState.IDLE.value
        assert _typed(method, plain) == record
    finally:
        engine.shutdown()


def test_a_trace_keeps_its_columns_and_state() -> None:
    drain = TraceDrain(state=EngineState.PAUSED, source="9.1", machine=("engine",),
                       before=("IDLE",), event=("PAUSE_KEEP",), after=("PAUSED",),
                       subject=("",), bound=5)
    back = _typed("drain_trace", _over_vllms_wire("drain_trace", drain))
    assert back == drain and back.state is EngineState.PAUSED


def test_a_reply_that_is_no_record_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="get_stats replied no EngineStats"):
        _typed("get_stats", {"state": "no such state"})
    assert _typed("echo", {"x": 1}) == {"x": 1}  # other utilities pass through untouched
    assert isinstance(_typed("get_stats", {"state": "idle"}), EngineStats)
