"""Scheduler: token budget and chunked prefill, max_num_seqs, priority order, preemption."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from enginewire.protocol.messages import EngineCoreRequest, FinishReason, SamplingParams
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine import EngineCore
from enginewire.runtime.model import TinyRandomSource, dense_greedy
from enginewire.spec import ENGINE_REQUEST, EngineRequestState, validate_trace

torch.set_num_threads(1)


def req(rid: str, prompt: list[int], priority: int = 0, **sp: object) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(**sp), priority=priority)  # type: ignore[arg-type]


def run(eng: EngineCore, max_steps: int = 3000) -> tuple[dict[str, list[int]], list[str]]:
    toks: dict[str, list[int]] = defaultdict(list)
    order: list[str] = []
    for _ in range(max_steps):
        if not eng.has_unfinished_requests() and not eng.has_pending_outputs():
            return dict(toks), order
        for o in eng.step().outputs:
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                order.append(o.request_id)
    raise AssertionError("did not finish")


def test_chunked_prefill_respects_the_token_budget() -> None:
    eng = EngineCore(EngineConfig(model="tiny", device="cpu", max_model_len=64, block_size=4,
                                  max_num_batched_tokens=8, kv_cache_memory_bytes=1 << 20))
    prompt = [(5 * j) % 400 + 3 for j in range(30)]
    eng.add_request(req("long", prompt, max_tokens=3, ignore_eos=True))
    eng.add_request(req("short", [9, 9], max_tokens=3, ignore_eos=True))
    sched = eng.scheduler
    firsts: dict[str, int] = {}
    toks: dict[str, list[int]] = defaultdict(list)
    for step in range(20):
        if not eng.has_unfinished_requests():
            break
        reqs, nums = sched.schedule()
        assert sum(nums) <= 8
        tokens = eng.executor.execute_model(reqs, nums)  # type: ignore[union-attr]
        outs, _ = sched.update(reqs, nums, tokens)
        eng._settle()
        for o in outs:
            firsts.setdefault(o.request_id, step)
            toks[o.request_id] += o.new_token_ids
    # 30 prompt tokens in chunks of <= 8: the first token comes on the 4th step (index 3).
    assert firsts["long"] == 3
    arch, params = TinyRandomSource(seed=0).load()
    assert toks["long"] == dense_greedy(arch, params, prompt, 3)
    assert toks["short"] == dense_greedy(arch, params, [9, 9], 3)


def test_max_num_seqs_and_priority_then_fcfs_order() -> None:
    eng = EngineCore(EngineConfig(model="null", device="cpu", max_num_seqs=1))
    eng.add_request(req("late-low", [5], priority=5, max_tokens=2))
    eng.add_request(req("first", [5], max_tokens=2))
    eng.add_request(req("second", [5], max_tokens=2))
    eng.add_request(req("urgent", [5], priority=-1, max_tokens=2))
    eng.step()
    assert len(eng.scheduler.running) == 1 and eng.scheduler.num_waiting == 3
    _, order = run(eng)
    assert order == ["urgent", "first", "second", "late-low"]


def test_preemption_by_recompute_keeps_greedy_tokens_exact() -> None:
    trace: list = []  # type: ignore[type-arg]
    # 8 blocks of 4 tokens: exactly one max-length sequence; three requests must take turns.
    cfg = EngineConfig(model="tiny", device="cpu", max_model_len=32, block_size=4,
                       num_gpu_blocks_override=8, max_num_batched_tokens=64)
    eng = EngineCore(cfg, trace=trace)
    assert eng.ready_info()["num_gpu_blocks"] == 8
    prompts = {f"q{i}": [(11 * i + j) % 500 + 3 for j in range(6 + i)] for i in range(3)}
    for rid, p in prompts.items():
        eng.add_request(req(rid, p, max_tokens=18, ignore_eos=True))
    toks, _ = run(eng)
    assert eng.scheduler.num_preemptions > 0
    arch, params = TinyRandomSource(seed=0).load()
    for rid, p in prompts.items():
        assert toks[rid] == dense_greedy(arch, params, p, 18), rid
    validate_trace(ENGINE_REQUEST, trace)
    assert eng.kv.num_free_blocks == 8


def test_the_lowest_priority_request_is_preempted_first() -> None:
    trace: list = []  # type: ignore[type-arg]
    cfg = EngineConfig(model="null", device="cpu", max_model_len=32, block_size=4,
                       num_gpu_blocks_override=8)
    eng = EngineCore(cfg, trace=trace)
    eng.add_request(req("vip", [5] * 4, priority=-5, max_tokens=20))
    eng.add_request(req("pleb", [5] * 4, priority=3, max_tokens=20))
    eng.add_request(req("mid", [5] * 4, priority=0, max_tokens=20))
    seen_preempted: list[str] = []
    for _ in range(200):
        if not eng.has_unfinished_requests():
            break
        eng.step()
        seen_preempted += [rid for rid, r in eng.scheduler.requests.items()
                           if r.lifecycle.state is EngineRequestState.PREEMPTED
                           and rid not in seen_preempted]
    assert seen_preempted and seen_preempted[0] == "pleb"
    assert "vip" not in seen_preempted
    validate_trace(ENGINE_REQUEST, trace)


def test_no_waiting_request_is_admitted_in_a_step_that_preempted() -> None:
    cfg = EngineConfig(model="null", device="cpu", max_model_len=16, block_size=4,
                       num_gpu_blocks_override=4)
    eng = EngineCore(cfg)
    eng.add_request(req("a", [5] * 7, max_tokens=9))
    eng.add_request(req("b", [5] * 7, max_tokens=9))
    toks, order = run(eng)
    assert sorted(order) == ["a", "b"] and all(len(t) == 9 for t in toks.values())
    assert eng.scheduler.num_preemptions >= 1


def test_prefix_caching_under_preemption_and_eviction_keeps_greedy_exact() -> None:
    """Shared prompt prefixes, a pool too small for everyone, arrivals mid-flight: every
    request's greedy tokens still equal the dense reference, and every block comes back."""
    import random

    rng = random.Random(5)
    cfg = EngineConfig(model="tiny", device="cpu", max_model_len=40, block_size=4,
                       num_gpu_blocks_override=10, max_num_batched_tokens=20,
                       enable_prefix_caching=True)
    eng = EngineCore(cfg)
    arch, params = TinyRandomSource(seed=0).load()
    stems = [[rng.randrange(3, 500) for _ in range(9)] for _ in range(2)]
    prompts = {f"r{i}": stems[i % 2][: rng.randrange(5, 10)] + [rng.randrange(3, 500)
                                                               for _ in range(rng.randrange(3))]
               for i in range(8)}
    toks: dict[str, list[int]] = defaultdict(list)
    pending = list(prompts.items())
    for _ in range(500):
        if pending and (len(pending) > 4 or rng.random() < 0.3):
            rid, p = pending.pop(0)
            eng.add_request(req(rid, p, max_tokens=rng.randrange(8, 24), ignore_eos=True))
        if not pending and not eng.has_unfinished_requests():
            break
        for o in eng.step().outputs:
            toks[o.request_id] += o.new_token_ids
    assert not pending and not eng.has_unfinished_requests()
    assert eng.scheduler.num_preemptions > 0 and eng.get_stats().prefix_cache_hits > 0
    for rid, p in prompts.items():
        assert toks[rid] == dense_greedy(arch, params, p, len(toks[rid])), rid
    assert eng.kv.num_free_blocks == 10


