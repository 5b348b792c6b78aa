"""Aborts that arrive while a step runs take effect before that step's tokens are applied."""

from __future__ import annotations

import torch

from enginewire import EngineConfig, EngineCoreRequest, FinishReason, SamplingParams
from enginewire.runtime.engine import EngineCore

torch.set_num_threads(1)


def _engine() -> EngineCore:
    return EngineCore(EngineConfig(model="tiny", max_num_seqs=4))


def test_abort_arriving_during_forward_ends_request_without_that_steps_token() -> None:
    engine = _engine()
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine.add_request(EngineCoreRequest("a", [5, 6, 7], params))
    engine.add_request(EngineCoreRequest("b", [8, 9], params))
    engine.step()  # prefill: one token each

    def during_forward(point: str) -> None:
        if point == "forward":  # as if the input thread decoded an ABORT right now
            engine.mid_step_aborts.append("a")

    engine.fault_hook = during_forward
    outs = engine.step()
    by_id: dict[str, list] = {}
    for o in outs.outputs:
        by_id.setdefault(o.request_id, []).append(o)
    assert [o.finish_reason for o in by_id["a"]] == [FinishReason.ABORT]
    assert by_id["a"][0].new_token_ids == []  # the forward's token for "a" was not applied
    assert [len(o.new_token_ids) for o in by_id["b"]] == [1]  # "b" is untouched
    assert "a" in (outs.finished_requests or [])
    engine.fault_hook = None
    assert all(o.request_id == "b" for o in engine.step().outputs)
    engine.shutdown()


def test_abort_for_a_request_not_yet_added_is_a_no_op_mid_step() -> None:
    engine = _engine()
    engine.add_request(EngineCoreRequest("x", [5], SamplingParams(max_tokens=3)))
    engine.mid_step_aborts.append("later")  # its ADD is still queued behind
    outs = engine.step()
    assert [o.request_id for o in outs.outputs] == ["x"]
    engine.add_request(EngineCoreRequest("later", [5], SamplingParams(max_tokens=3)))
    engine.abort_requests(["later"])  # the in-order copy lands after the ADD
    ends = [o for o in engine.step().outputs if o.request_id == "later"]
    assert [o.finish_reason for o in ends] == [FinishReason.ABORT]
    engine.shutdown()
