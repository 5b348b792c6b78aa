"""The harness follows what a factory declares (``factory.contract``, ``Declared``): the fault
matrix, the interposer and the release check read the vLLM factory's declarations instead of
its adapter hiding them (issue #33). None of this needs vLLM: it runs everywhere."""

from __future__ import annotations

import gc

import msgspec
import pytest
import zmq

from enginewire.protocol.messages import EngineCoreOutput, EngineCoreOutputs, UtilityOutput
from enginewire.runtime.faults import Fault
from enginewire.runtime.vllm_wire import VLLM_DEAD_SENTINEL, outputs_to_vllm
from enginewire.testing._conformance_driver import (
    ZMQ_CONTEXT_FDS,
    Declared,
    declared_contract,
    left_behind_as_declared,
)
from enginewire.testing._harness import ResourceSnapshot, left_behind
from enginewire.testing.fault_matrix import (
    STARTUP_HANG_READY_S,
    Cell,
    Scenario,
    declared_away,
    latency_bound,
)
from enginewire.testing.interposer import (
    WIRES,
    Direction,
    FrameAction,
    FrameKind,
    FrameRule,
    Interposer,
    _InterposerCell,
    _kind_to_client,
)
from enginewire.testing.vllm_factory import VLLM_CONTRACT, vllm_async, vllm_sync


def test_the_vllm_factories_declare_their_contract() -> None:
    for factory in (vllm_sync, vllm_async):
        contract = declared_contract(factory)
        assert dict(contract) == VLLM_CONTRACT
        assert {d.value for d in Declared} <= set(contract)  # every name the harness reads
    assert repr(vllm_sync) == "enginewire.testing.vllm_factory:vllm_sync"


def test_a_factory_without_a_contract_declares_nothing_and_a_bad_one_is_refused() -> None:
    def plain(**options: object) -> None: ...

    assert declared_contract(plain) == {}
    plain.contract = {"x": 1}  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="must map names to why"):
        declared_contract(plain)


def test_a_declared_zmq_context_is_excused_and_nothing_else() -> None:
    declared = {Declared.ZMQ_CONTEXT_OUTLIVES_SHUTDOWN.value: "as vLLM's client leaves it"}
    before = ResourceSnapshot.take()
    ctx = zmq.Context(io_threads=2)
    sock = ctx.socket(zmq.PAIR)  # libzmq starts the io threads with the first socket
    sock.close(linger=0)
    try:
        assert left_behind(before, bound=0.2, kinds=("fds",)).get("fds", 0) > 0
        assert left_behind_as_declared(before, declared, bound=0.2) == {}
        assert "fds" in left_behind_as_declared(before, {}, bound=0.2)
        with open(__file__) as other:  # a file is no part of a context: still a leak
            assert other is not None
            assert "fds" in left_behind_as_declared(before, declared, bound=0.2)
    finally:
        ctx.term()
    gc.collect()
    assert left_behind(before, bound=2.0, kinds=("fds",)) == {}
    assert ZMQ_CONTEXT_FDS == {"anon_inode:[eventfd]", "anon_inode:[eventpoll]"}


def test_the_matrix_follows_the_declarations() -> None:
    contract = declared_contract(vllm_sync)
    stop = Cell("sync", Scenario.GENERATE, Fault(point="output_send", action="sigstop", at=2))
    assert "no_heartbeat_deadline" in (declared_away(stop, contract) or "")
    assert declared_away(stop, {}) is None
    at_shutdown = Cell("sync", Scenario.SHUTDOWN, Fault(point="shutdown", action="sigstop"))
    assert declared_away(at_shutdown, contract) is None  # judges the shutdown's bound only
    early = Cell("sync", Scenario.STARTUP, Fault(point="before_ready"))
    assert latency_bound(early) == 1.0
    assert latency_bound(early, contract) == STARTUP_HANG_READY_S + 2.0


def test_the_interposer_cells_follow_the_declarations() -> None:
    contract = declared_contract(vllm_async)

    def cell(rule: FrameRule, trailers: bool) -> _InterposerCell:
        return _InterposerCell("async", rule, frozenset(), None, needs_integrity=trailers)

    flip = FrameRule(action=FrameAction.BITFLIP, direction=Direction.TO_CLIENT,
                     kind=FrameKind.TOKENS)
    assert "no_frame_integrity" in (cell(flip, True).declared_away(contract) or "")
    assert cell(flip, False).declared_away(contract) is None
    attach = FrameRule(action=FrameAction.DROP, kind=FrameKind.ATTACH)
    assert "no_attach_handshake" in (cell(attach, False).declared_away(contract) or "")
    assert cell(attach, True).declared_away({}) is None


def test_the_interposer_reads_vllms_frames() -> None:
    layout = WIRES["vllm"]
    assert layout.sentinel == VLLM_DEAD_SENTINEL

    def kind(batch: EngineCoreOutputs) -> FrameKind:
        return _kind_to_client([msgspec.msgpack.encode(outputs_to_vllm(batch))], False, layout)

    assert kind(EngineCoreOutputs(engine_index=0, timestamp=1.0)) is FrameKind.HEARTBEAT
    # A finishing batch carries finished_requests where enginewire's has utility_output.
    assert kind(EngineCoreOutputs(engine_index=0, outputs=[EngineCoreOutput("a", [1])],
                                  timestamp=1.0, finished_requests=["a"])) is FrameKind.TOKENS
    assert kind(EngineCoreOutputs(utility_output=UtilityOutput(3, result=7))) is (
        FrameKind.UTILITY)
    assert _kind_to_client([VLLM_DEAD_SENTINEL], False, layout) is FrameKind.SENTINEL
    with pytest.raises(ValueError, match="wire"):
        Interposer(wire="grpc")