# -- priority policy: a waiting request with a better priority preempts a running one -------------


def state_of(eng: EngineCore, rid: str) -> EngineRequestState:
    return eng.scheduler.requests[rid].lifecycle.state


def test_a_better_waiting_request_takes_the_only_slot_by_preemption() -> None:
    trace: list = []  # type: ignore[type-arg]
    eng = EngineCore(EngineConfig(model="null", device="cpu", max_num_seqs=1), trace=trace)
    eng.add_request(req("low", [5, 6], priority=5, max_tokens=6, ignore_eos=True))
    eng.step()
    eng.step()
    assert state_of(eng, "low") is EngineRequestState.RUNNING
    eng.add_request(req("high", [7], priority=-1, max_tokens=3, ignore_eos=True))
    # The victim was picked for this step first: it leaves the batch, the winner takes it.
    reqs, nums = eng.scheduler.schedule()
    assert [r.request_id for r in reqs] == ["high"] and nums == [1]
    assert state_of(eng, "low") is EngineRequestState.PREEMPTED
    tokens = eng.executor.execute_model(reqs, nums)  # type: ignore[union-attr]
    eng.scheduler.update(reqs, nums, tokens)
    toks, order = run(eng)
    assert order == ["high", "low"]
    stats = eng.get_stats()
    assert stats.num_priority_preemptions == 1 and stats.num_preemptions == 1
    assert stats.scheduling_policy == "priority"
    assert len(toks["low"]) == 4  # 2 before, 4 after: recompute resumes, nothing is lost
    validate_trace(ENGINE_REQUEST, trace)


