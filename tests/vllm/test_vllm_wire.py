"""The vLLM wire profile against vLLM 0.33's own structs and clients (issue #33).

Skipped where vLLM is not installed (CI). By hand, in the vLLM environment
(``scripts/vllm_harness.sh`` builds one)::

    nice -n 10 /work/vllm-venv/bin/python -m pytest tests/vllm -p no:cacheprovider
"""

from __future__ import annotations

import time

import msgspec
import pytest

from enginewire.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    UtilityOutput,
)
from enginewire.runtime.vllm_wire import (
    VLLM_DEAD_SENTINEL,
    VllmEngineCoreRequest,
    VllmReadyResponse,
    outputs_to_vllm,
    request_from_vllm,
)
from enginewire.testing.vllm_factory import vllm_available

_WHY = vllm_available()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"needs vLLM 0.33 ({_WHY})")


def test_sentinel_is_vllms() -> None:
    from vllm.v1.engine.core import EngineCoreProc

    assert EngineCoreProc.ENGINE_CORE_DEAD == VLLM_DEAD_SENTINEL


def test_vllm_request_decodes_as_ours() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackEncoder

    v = EngineCoreRequest(request_id="r1", prompt_token_ids=[5, 6, 7], mm_features=None,
                          sampling_params=SamplingParams(max_tokens=9, temperature=0.0, seed=3,
                                                         stop_token_ids=[11], ignore_eos=True),
                          pooling_params=None, arrival_time=time.time(), lora_request=None,
                          cache_salt=None, data_parallel_rank=None, priority=2)
    frames = MsgpackEncoder().encode(v)
    assert len(frames) == 1
    ours = request_from_vllm(msgspec.msgpack.decode(frames[0], type=VllmEngineCoreRequest))
    assert ours.request_id == "r1" and ours.prompt_token_ids == [5, 6, 7]
    sp = ours.sampling_params
    assert (sp.max_tokens, sp.temperature, sp.seed, sp.stop_token_ids, sp.ignore_eos) == (
        9, 0.0, 3, [11], True)
    assert ours.priority == 2
    # vLLM's defaults, omitted on the wire, are the mirror's defaults.
    d = request_from_vllm(msgspec.msgpack.decode(MsgpackEncoder().encode(
        EngineCoreRequest(request_id="d", prompt_token_ids=[1], mm_features=None,
                          sampling_params=SamplingParams(), pooling_params=None,
                          arrival_time=0.0, lora_request=None, cache_salt=None,
                          data_parallel_rank=None))[0], type=VllmEngineCoreRequest))
    assert (d.sampling_params.max_tokens, d.sampling_params.temperature) == (16, 1.0)


def test_our_outputs_decode_as_vllms() -> None:
    from vllm.v1.engine import EngineCoreOutputs as VOuts
    from vllm.v1.serial_utils import MsgpackDecoder

    dec = MsgpackDecoder(VOuts)
    ours = EngineCoreOutputs(engine_index=0, outputs=[
        EngineCoreOutput("a", [1, 2], None), EngineCoreOutput("b", [3], FinishReason.LENGTH,
                                                              num_cached_tokens=16),
        EngineCoreOutput("c", [], FinishReason.ERROR, error="bad")], timestamp=1.5)
    v = dec.decode(msgspec.msgpack.encode(outputs_to_vllm(ours)))
    assert [o.request_id for o in v.outputs] == ["a", "b", "c"]
    assert v.outputs[1].finish_reason == FinishReason.LENGTH
    assert v.outputs[1].prefill_stats.num_cached_tokens == 16
    assert v.outputs[2].error.message == "bad"
    reply = dec.decode(msgspec.msgpack.encode(outputs_to_vllm(EngineCoreOutputs(
        utility_output=UtilityOutput(7, result={"x": [1]})))))
    assert reply.utility_output.call_id == 7 and reply.utility_output.result.result == {"x": [1]}
    failed = dec.decode(msgspec.msgpack.encode(outputs_to_vllm(EngineCoreOutputs(
        utility_output=UtilityOutput(8, failure_message="no")))))
    assert failed.utility_output.failure_message == "no" and failed.utility_output.result is None


def test_ready_decodes_as_vllms() -> None:
    from vllm.v1.engine import EngineCoreReadyResponse

    ready = VllmReadyResponse(max_model_len=256, num_gpu_blocks=10, block_size=16,
                              dp_stats_address=None, dtype="float32", vllm_version="0.33.0",
                              world_size=1, data_parallel_size=1, tensor_parallel_size=1,
                              pipeline_parallel_size=1, decode_context_parallel_size=1,
                              data_parallel_rank=0, max_num_seqs=4, max_num_batched_tokens=64,
                              instance_id="x", supports_lora=False, max_loras=0)
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(ready), type=EngineCoreReadyResponse)
    assert (got.max_model_len, got.num_gpu_blocks, got.block_size) == (256, 10, 16)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_vllm_client_generates_on_our_engine(kind: str) -> None:
    from enginewire.testing import vllm_factory
    from enginewire.testing.conformance import collect, request

    cut = (vllm_factory.vllm_sync if kind == "sync" else vllm_factory.vllm_async)()
    try:
        assert cut.call_utility("echo", [1, "x"]) == [1, "x"]
        cut.add_request(request("r1", 6))
        done = collect(cut, ["r1"])
        assert done["r1"].reason is FinishReason.LENGTH and len(done["r1"].tokens) == 6
    finally:
        cut.shutdown()


def test_refused_options_are_named() -> None:
    from enginewire.testing.conformance import NotApplicable
    from enginewire.testing.vllm_factory import vllm_sync

    with pytest.raises(NotApplicable, match="engine_heartbeat_timeout_s"):
        vllm_sync(engine_heartbeat_timeout_s=1.0)
