"""The engine's read-only reports as typed records: ``get_stats``, ``audit_resources`` and
``drain_trace`` return these.

Theory of operation
-------------------
Each is a frozen msgspec Struct (trio's ``statistics()`` record), registered below as a
utility result type, so it crosses the wire typed (``EXT_STRUCT``, protocol/results.py) and a
client gets the class the engine returned, its ``state`` an ``EngineState`` member: a reader
compares it with the spec's sets (``REPORTS_SLEEPING``...), never with a state's name. Both
peers register by importing this module (``protocol/utilities.py``, which declares these as
the utilities' results, imports it; so does every client and the engine core).

Rule 1: fields are only appended, each with a default (a newer engine's record still decodes
for an older client, msgspec's schema evolution).
Rule 2: the trace's columns stay names (strings): they hold several machines' states and
events side by side, as every ``TraceEntry`` does.
"""

from __future__ import annotations

import msgspec

from ..spec.engine import EngineState
from .results import register_result_type

__all__ = ["UTILITY_RECORDS", "EngineStats", "KVAudit", "ResourceAudit", "SchedulerAudit",
           "TraceDrain"]


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """``get_stats()``: the scheduler's counters, the KV cache's usage and the memory held."""

    state: EngineState
    num_running: int = 0
    num_waiting: int = 0
    num_live: int = 0
    num_preemptions: int = 0
    num_priority_preemptions: int = 0
    scheduling_policy: str = ""
    step_counter: int = 0
    num_gpu_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # The KV blocks a memory profile allowed (None: no profile ran, or no executor).
    profiled_num_blocks: int | None = None
    # The executor's memory report; None (and no tags) when the engine has no executor.
    device_tensor_bytes: int | None = None
    host_offload_bytes: int | None = None
    sleeping: tuple[str, ...] = ()
    cuda_memory_allocated: int | None = None  # on CUDA only


class KVAudit(msgspec.Struct, frozen=True, kw_only=True):
    """The KV cache's accounting recounted from its block table (``KVCacheManager.audit``)."""

    num_blocks: int = 0
    num_free_blocks: int = 0
    referenced: int = 0
    total_refs: int = 0
    negative_refs: int = 0
    free_and_referenced: int = 0
    unaccounted: int = 0
    cached: int = 0
    cache_mismatch: int = 0


class SchedulerAudit(msgspec.Struct, frozen=True, kw_only=True):
    """The scheduler's queues recounted from the queues themselves (``Scheduler.audit``)."""

    live: int = 0
    running: int = 0
    running_finished: int = 0
    running_unknown: int = 0
    waiting: int = 0
    waiting_in_queue: int = 0
    draining: int = 0
    draining_waiting: int = 0
    request_block_refs: int = 0


class ResourceAudit(msgspec.Struct, frozen=True, kw_only=True):
    """``audit_resources()``: the books a quiet engine must balance (model_tests/oracle.py)."""

    state: EngineState
    kv: KVAudit
    scheduler: SchedulerAudit
    pending_outputs: int = 0
    deferred_replies: int = 0
    mid_step_aborts: int = 0
    asleep_tags: tuple[str, ...] = ()


class TraceDrain(msgspec.Struct, frozen=True, kw_only=True):
    """``drain_trace()``: the engine's lifecycle records since the last drain, as columns in
    its order (record i is ``machine[i], before[i], event[i], after[i]``, of the request
    ``subject[i]``, "" for none), how many were dropped past ``bound``, which engine core
    (``source``) and its state now."""

    state: EngineState
    source: str = ""
    machine: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    event: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    subject: tuple[str, ...] = ()
    dropped: int = 0
    bound: int = 0


UTILITY_RECORDS: dict[str, type[msgspec.Struct]] = {
    "get_stats": EngineStats, "audit_resources": ResourceAudit, "drain_trace": TraceDrain}
"""The record each of these utilities returns (one engine's), for a peer whose wire carries
results untyped (vLLM's: model_tests/vllm_factory.py rebuilds them with ``msgspec.convert``)."""

# Short, stable wire names: the module path may move, the names must not. The audits inside a
# ResourceAudit travel as its fields (msgspec rebuilds them from its annotations).
for _cls in UTILITY_RECORDS.values():
    register_result_type(_cls, f"enginewire.{_cls.__name__}")