def test_a_better_waiting_request_takes_kv_blocks_by_preemption_and_greedy_stays_exact() -> None:
    trace: list = []  # type: ignore[type-arg]
    # 6 blocks of 4 tokens; "low" grows to 6 blocks on its own, so "high" finds none free.
    cfg = EngineConfig(model="tiny", device="cpu", max_model_len=24, block_size=4,
                       num_gpu_blocks_override=6, max_num_batched_tokens=32)
    eng = EngineCore(cfg, trace=trace)
    low_p, high_p = [(7 * j) % 400 + 3 for j in range(10)], [11, 12, 13, 14, 15]
    eng.add_request(req("low", low_p, priority=1, max_tokens=13, ignore_eos=True))
    before: dict[str, list[int]] = defaultdict(list)
    for _ in range(8):
        for o in eng.step().outputs:
            before[o.request_id] += o.new_token_ids
    assert eng.kv.num_free_blocks <= 1 and state_of(eng, "low") is EngineRequestState.RUNNING
    eng.add_request(req("high", high_p, priority=0, max_tokens=4, ignore_eos=True))
    for o in eng.step().outputs:
        before[o.request_id] += o.new_token_ids
    assert state_of(eng, "low") is EngineRequestState.PREEMPTED
    assert state_of(eng, "high") is EngineRequestState.RUNNING
    toks, order = run(eng)
    toks = {rid: before[rid] + toks.get(rid, []) for rid in ("low", "high")}
    assert order == ["high", "low"]
    arch, params = TinyRandomSource(seed=0).load()
    assert toks["high"] == dense_greedy(arch, params, high_p, 4)
    assert toks["low"] == dense_greedy(arch, params, low_p, 13)
    assert eng.scheduler.num_priority_preemptions == 1 and eng.kv.num_free_blocks == 6
    validate_trace(ENGINE_REQUEST, trace)


def test_the_victim_is_the_worst_priority_then_the_latest_arrival() -> None:
    eng = EngineCore(EngineConfig(model="null", device="cpu", max_num_seqs=3))
    eng.add_request(EngineCoreRequest("p1", [5], SamplingParams(max_tokens=50),
                                      arrival_time=9.0, priority=1))
    eng.add_request(EngineCoreRequest("p2-late", [5], SamplingParams(max_tokens=50),
                                      arrival_time=5.0, priority=2))
    eng.add_request(EngineCoreRequest("p2-early", [5], SamplingParams(max_tokens=50),
                                      arrival_time=1.0, priority=2))
    eng.step()
    eng.add_request(req("vip", [5], priority=0, max_tokens=50))
    eng.step()
    assert state_of(eng, "p2-late") is EngineRequestState.PREEMPTED
    assert {r.request_id for r in eng.scheduler.running} == {"p1", "p2-early", "vip"}
    assert eng.scheduler.num_priority_preemptions == 1


def test_equal_priorities_never_preempt_and_a_worse_one_waits() -> None:
    eng = EngineCore(EngineConfig(model="null", device="cpu", max_num_seqs=1))
    eng.add_request(EngineCoreRequest("a", [5], SamplingParams(max_tokens=4),
                                      arrival_time=50.0, priority=2))
    eng.step()
    # An earlier arrival time ranks better among equals but does not preempt.
    eng.add_request(EngineCoreRequest("b", [5], SamplingParams(max_tokens=4),
                                      arrival_time=1.0, priority=2))
    eng.add_request(req("c", [5], priority=7, max_tokens=4))
    _, order = run(eng)
    assert order == ["a", "b", "c"] and eng.scheduler.num_preemptions == 0


