"""Pause, sleep and wake: the three modes, the three levels, partial wake, memory released."""

from __future__ import annotations

import gc
import weakref
from collections import defaultdict
from concurrent.futures import Future

import pytest
import torch

from enginewire.protocol.messages import EngineCoreRequest, FinishReason, SamplingParams
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine import EngineCore
from enginewire.runtime.model import TinyRandomSource, dense_greedy, null_token
from enginewire.spec import (
    ENGINE,
    ENGINE_REQUEST,
    EngineEvent,
    EngineState,
    SpecViolation,
    UtilityError,
    validate_trace,
)
from enginewire.spec.engine import HAS_WORK, NO_WORK, PARTIAL

torch.set_num_threads(1)

NULL = EngineConfig(model="null", device="cpu")
TINY = EngineConfig(model="tiny", device="cpu", max_model_len=64, block_size=4,
                    kv_cache_memory_bytes=1 << 20)


def req(rid: str, prompt: list[int], **sp: object) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(**sp))  # type: ignore[arg-type]


class Collector:
    """Steps an engine and keeps every output per request, checking one finish per id."""

    def __init__(self, eng: EngineCore) -> None:
        self.eng = eng
        self.toks: dict[str, list[int]] = defaultdict(list)
        self.fin: dict[str, FinishReason] = {}

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            for o in self.eng.step().outputs:
                assert o.request_id not in self.fin, f"output after finish: {o}"
                self.toks[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    self.fin[o.request_id] = o.finish_reason

    def drain(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not (self.eng.has_unfinished_requests() or self.eng.has_pending_outputs()):
                return
            self.step()
        raise AssertionError("engine did not go idle")


def resident_bytes(eng: EngineCore) -> tuple[int, int]:
    m = eng.collective_rpc("report_memory")[0]
    return m["device_tensor_bytes"], m["host_offload_bytes"]


def test_pause_abort_then_resume() -> None:
    trace: list = []  # type: ignore[type-arg]
    eng = EngineCore(NULL, trace=trace)
    c = Collector(eng)
    eng.add_request(req("a", [5], max_tokens=10))
    c.step(2)
    assert eng.call_utility("pause_scheduler", ["abort"]) is None
    assert eng.lifecycle.state is EngineState.PAUSED and eng.is_sleeping()
    eng.add_request(req("b", [5], max_tokens=3, seed=2))  # queued, not scheduled
    assert not eng.has_unfinished_requests() and eng.has_pending_outputs()
    c.step(3)
    assert c.fin == {"a": FinishReason.ABORT} and "b" not in c.toks
    eng.resume_scheduler()
    assert eng.lifecycle.state is EngineState.RUNNING
    c.drain()
    assert c.toks["b"] == [null_token(2, i) for i in (1, 2, 3)]
    eng.resume_scheduler()  # not paused: a no-op
    validate_trace(ENGINE, trace)
    validate_trace(ENGINE_REQUEST, trace)


def test_pause_keep_parks_and_resumes_without_changing_tokens() -> None:
    eng = EngineCore(NULL)
    c = Collector(eng)
    eng.add_request(req("k", [5, 6], max_tokens=8, seed=7))
    c.step(3)
    assert eng.pause_scheduler("keep") is None
    assert not eng.has_unfinished_requests() and eng.num_live_requests() == 1
    blocks = eng.kv.num_free_blocks
    c.step(5)  # nothing moves while paused
    assert len(c.toks["k"]) == 3 and eng.kv.num_free_blocks == blocks
    eng.resume_scheduler()
    c.drain()
    assert c.toks["k"] == [null_token(7, i) for i in range(2, 10)]
    assert c.fin["k"] is FinishReason.LENGTH


def test_pause_wait_defers_the_reply_until_drained() -> None:
    trace: list = []  # type: ignore[type-arg]
    eng = EngineCore(NULL, trace=trace)
    c = Collector(eng)
    eng.add_request(req("w", [5], max_tokens=4))
    c.step()
    fut = eng.call_utility("pause_scheduler", ["wait"])
    assert isinstance(fut, Future) and not fut.done()
    assert eng.lifecycle.state is EngineState.DRAINING
    eng.add_request(req("late", [5], max_tokens=2))  # arrives while draining: must wait
    again = eng.pause_scheduler("wait")
    assert isinstance(again, Future)
    c.drain()
    assert fut.done() and fut.result() is None and again.result() is None
    assert eng.lifecycle.state is EngineState.PAUSED
    assert c.fin == {"w": FinishReason.LENGTH} and "late" not in c.toks
    eng.resume_scheduler()
    c.drain()
    assert c.fin["late"] is FinishReason.LENGTH
    validate_trace(ENGINE, trace)


def test_abort_during_drain_completes_the_waiters() -> None:
    eng = EngineCore(NULL)
    c = Collector(eng)
    eng.add_request(req("x", [5], max_tokens=50))
    c.step()
    fut = eng.pause_scheduler("wait")
    assert isinstance(fut, Future)
    eng.abort_requests(["x"])  # the last draining request ends: drained without a step
    assert fut.done() and eng.lifecycle.state is EngineState.PAUSED
    c.step()
    assert c.fin == {"x": FinishReason.ABORT}
    eng.add_request(req("y", [5], max_tokens=50))
    eng.resume_scheduler()
    c.step()
    fut2 = eng.pause_scheduler("wait")
    assert eng.pause_scheduler("abort") is None  # stop waiting: abort the rest
    assert isinstance(fut2, Future) and fut2.done()
    assert eng.lifecycle.state is EngineState.PAUSED


def test_sleep_level1_releases_kv_and_offloads_weights_then_wakes() -> None:
    eng = EngineCore(TINY)
    arch, params = TinyRandomSource(seed=0).load()
    c = Collector(eng)
    device_before, host_before = resident_bytes(eng)
    assert host_before == 0
    kv_ref = weakref.ref(eng.executor.driver.kv_caches[0])  # type: ignore[union-attr]
    assert eng.sleep(1) is None
    gc.collect()
    assert kv_ref() is None  # the KV storage is gone, not just unreferenced by us
    device_after, host_after = resident_bytes(eng)
    assert device_after == 0 and host_after > 0
    assert eng.lifecycle.state is EngineState.SLEEPING and eng.is_sleeping()
    with pytest.raises(SpecViolation):
        eng.resume_scheduler()
    assert eng.lifecycle.state is EngineState.SLEEPING
    eng.add_request(req("s", [9, 8, 7], max_tokens=5, ignore_eos=True))  # queued while asleep
    c.step()
    assert not c.toks
    assert eng.wake_up() is True
    assert eng.lifecycle.state is EngineState.RUNNING
    assert resident_bytes(eng) == (device_before, 0)
    c.drain()
    assert c.toks["s"] == dense_greedy(arch, params, [9, 8, 7], 5)


def test_sleep_level2_frees_weights_and_reloads_from_source() -> None:
    eng = EngineCore(TINY)
    arch, params = TinyRandomSource(seed=0).load()
    w_ref = weakref.ref(eng.executor.driver.model.params["model.norm.weight"])  # type: ignore[union-attr]
    eng.sleep(2)
    gc.collect()
    assert w_ref() is None and resident_bytes(eng) == (0, 0)
    with pytest.raises(RuntimeError, match="released"):
        eng.save_sharded_state("/nonexistent-never-written")
    assert eng.wake_up() is True
    reloaded = eng.executor.driver.model.params  # type: ignore[union-attr]
    assert all(torch.equal(reloaded[k], params[k]) for k in params)
    c = Collector(eng)
    eng.add_request(req("r", [1, 2, 3, 4], max_tokens=4, ignore_eos=True))
    c.drain()
    assert c.toks["r"] == dense_greedy(arch, params, [1, 2, 3, 4], 4)


def test_deeper_sleep_drops_the_host_copy() -> None:
    eng = EngineCore(TINY)
    eng.sleep(1)
    assert resident_bytes(eng)[1] > 0
    eng.sleep(2)
    assert resident_bytes(eng) == (0, 0)
    assert eng.wake_up()


def test_partial_wake_keeps_scheduling_off() -> None:
    trace: list = []  # type: ignore[type-arg]
    eng = EngineCore(TINY, trace=trace)
    eng.sleep(1)
    assert eng.wake_up(["weights"]) is False
    assert eng.lifecycle.state is EngineState.SLEEPING and eng.is_sleeping()
    device, host = resident_bytes(eng)
    assert device > 0 and host == 0  # weights back, KV still released
    eng.add_request(req("p", [4, 5], max_tokens=2))
    assert not eng.has_unfinished_requests()
    assert eng.wake_up(["scheduling"]) is False  # releases nothing, restores nothing
    assert eng.wake_up(["kv_cache"]) is True
    assert eng.lifecycle.state is EngineState.RUNNING
    c = Collector(eng)
    c.drain()
    assert len(c.toks["p"]) == 2
    assert eng.wake_up() is True  # awake: a no-op
    validate_trace(ENGINE, trace)


def test_wake_up_refuses_a_bare_tag_string_naming_it() -> None:
    # call_utility("wake_up", "weights") reaches the engine unchecked by the client's
    # wrapper; iterated, the string was refused as the tag 'w'.
    eng = EngineCore(NULL)
    eng.sleep(1)
    with pytest.raises(TypeError, match=r"list such as \['weights'\].*got 'weights'"):
        eng.wake_up("weights")  # type: ignore[arg-type]
    assert eng.is_sleeping()  # refused before anything changed
    assert eng.wake_up(["weights", "kv_cache"]) is True


def test_sleep_keep_parks_requests_and_recomputes_their_kv_after_wake() -> None:
    trace: list = []  # type: ignore[type-arg]
    eng = EngineCore(TINY, trace=trace)
    arch, params = TinyRandomSource(seed=0).load()
    c = Collector(eng)
    prompts = {"a": [3, 1, 4, 1, 5, 9, 2, 6], "b": [2, 7, 1, 8]}
    for rid, p in prompts.items():
        eng.add_request(req(rid, p, max_tokens=9, ignore_eos=True))
    c.step(4)
    assert eng.sleep(1, "keep") is None
    assert eng.num_live_requests() == 2 and eng.kv.num_free_blocks == eng.kv.num_blocks
    assert eng.wake_up() is True and eng.lifecycle.state is EngineState.RUNNING
    c.drain()
    for rid, p in prompts.items():
        assert c.toks[rid] == dense_greedy(arch, params, p, 9), rid
    assert [t[2] for t in trace if t[0] == "engine_request"].count("PREEMPT") == 2
    validate_trace(ENGINE_REQUEST, trace)


def test_sleep_wait_releases_memory_once_drained() -> None:
    eng = EngineCore(TINY)
    c = Collector(eng)
    eng.add_request(req("d", [5, 6], max_tokens=6, ignore_eos=True))
    c.step()
    fut = eng.call_utility("sleep", [1, "wait"])
    assert isinstance(fut, Future) and not fut.done()
    assert resident_bytes(eng)[1] == 0  # nothing released yet
    c.drain()
    assert fut.result(timeout=0) is None
    assert c.fin["d"] is FinishReason.LENGTH and len(c.toks["d"]) == 6
    assert eng.lifecycle.state is EngineState.SLEEPING and resident_bytes(eng)[0] == 0
    assert eng.wake_up() is True and eng.lifecycle.state is EngineState.IDLE


@pytest.mark.parametrize("call", [["sleep", [1, "wait"]], ["pause_scheduler", ["wait"]]])
def test_a_wake_up_while_draining_ends_the_wait(call: list) -> None:  # type: ignore[type-arg]
    """It used to be a no-op answered "fully awake", after which the engine drained and fell
    asleep anyway, leaving new requests queued for good."""
    trace: list = []  # type: ignore[type-arg]
    eng = EngineCore(TINY, trace=trace)
    c = Collector(eng)
    eng.add_request(req("d", [5, 6], max_tokens=6, ignore_eos=True))
    c.step()
    fut = eng.call_utility(*call)
    assert isinstance(fut, Future) and eng.lifecycle.state is EngineState.DRAINING
    eng.add_request(req("queued", [7], max_tokens=2, ignore_eos=True))  # waits for the drain
    assert eng.wake_up() is True
    assert eng.lifecycle.state is EngineState.RUNNING and not eng.is_sleeping()
    with pytest.raises(UtilityError, match="ended by wake_up"):
        fut.result(timeout=0)
    c.drain()
    assert c.fin == {"d": FinishReason.LENGTH, "queued": FinishReason.LENGTH}
    assert eng.lifecycle.state is EngineState.IDLE and resident_bytes(eng)[1] == 0
    validate_trace(ENGINE, trace)


def test_level0_sleep_is_a_pause() -> None:
    eng = EngineCore(NULL)
    eng.add_request(req("z", [5], max_tokens=3))
    eng.step()
    assert eng.sleep(0, "keep") is None
    assert eng.lifecycle.state is EngineState.PAUSED and eng.is_sleeping()
    assert eng.wake_up(["scheduling"]) is True
    assert eng.lifecycle.state is EngineState.RUNNING


def test_bad_sleep_arguments() -> None:
    eng = EngineCore(NULL)
    for args in ((3,), (True,), (1, "later")):
        with pytest.raises(ValueError):
            eng.sleep(*args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pause mode"):
        eng.pause_scheduler("now")
    with pytest.raises(ValueError, match="wake_up tag"):
        eng.wake_up(["gpu"])
    assert eng.lifecycle.state is EngineState.IDLE


def test_sleep_discards_the_prefix_cache_with_the_kv_it_indexed() -> None:
    """Sleep (level 1) frees the KV storage, so the prefix cache that indexed it must go too:
    a prompt repeated after wake_up that "reused" cached blocks would read discarded KV and
    generate different tokens than before the sleep."""
    cfg = EngineConfig(model="tiny", device="cpu", max_model_len=128, block_size=4,
                       enable_prefix_caching=True, kv_cache_memory_bytes=2 << 20)
    eng = EngineCore(cfg)
    arch, params = TinyRandomSource(seed=0).load()
    prompt = list(range(1, 40))
    c = Collector(eng)
    cached: dict[str, int] = {}
    for rid in ("before", "after"):
        eng.add_request(req(rid, prompt, max_tokens=8, ignore_eos=True))
        for _ in range(200):
            if rid in c.fin:
                break
            for o in eng.step().outputs:
                c.toks[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    c.fin[o.request_id] = o.finish_reason
                    cached[o.request_id] = o.num_cached_tokens
        assert c.fin.get(rid) is FinishReason.LENGTH
        if rid == "before":
            assert eng.sleep(1) is None
            assert eng.wake_up() is True
    assert c.toks["before"] == dense_greedy(arch, params, prompt, 8)
    assert c.toks["after"] == c.toks["before"]
    assert cached == {"before": 0, "after": 0}
    eng.shutdown()


@pytest.mark.parametrize(("event", "extra"), [(EngineEvent.RESUME, set()),
                                              (EngineEvent.WAKE_UP, {PARTIAL})])
def test_the_table_splits_resume_and_wake_only_on_guards_the_engine_reads(
        event: EngineEvent, extra: set[str]) -> None:
    """``resume_scheduler`` and ``wake_up`` take their guard from the table
    (``EngineCore._fire_resolving``): HAS_WORK or NO_WORK wherever its rows split, and the
    wake-up PARTIAL where memory was released. A new guard on these events needs a reading
    there; this says so before a scenario reaches it."""
    for state in EngineState:
        guards = set(ENGINE.guards(state, event)) - {None}
        assert guards <= {HAS_WORK, NO_WORK, *extra}, (state, guards)
        assert not guards or {HAS_WORK, NO_WORK} <= guards, (state, guards)
