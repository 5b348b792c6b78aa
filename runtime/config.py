"""Engine configuration: one frozen, validated record.

Validation happens once, at construction, so a bad value fails where it was written, with
the field's name in the message, instead of deep inside the engine build.
"""

from __future__ import annotations

import math
import numbers

import msgspec

__all__ = ["BUILTIN_MODELS", "DTYPES", "SCHEDULING_POLICIES", "EngineConfig"]

# Sizes and counts travel to the engine process in msgpack and size tensors: anything past
# this is a typo, not a setting, and would fail later as an overflow far from its field.
_MAX_INT = (1 << 62) - 1
_MAX_SEED = (1 << 64) - 1  # seeds are msgpack uint64
MAX_NUM_SEQS = 1 << 15

DTYPES = ("float32", "float16", "bfloat16")
# The model names every engine knows, stored lowercased however they were written
# ("SmolLM2-135M" is how the model's card spells it). Paths and registered names keep theirs.
BUILTIN_MODELS = ("tiny", "null", "smollm2", "smollm2-135m", "smollm2-135m-instruct")
SCHEDULING_POLICIES = ("priority", "fcfs")
DATA_PARALLEL_BACKENDS = ("mp", "ray")
# One client drives at most this many engine cores (each has its own sockets and process).
MAX_DATA_PARALLEL_SIZE = 256
# A bound on the engine trace's records between drains (about 100 bytes each).
MAX_ENGINE_TRACE_RECORDS = 10_000_000


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str = "tiny"  # "tiny" | "null" | a name or path a registered WeightSource accepts
    device: str = "auto"  # auto = cuda if available else cpu
    dtype: str = "float32"
    seed: int = 0
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 256
    kv_cache_memory_bytes: int = 32 * 1024 * 1024  # KV budget on CPU
    gpu_memory_utilization: float = 0.5  # share of the whole GPU this engine may fill on CUDA
    enable_prefix_caching: bool = False
    null_step_delay_s: float = 0.0  # null model: simulated compute time per step (benchmarks)
    # Fixes the block count, skipping the memory-based sizing (vLLM's num_gpu_blocks_override).
    num_gpu_blocks_override: int | None = None
    # Upper bound on a profiled CUDA pool: a 64 KiB-per-block tiny model on a 141 GB GPU
    # would otherwise ask for millions of blocks and a free list to match.
    max_num_gpu_blocks: int = 1 << 17
    # "priority" (vLLM's priority policy): waiting and running requests are ordered by
    # (priority, arrival_time), and a waiting request with a strictly lower priority value
    # preempts the worst running one when slots or KV blocks are exhausted. "fcfs": arrival
    # order only, and a request with a non-zero priority finishes with ERROR (as vLLM refuses
    # it). The default is "priority", the behaviour this engine always had for admission.
    scheduling_policy: str = "priority"
    # Data parallel (runtime/dp_client.py): how many engine cores one multi-process client
    # drives, and where they run: "mp" subprocesses of this host, "ray" Ray actors.
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"
    # The engine's own trace (runtime/_engine_trace.py), for the ``drain_trace`` utility: 0
    # keeps none (unless ENGINEWIRE_ENGINE_TRACE asks, for engines a harness launches); N > 0
    # keeps up to N records between two drains, in-process or in an engine process alike.
    engine_trace_records: int = 0

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"EngineConfig.{field}={getattr(self, field)!r}: {why}")

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_real(value: object) -> bool:
            return isinstance(value, numbers.Real) and not isinstance(value, bool)

        if not isinstance(self.model, str) or not self.model:
            raise bad("model", "must be a non-empty string")
        if self.model != self.model.lower() and self.model.lower() in BUILTIN_MODELS:
            msgspec.structs.force_setattr(self, "model", self.model.lower())
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda")
            or (self.device.startswith("cuda:") and self.device[5:].isdigit())
        ):
            raise bad("device", "must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {DTYPES}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "kv_cache_memory_bytes", "max_num_gpu_blocks"):
            value = getattr(self, name)
            if not is_int(value) or not 0 < value <= _MAX_INT:
                raise bad(name, f"must be a positive integer (at most {_MAX_INT})")
        if self.block_size > 1024:
            raise bad("block_size", "must be at most 1024")
        if self.max_num_seqs > MAX_NUM_SEQS:
            # One step's outputs (one per running request) and the ABORTs of a pause share a
            # batch a client decodes (at most Limits.max_batch = 65536 outputs).
            raise bad("max_num_seqs", f"must be at most {MAX_NUM_SEQS}")
        if not is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED:
            raise bad("seed", f"must be a non-negative integer (at most {_MAX_SEED})")
        if not is_real(self.gpu_memory_utilization) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "must be a number in (0, 1]")
        if not is_real(self.null_step_delay_s) or not (
                0.0 <= self.null_step_delay_s and math.isfinite(self.null_step_delay_s)):
            raise bad("null_step_delay_s", "must be a finite number of seconds >= 0")
        if not isinstance(self.enable_prefix_caching, bool):
            raise bad("enable_prefix_caching", "must be True or False")
        override = self.num_gpu_blocks_override
        if override is not None and (not is_int(override) or not 0 < override <= _MAX_INT):
            raise bad("num_gpu_blocks_override", "must be a positive integer or None")
        if not isinstance(self.scheduling_policy, str) or (
                self.scheduling_policy not in SCHEDULING_POLICIES):
            raise bad("scheduling_policy", f"must be one of {SCHEDULING_POLICIES}")
        if not is_int(self.data_parallel_size) or not (
                1 <= self.data_parallel_size <= MAX_DATA_PARALLEL_SIZE):
            raise bad("data_parallel_size",
                      f"must be an integer in [1, {MAX_DATA_PARALLEL_SIZE}]")
        if not isinstance(self.data_parallel_backend, str) or (
                self.data_parallel_backend not in DATA_PARALLEL_BACKENDS):
            raise bad("data_parallel_backend", f"must be one of {DATA_PARALLEL_BACKENDS}")
        if not is_int(self.engine_trace_records) or not (
                0 <= self.engine_trace_records <= MAX_ENGINE_TRACE_RECORDS):
            raise bad("engine_trace_records",
                      f"must be an integer in [0, {MAX_ENGINE_TRACE_RECORDS}] (0: no trace)")

    def resolved_device(self) -> str:
        """The concrete device: ``auto`` picks CUDA when one is visible (the null model, which
        places no tensors, stays on the CPU without probing CUDA, i.e. without loading torch)."""
        if self.device != "auto":
            return self.device
        if self.model == "null":
            return "cpu"
        import torch  # deferred: the config is also read by processes that never touch torch

        return "cuda" if torch.cuda.is_available() else "cpu"