def test_arrival_time_orders_equal_priorities_then_the_order_received() -> None:
    eng = EngineCore(EngineConfig(model="null", device="cpu", max_num_seqs=1))
    for rid, at in [("t3", 3.0), ("t1", 1.0), ("t2-first", 2.0), ("t2-second", 2.0)]:
        eng.add_request(EngineCoreRequest(rid, [5], SamplingParams(max_tokens=2),
                                          arrival_time=at))
    eng.add_request(EngineCoreRequest("urgent", [5], SamplingParams(max_tokens=2),
                                      arrival_time=9.0, priority=-1))
    _, order = run(eng)
    assert order == ["urgent", "t1", "t2-first", "t2-second", "t3"]


def test_a_preempted_request_keeps_its_rank_over_later_equal_arrivals() -> None:
    eng = EngineCore(EngineConfig(model="null", device="cpu", max_num_seqs=1))
    eng.add_request(req("first", [5], priority=1, max_tokens=5))
    eng.step()
    eng.add_request(req("vip", [5], priority=0, max_tokens=2))
    eng.add_request(req("later", [5], priority=1, max_tokens=2))
    _, order = run(eng)
    assert order == ["vip", "first", "later"]


def test_no_priority_preemption_while_draining_for_a_pause() -> None:
    trace: list = []  # type: ignore[type-arg]
    eng = EngineCore(EngineConfig(model="null", device="cpu", max_num_seqs=1), trace=trace)
    eng.add_request(req("old", [5], priority=3, max_tokens=5))
    eng.step()
    fut = eng.pause_scheduler("wait")
    assert fut is not None
    eng.add_request(req("new", [5], priority=-3, max_tokens=2))  # queues behind the drain
    _, order = run(eng)
    assert fut.done() and order == ["old"] and eng.scheduler.num_preemptions == 0
    eng.resume_scheduler()
    _, order = run(eng)
    assert order == ["new"]
    validate_trace(ENGINE_REQUEST, trace)


def test_fcfs_policy_never_preempts_for_waiting_and_refuses_priorities() -> None:
    eng = EngineCore(EngineConfig(model="null", device="cpu", max_num_seqs=1,
                                  scheduling_policy="fcfs"))
    eng.add_request(req("a", [5], max_tokens=4))
    eng.add_request(req("b", [5], max_tokens=4))
    eng.add_request(req("vip", [5], priority=-1, max_tokens=4))
    out = {o.request_id: o for o in eng.step().outputs}
    assert out["vip"].finish_reason is FinishReason.ERROR
    assert "scheduling_policy" in (out["vip"].error or "")
    _, order = run(eng)
    assert order == ["a", "b"] and eng.scheduler.num_preemptions == 0
    assert eng.get_stats().scheduling_policy == "fcfs"


def test_scheduling_policy_is_validated_by_name() -> None:
    with pytest.raises(ValueError, match=r"EngineConfig\.scheduling_policy='lifo'"):
        EngineConfig(scheduling_policy="lifo")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_arrival_time_is_an_error_output(bad: float) -> None:
    eng = EngineCore(EngineConfig(model="null", device="cpu"))
    eng.add_request(EngineCoreRequest("x", [5], arrival_time=bad))
    eng.add_request(req("ok", [5], max_tokens=2))
    toks, _ = run(eng)
    assert toks == {"x": [], "ok": toks["ok"]} and len(toks["ok"]) == 2


def test_random_priorities_under_pressure_finish_every_request_exactly() -> None:
    """Random priorities and arrivals, few slots and blocks: every request finishes with
    exactly its tokens, no block leaks, and every request trace obeys the spec."""
    import random

    rng = random.Random(3)
    trace: list = []  # type: ignore[type-arg]
    cfg = EngineConfig(model="null", device="cpu", max_model_len=32, block_size=4,
                       num_gpu_blocks_override=12, max_num_seqs=3, max_num_batched_tokens=16)
    eng = EngineCore(cfg, trace=trace)
    want: dict[str, int] = {}
    got: dict[str, int] = defaultdict(int)
    order: list[str] = []
    for i in range(40):
        if rng.random() < 0.6:
            rid, n = f"r{i}", rng.randrange(1, 12)
            want[rid] = n
            eng.add_request(req(rid, [5] * rng.randrange(1, 12), priority=rng.randrange(-2, 3),
                                max_tokens=n, ignore_eos=True))
        for o in eng.step().outputs:
            got[o.request_id] += len(o.new_token_ids)
            order += [o.request_id] if o.finished else []
    toks, rest = run(eng)
    for rid, t in toks.items():
        got[rid] += len(t)
    assert sorted(order + rest) == sorted(want) and dict(got) == want
    assert eng.scheduler.num_priority_preemptions > 0 and eng.kv.num_free_blocks == 12
    validate_trace(ENGINE_REQUEST, trace)


