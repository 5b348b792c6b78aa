"""Scheduler work at scale, counted in reads of request fields, never timed: a step that
preempts many requests reads each rank a bounded number of times, not once per running request
per victim (that made one step take minutes at the largest max_num_seqs); a pause(wait) drain
does not look at every live request, nor at every request that arrived since, each step."""

from __future__ import annotations

import pytest

from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
from enginewire.runtime import engine as engine_module
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine import EngineCore
from enginewire.runtime.scheduler import Request

S = 1000  # running requests; the old per-victim scan read some S * S / 2 ranks here


class _CountingRequest(Request):
    """A Request that counts every read of its rank (``sort_key``) and drain mark."""

    reads = 0
    draining_reads = 0

    @property
    def sort_key(self) -> tuple[int, float, int]:
        _CountingRequest.reads += 1
        return self._key

    @sort_key.setter
    def sort_key(self, value: tuple[int, float, int]) -> None:
        self._key = value

    @property
    def draining(self) -> bool:
        _CountingRequest.draining_reads += 1
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> type[_CountingRequest]:
    monkeypatch.setattr(engine_module, "Request", _CountingRequest)
    _CountingRequest.reads = _CountingRequest.draining_reads = 0
    return _CountingRequest


def _req(rid: str, prompt_len: int, priority: int = 0,
         max_tokens: int = 1000) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1] * prompt_len,
                             SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                             priority=priority)


def _running(eng: EngineCore) -> list[str]:
    return [r.request_id for r in eng.scheduler.running]


def test_admitting_many_better_requests_reads_each_rank_a_bounded_number_of_times(
        counting: type[_CountingRequest]) -> None:
    eng = EngineCore(EngineConfig(model="null", max_num_seqs=S, max_num_batched_tokens=1 << 16,
                                  max_model_len=2048, num_gpu_blocks_override=1 << 14))
    for i in range(S):
        eng.add_request(_req(f"lo{i}", 3, priority=5))
    eng.step()
    eng.step()
    assert len(_running(eng)) == S
    for i in range(S):
        eng.add_request(_req(f"hi{i}", 3, priority=0))
    counting.reads = 0
    eng.step()  # every hi request evicts one lo request
    assert eng.scheduler.num_priority_preemptions == S
    assert _running(eng) == [f"hi{i}" for i in range(S)]
    assert eng.scheduler.num_waiting == S
    # A heap: a rank read to build it and to requeue each victim, not a scan per victim.
    assert counting.reads < 10 * S, counting.reads
    eng.shutdown()


def test_many_preemptions_for_kv_blocks_read_each_rank_a_bounded_number_of_times(
        counting: type[_CountingRequest]) -> None:
    # One block per request, every block taken: the step that needs each request's second
    # block preempts the latest half so that the earliest half can go on.
    eng = EngineCore(EngineConfig(model="null", max_num_seqs=S, max_num_batched_tokens=1 << 16,
                                  max_model_len=64, block_size=16, num_gpu_blocks_override=S))
    for i in range(S):
        eng.add_request(_req(f"r{i}", 16))
    eng.step()  # prefill: 16 tokens, one full block each
    counting.reads = 0
    eng.step()
    assert eng.scheduler.num_preemptions == S // 2
    assert _running(eng) == [f"r{i}" for i in range(S // 2)]
    assert eng.scheduler.num_waiting == S // 2
    assert counting.reads < 10 * S, counting.reads
    eng.shutdown()


def _drain(eng: EngineCore) -> int:
    """Step a pause(wait) to its end, checking the drain count against a recount; the steps."""
    done = eng.pause_scheduler("wait")
    assert done is not None
    sched = eng.scheduler
    steps = 0
    while not done.done():
        assert steps < 10_000, "the drain did not end"
        eng.step()
        steps += 1
        live = sched.requests.values()
        assert sched.num_draining() == sum(r._draining for r in live)  # type: ignore[attr-defined]
    return steps


def test_a_drain_does_not_recount_every_live_request_each_step(
        counting: type[_CountingRequest]) -> None:
    n = 2000
    eng = EngineCore(EngineConfig(model="null", max_num_seqs=64, max_num_batched_tokens=4096,
                                  num_gpu_blocks_override=1 << 12))
    for i in range(n):
        eng.add_request(_req(f"r{i}", 3, max_tokens=4))
    eng.step()
    counting.draining_reads = 0
    steps = _drain(eng)
    assert steps > 30  # the old recount read n marks in each of these steps
    assert not eng.scheduler.requests
    assert counting.draining_reads < 10 * n, counting.draining_reads
    eng.shutdown()


def test_arrivals_during_a_drain_are_not_popped_and_pushed_each_step(
        counting: type[_CountingRequest]) -> None:
    k = 2000
    eng = EngineCore(EngineConfig(model="null", max_num_seqs=64, max_num_batched_tokens=4096,
                                  num_gpu_blocks_override=1 << 12))
    for i in range(64):
        eng.add_request(_req(f"r{i}", 3, max_tokens=50))
    eng.step()
    sched = eng.scheduler
    done = eng.pause_scheduler("wait")
    assert done is not None
    for i in range(k):
        eng.add_request(_req(f"late{i}", 3, max_tokens=2))
    counting.draining_reads = 0
    while not done.done():
        eng.step()
        assert all(not r.startswith("late") for r in _running(eng))  # queued, not run
    assert counting.draining_reads < 10 * k, counting.draining_reads
    assert sched.num_waiting == k and not sched.running
    eng.resume_scheduler()
    for _ in range(1000):
        if not sched.requests:
            break
        eng.step()
    assert not sched.requests and sched.num_waiting == 0
    eng.shutdown()
