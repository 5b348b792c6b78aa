"""Scheduler: token budget and chunked prefill, max_num_seqs, priority order, preemption."""

from __future__ import annotations

from collections import defaultdict

import torch

from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
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
    assert eng.scheduler.num_preemptions > 0 and eng.get_stats()["prefix_cache_hits"] > 0
    for rid, p in prompts.items():
        assert toks[rid] == dense_greedy(arch, params, p, len(toks[rid])), rid
    assert eng.kv.num_free_blocks == 10