def _slow_path_only(eng: EngineCore) -> None:
    """Disable the steady-decode fast path (and with it the column-wise batch): every
    schedule walks the running list."""
    sched = eng.scheduler
    sched._use_batch = False
    update = sched.update

    def update_then_forget(*args: object, **kwargs: object) -> object:
        out = update(*args, **kwargs)  # type: ignore[arg-type]
        sched._decode_ready = None
        return out

    sched.update = update_then_forget  # type: ignore[method-assign]


def _effective(eng: EngineCore) -> list[tuple[str, int, int, list[int], list[int]]]:
    """Each running request's counters, tokens and blocks as the engine means them: a row of
    the decode batch holds some of them in its columns (read here without writing back)."""
    sched = eng.scheduler
    batch = sched._batch
    rows = {} if batch is None else {id(r): i for i, r in enumerate(batch.reqs)}
    out = []
    for r in sched.running:
        i = rows.get(id(r))
        if i is None:
            out.append((r.request_id, r.num_tokens, r.num_computed_tokens,
                        list(r.all_token_ids), list(r.block_ids)))
        else:
            ntok, base = int(batch.ntok[i]), int(batch.base[i])
            toks = list(r.all_token_ids) + batch.buf[:ntok - base, i].tolist()
            out.append((r.request_id, ntok, ntok - 1, toks, list(r.block_ids)))
    return out


def _random_load(seed: int, model: str, steps: int, device: str = "cpu") -> None:
    """Two engines under the same random load (chunked prefill, block boundaries, KV
    pressure and preemption, priorities, stop ids and EOS, seeded sampling, prefix caching,
    aborts, pauses): one may take the fast path and the column-wise batch, one never does.
    Every step must schedule the same requests and tokens, produce the same outputs, and
    leave every running request with the same counters, tokens and blocks."""
    import random

    rng = random.Random(seed)
    cfg = EngineConfig(model=model, device=device, max_num_seqs=rng.choice([4, 16, 64]),
                       max_num_batched_tokens=rng.choice([16, 64, 512]), block_size=4,
                       max_model_len=128, num_gpu_blocks_override=rng.choice([48, 96, 400]),
                       enable_prefix_caching=rng.random() < 0.5, seed=seed)
    fast = EngineCore(cfg, stream_outputs=True)
    slow = EngineCore(cfg, stream_outputs=True)
    _slow_path_only(slow)
    plans: list[list[tuple[list[str], list[int]]]] = [[], []]
    for eng, plan in ((fast, plans[0]), (slow, plans[1])):
        schedule = eng.scheduler.schedule

        def recording(schedule: object = schedule, plan: list = plan) -> object:
            reqs, nums = schedule()  # type: ignore[operator]
            plan.append(([r.request_id for r in reqs], list(nums)))
            return reqs, nums

        eng.scheduler.schedule = recording  # type: ignore[method-assign]
    live: list[str] = []
    took_fast = took_batch = 0
    shared = [rng.randrange(3, 400) for _ in range(12)]  # a common prefix, for the cache
    for step in range(steps):
        if rng.random() < 0.15:
            rid = f"s{seed}-{step}"
            prompt = [rng.randrange(3, 400) for _ in range(rng.randrange(1, 40))]
            if rng.random() < 0.3:
                prompt = shared + prompt
            params: dict[str, object] = {"max_tokens": rng.randrange(1, 60),
                                         "ignore_eos": rng.random() < 0.8}
            if rng.random() < 0.2:
                params["stop_token_ids"] = [rng.randrange(3, 400) for _ in range(40)]
            if rng.random() < 0.3:
                params.update(temperature=0.8, top_k=20, seed=rng.randrange(1 << 20))
            r = req(rid, prompt, priority=rng.randrange(3), **params)
            for eng in (fast, slow):
                eng.add_request(r)
            live.append(rid)
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            for eng in (fast, slow):
                eng.abort_requests([victim])
        if rng.random() < 0.02:
            for eng in (fast, slow):
                eng.pause_scheduler("keep")
                eng.resume_scheduler()
        ready_before = fast.scheduler._decode_ready is fast.scheduler.running
        a, b = fast.step(), slow.step()
        took_fast += ready_before and bool(plans[0]) and bool(plans[0][-1][0])
        took_batch += fast.scheduler.step_batch is not None
        assert plans[0] == plans[1], f"step {step}: schedules diverged"
        assert a.outputs == b.outputs and a.stream_ids == b.stream_ids, f"step {step}"
        assert a.stream_tokens == b.stream_tokens and a.finished_requests == b.finished_requests
        assert _effective(fast) == _effective(slow), f"step {step}: request state diverged"
        for r in fast.scheduler.running:  # every running request holds its computed tokens
            assert len(r.block_ids) * cfg.block_size >= r.num_computed_tokens
    assert took_fast > 0, "the fast path was never taken: the test compares nothing"
    assert took_batch > 0, "the decode batch was never used: the test compares nothing"


