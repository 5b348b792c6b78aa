"""vLLM 0.33.0's engine-core messages, mirrored as msgspec structs (field order and defaults
are the wire): what runtime/vllm_wire.py translates to and from enginewire's messages.

They mirror vLLM's positional layouts (``vllm/v1/engine/__init__.py``) instead of importing
them: importing ``vllm.v1.engine`` costs ~12 s of torch per engine start, and the campaign
starts engines often. ``tests/vllm/test_vllm_wire.py`` pins the mirror against vLLM's own
structs, byte for byte, where vLLM is installed. Nothing here imports vllm.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "VLLM_DEAD_SENTINEL",
    "VLLM_VERSION",
    "VllmEngineCoreOutput",
    "VllmEngineCoreOutputs",
    "VllmEngineCoreRequest",
    "VllmPrefillStats",
    "VllmReadyResponse",
    "VllmRequestError",
    "VllmSamplingParams",
    "VllmUtilityOutput",
]

# The release whose wire this mirrors (reference §0: the 0.33.0 wheel, commit 4ba787ec9).
VLLM_VERSION = "0.33.0"
# vllm/v1/engine/core.py: EngineCoreProc.ENGINE_CORE_DEAD.
VLLM_DEAD_SENTINEL = b"ENGINE_CORE_DEAD"


class VllmSamplingParams(msgspec.Struct, omit_defaults=True):
    """The fields of vLLM's ``SamplingParams`` (a map, not array_like) this engine honours;
    every other key is ignored. Defaults are vLLM's: an omitted key means vLLM's default."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16


class VllmEngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: Any
    sampling_params: VllmSamplingParams | None
    pooling_params: Any
    arrival_time: float
    lora_request: Any
    cache_salt: str | None
    data_parallel_rank: int | None
    prompt_embeds: Any = None
    prompt_is_token_ids: Any = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: Any = None
    resumable: bool = False
    external_req_id: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: Any = None
    abort_immediately: bool = False
    session_id: str | None = None
    kv_hints: Any = None


class VllmPrefillStats(msgspec.Struct, omit_defaults=True):
    """vllm/v1/metrics/stats.py ``PrefillStats`` (a dataclass: a map on the wire)."""

    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    num_cache_creation_tokens: int = 0


class VllmRequestError(msgspec.Struct):
    """vllm/outputs.py ``RequestError`` (a dataclass: a map)."""

    code: str
    message: str
    retryable: bool = False


class VllmEngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Any = None
    new_prompt_logprobs_tensors: Any = None
    pooling_output: Any = None
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    events: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    trace_headers: Any = None
    prefill_stats: VllmPrefillStats | None = None
    routed_experts: Any = None
    num_nans_in_logits: int = 0
    mm_cache_miss_hashes: list[str] | None = None
    new_sampling_mask: Any = None
    spec_decode_metrics: Any = None
    prompt_token_id_logprobs: Any = None
    error: VllmRequestError | None = None


class VllmUtilityOutput(msgspec.Struct, array_like=True, gc=False):
    """No omit_defaults in vLLM: always three elements. ``result`` is a ``UtilityResult``,
    ``[type_info, value]``; ``type_info`` is nil with insecure serialization off (§2.4)."""

    call_id: int
    failure_message: str | None = None
    result: list[Any] | None = None


class VllmEngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[VllmEngineCoreOutput] = []
    scheduler_stats: Any = None
    timestamp: float = 0.0
    utility_output: VllmUtilityOutput | None = None
    finished_requests: list[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None
    weight_version: str | None = None


class VllmReadyResponse(msgspec.Struct, omit_defaults=True):
    """vllm/v1/engine/__init__.py ``EngineCoreReadyResponse`` (a dataclass: a map)."""

    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    dp_stats_address: str | None
    dtype: str
    vllm_version: str
    world_size: int
    data_parallel_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    decode_context_parallel_size: int
    data_parallel_rank: int
    max_num_seqs: int
    max_num_batched_tokens: int
    instance_id: str
    supports_lora: bool
    max_loras: int
    kv_cache_size_tokens: int | None = None
    enable_sleep_mode: bool = False