@pytest.mark.parametrize("seed", range(12))
def test_the_decode_fast_path_schedules_exactly_as_the_full_pass(seed: int) -> None:
    _random_load(seed, "null", 400)


@pytest.mark.parametrize("seed", range(2))
def test_the_decode_batch_runs_the_tiny_model_exactly_as_the_full_pass(seed: int) -> None:
    _random_load(100 + seed, "tiny", 80)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed", range(2))
def test_the_decode_batch_on_cuda_runs_exactly_as_the_full_pass(seed: int) -> None:
    # The batch's inputs are built from numpy columns and copied to the device in one go; a
    # row or dtype slip there shows only where host and device memory differ.
    _random_load(200 + seed, "tiny", 80, device="cuda")


# -- the fast paths against the general path, on Hypothesis-made request mixes -------------

_ADD = st.tuples(
    st.just("add"),
    st.integers(1, 60),  # prompt length: past max_num_batched_tokens, several prefill steps
    st.integers(1, 40),  # max_tokens
    st.booleans(),  # ignore_eos
    st.lists(st.integers(3, 511), max_size=40),  # stop token ids
    st.integers(0, 2),  # priority
    st.booleans(),  # share the common prefix (prefix caching)
)
_ABORT = st.tuples(st.just("abort"), st.integers(0, 1000))  # an index into the ids added
_STEPS = st.tuples(st.just("step"), st.integers(1, 12))
_PAUSE = st.tuples(st.just("pause"))


@contextlib.contextmanager
def _worker_without_decode_batch() -> Iterator[None]:
    """Engines built inside run a worker that cannot run a ``DecodeBatch`` (as a worker
    without ``execute_decode`` would): their scheduler never chooses one."""
    from enginewire.runtime.executor import NullWorker

    with mock.patch.object(NullWorker, "supports_decode_batch", False):
        yield


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(st.one_of(_ADD, _ADD, _ADD, _ABORT, _STEPS, _STEPS, _PAUSE),
                    min_size=4, max_size=40),
       max_num_seqs=st.sampled_from([2, 4, 16]),
       budget=st.sampled_from([8, 16, 64]),
       blocks=st.sampled_from([16, 20, 400]),  # 16 of 4 tokens: preemption under KV pressure
       caching=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]))
def test_every_fast_path_makes_what_the_general_path_makes(
        ops: list[tuple[Any, ...]], max_num_seqs: int, budget: int, blocks: int, caching: bool,
        policy: str) -> None:
    """Three engines take the same request mix: one with every fast path (steady decode,
    ``Scheduler.steady_decode``, and the column-wise batch, ``decode_batch_applies``), one
    whose worker cannot run the batch (steady decode per request), and one that only ever
    takes the general path (``_schedule_full`` and ``update``). Every step must schedule the
    same requests and tokens, make the same outputs and stream columns, and leave every
    running request with the same counters, tokens and blocks; so must their drains."""
    cfg = EngineConfig(model="null", device="cpu", max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, block_size=4, max_model_len=64,
                       num_gpu_blocks_override=blocks, enable_prefix_caching=caching,
                       scheduling_policy=policy, seed=7)
    fast = EngineCore(cfg, stream_outputs=True)
    with _worker_without_decode_batch():
        per_request = EngineCore(cfg, stream_outputs=True)
    slow = EngineCore(cfg, stream_outputs=True)
    _slow_path_only(slow)
    engines = (fast, per_request, slow)
    assert not per_request.scheduler._use_batch
    plans: list[list[tuple[list[str], list[int]]]] = [[] for _ in engines]
    for eng, plan in zip(engines, plans, strict=True):
        schedule = eng.scheduler.schedule

        def recording(schedule: Any = schedule, plan: list[Any] = plan) -> Any:
            reqs, nums = schedule()
            plan.append(([r.request_id for r in reqs], list(nums)))
            return reqs, nums

        eng.scheduler.schedule = recording  # type: ignore[method-assign]
    shared = [(11 * j) % 500 + 3 for j in range(12)]
    added: list[str] = []
    took_batch = chunked = 0

    def step(n: int) -> None:
        for _ in range(n):
            a, b, c = (eng.step() for eng in engines)
            where = f"step {len(plans[0])} of {ops}"
            assert plans[0] == plans[1] == plans[2], f"schedules diverged at {where}"
            for other in (b, c):
                assert a.outputs == other.outputs, where
                assert (a.stream_ids, a.stream_tokens) == (other.stream_ids, other.stream_tokens)
                assert a.finished_requests == other.finished_requests, where
            assert _effective(fast) == _effective(per_request) == _effective(slow), where
            nonlocal took_batch, chunked
            took_batch += fast.scheduler.step_batch is not None
            chunked += any(0 < r.num_computed_tokens < r.num_prompt_tokens
                           for r in slow.scheduler.running)

    try:
        for op in ops:
            if op[0] == "add":
                _, n, max_tokens, ignore_eos, stops, priority, prefix = op
                rid = f"r{len(added)}"
                prompt = [(7 * j + len(added)) % 500 + 3 for j in range(n)]
                r = req(rid, (shared + prompt)[:60] if prefix else prompt, priority=priority,
                        max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stops)
                for eng in engines:
                    eng.add_request(r)
                added.append(rid)
            elif op[0] == "abort":
                if added:
                    victim = added[op[1] % len(added)]
                    for eng in engines:
                        eng.abort_requests([victim])
            elif op[0] == "pause":
                for eng in engines:
                    eng.pause_scheduler("keep")
                    eng.resume_scheduler()
            else:
                step(op[1])
        for _ in range(3000):
            if not any(e.has_unfinished_requests() or e.has_pending_outputs() for e in engines):
                break
            step(1)
        else:
            raise AssertionError(f"the engines did not drain: {ops}")
        for eng in engines:
            assert not eng.scheduler.requests and eng.kv.num_free_blocks == blocks
        # What the mix reached (--hypothesis-show-statistics): the comparison is only as good.
        event(f"decode batch steps: {'some' if took_batch else 'none'}")
        event(f"preemptions: {'some' if slow.scheduler.num_preemptions else 'none'}")
        event(f"several prefill steps: {'some' if chunked else 'none'}")
    finally:
        for eng in engines:
            eng.shutdown()


def test_requests_of_every_length_decode_as_one_batch() -> None:
    """Prompts of different lengths cross KV block boundaries on different steps; the batch
    grows blocks for those rows itself, so steady decode stays column-wise (a proof that
    every block is already in hand would almost never hold)."""
    cfg = EngineConfig(model="null", max_num_seqs=32, block_size=4, max_model_len=128)
    eng = EngineCore(cfg, stream_outputs=True)
    for i in range(32):
        eng.add_request(req(f"r{i}", [5 + i] * (i + 1), max_tokens=60, ignore_eos=True))
    batched = 0
    for _ in range(40):
        eng.step()
        batched += eng.scheduler.step_batch is not None
    assert batched >= 35, batched


def test_requests_aborted_before_they_run_leave_the_waiting_heap() -> None:
    """A paused engine takes bursts of adds and aborts; their heap entries used to stay until
    a later request was scheduled (50k entries after 10 rounds of 5k in the audit)."""
    eng = EngineCore(EngineConfig(model="null", device="cpu"))
    eng.sleep(0)
    for round_ in range(4):
        ids = [f"r{round_}-{i}" for i in range(3000)]
        for rid in ids:
            eng.add_request(req(rid, [5], max_tokens=2))
        eng.abort_requests(ids)
    sched = eng.scheduler
    assert sched.num_waiting == 0 and not sched.requests
    assert len(sched._waiting) <= 1024  # stale entries are bounded, not kept
    eng.wake_up()
    eng.add_request(req("after", [5], max_tokens=2, ignore_eos=True))
    toks, order = run(eng)
    assert order[-1] == "after" and len(toks["after"]) == 2


def test_rows_to_grow_follow_the_block_boundaries_through_steps_and_keeps() -> None:
    """DecodeBatch.rows_to_grow (dict lookups, no NumPy before the forward) names exactly
    the rows with (ntok - 1) % block_size == 0, step after step and after rows leave."""
    import numpy as np

    from enginewire.runtime.scheduler import DecodeBatch

    class Row:
        def __init__(self, i: int, n: int) -> None:
            self.request_id, self.num_tokens, self.stop_len, self.eos = f"r{i}", n, 10**6, -1
            self.all_token_ids, self.stop_ids, self.num_cached_tokens = [7] * n, (), 0

    rng = np.random.default_rng(5)
    batch = DecodeBatch([Row(i, int(n)) for i, n in enumerate(rng.integers(1, 70, 600))])
    for step in range(200):
        bs = 5 if step > 150 else 16  # a new block size regroups
        expect = np.flatnonzero((batch.ntok - 1) % bs == 0).tolist()
        assert sorted(batch.rows_to_grow(bs)) == expect, (step, bs)
        batch.record(np.full(len(batch), 3, np.int64))
        if step % 37 == 36:
            batch.keep(rng.random(len(batch)) < 0.8)


def test_a_decode_batch_compares_lengths_only_when_a_row_can_reach_its_limit() -> None:
    """DecodeBatch.length_finish_possible skips the whole-batch length check on most steps;
    it must never skip a step where a row reaches its limit. And the token history a batch
    writes back (one contiguous column a step while the rows are aligned, an indexed write
    once a partial write-back misaligned them) is every token recorded, in order."""
    import numpy as np

    from enginewire.runtime.scheduler import DecodeBatch

    class Row:
        def __init__(self, i: int, n: int, stop: int) -> None:
            self.request_id, self.num_tokens, self.stop_len, self.eos = f"r{i}", n, stop, -1
            self.all_token_ids, self.stop_ids, self.num_cached_tokens = [7] * n, (), 0
            self.num_computed_tokens = n - 1

    rng = np.random.default_rng(9)
    sizes = rng.integers(1, 40, 300)
    rows = [Row(i, int(n), int(n + rng.integers(1, 400))) for i, n in enumerate(sizes)]
    expect = {r.request_id: list(r.all_token_ids) for r in rows}
    batch = DecodeBatch(rows)
    checked = 0
    for step in range(500):
        if not len(batch):
            break
        toks = rng.integers(0, 1000, len(batch))
        batch.record(toks)
        for rid, t in zip(batch.ids, toks.tolist(), strict=True):
            expect[rid].append(t)
        at_limit = batch.ntok >= batch.stop_len
        if at_limit.any():
            assert batch.length_finish_possible(), step
        checked += batch.length_finish_possible()
        if step % 7 == 3:  # a partial write-back (what prefix caching does each block)
            batch.flush_rows(np.flatnonzero(rng.random(len(batch)) < 0.3).tolist())
        if at_limit.any():
            batch.flush_rows(np.flatnonzero(at_limit).tolist())
            batch.keep(~at_limit)
    assert not len(batch) and checked < 300  # skipped most steps, finished every row
    for r in rows:
        assert r.all_token_ids == expect[r.request_id], r.request_id
