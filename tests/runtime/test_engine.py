"""EngineCore: config validation, request lifecycle, correctness against the dense reference,
invalid requests, aborts, stop conditions, sampling, utilities, shutdown, fault hook."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from concurrent.futures import Future

import pytest
import torch

from enginewire.protocol.codec import checked_request_type
from enginewire.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
)
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine import EngineCore
from enginewire.runtime.fault_points import FaultPoint
from enginewire.runtime.model import TinyRandomSource, dense_greedy, null_token
from enginewire.spec import (
    ENGINE,
    ENGINE_REQUEST,
    ClientClosedError,
    EngineDeadError,
    EngineState,
    SpecViolation,
    UtilityError,
    validate_trace,
)

torch.set_num_threads(1)

NULL = EngineConfig(model="null", device="cpu")
TINY = EngineConfig(model="tiny", device="cpu", max_model_len=128,
                    kv_cache_memory_bytes=2 * 1024 * 1024)


def req(rid: str, prompt: list[int], **sp: object) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(**sp))  # type: ignore[arg-type]


def drain(eng: EngineCore, max_steps: int = 5000) -> tuple[
        dict[str, list[int]], dict[str, EngineCoreOutput]]:
    toks: dict[str, list[int]] = defaultdict(list)
    fin: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not (eng.has_unfinished_requests() or eng.has_pending_outputs()):
            return dict(toks), fin
        for o in eng.step().outputs:
            assert o.request_id not in fin, f"output after finish: {o}"
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                fin[o.request_id] = o
    raise AssertionError(f"not finished after {max_steps} steps")


def check_trace(trace: list) -> None:  # type: ignore[type-arg]
    validate_trace(ENGINE, trace)
    validate_trace(ENGINE_REQUEST, trace)


# -- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("block_size", 0), ("max_num_seqs", -1), ("dtype", "int8"), ("device", "tpu"),
    ("gpu_memory_utilization", 1.5), ("max_model_len", 1.5), ("seed", -3), ("model", ""),
    ("null_step_delay_s", -1.0), ("num_gpu_blocks_override", 0),
])
def test_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"EngineConfig\.{field}="):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_config_resolves_device() -> None:
    assert EngineConfig(device="cpu").resolved_device() == "cpu"
    auto = EngineConfig().resolved_device()
    assert auto == ("cuda" if torch.cuda.is_available() else "cpu")


def test_kv_budget_too_small_is_refused_with_numbers() -> None:
    trace: list = []  # type: ignore[type-arg]
    cfg = EngineConfig(model="tiny", device="cpu", max_model_len=256, kv_cache_memory_bytes=4096)
    with pytest.raises(ValueError, match=r"max_model_len=256 needs 16 blocks.*memory_bytes"):
        EngineCore(cfg, trace=trace)
    assert [t[2] for t in trace] == ["FATAL_ERROR"]
    with pytest.raises(ValueError, match="unknown model"):
        EngineCore(EngineConfig(model="nope", device="cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            EngineCore(EngineConfig(model="null", device="cuda"))


# -- lifecycle ---------------------------------------------------------------------------------


def test_ready_info_and_idle_running_idle() -> None:
    trace: list = []  # type: ignore[type-arg]
    eng = EngineCore(NULL, trace=trace)
    info = eng.ready_info()
    assert info == {"num_gpu_blocks": eng.kv.num_blocks, "block_size": 16, "max_model_len": 256,
                    "model": "null", "device": "cpu"}
    assert eng.lifecycle.state is EngineState.IDLE
    out = eng.step()
    assert out.outputs == [] and not eng.has_unfinished_requests()
    eng.add_request(req("a", [5, 6, 7], max_tokens=3, seed=4))
    assert eng.lifecycle.state is EngineState.RUNNING and eng.has_unfinished_requests()
    toks, fin = drain(eng)
    assert toks["a"] == [null_token(4, i) for i in (3, 4, 5)]
    assert fin["a"].finish_reason is FinishReason.LENGTH
    assert eng.lifecycle.state is EngineState.IDLE
    check_trace(trace)
    assert [(t[0], t[2]) for t in trace if t[0] == "engine_request"] == [
        ("engine_request", "ADD"), ("engine_request", "SCHEDULE"), ("engine_request", "LENGTH")]


def test_subprocess_mode_stays_constructing_until_the_wrapper_fires() -> None:
    from enginewire.spec import EngineEvent

    eng = EngineCore(NULL, inproc=False)
    assert eng.lifecycle.state is EngineState.CONSTRUCTING
    eng.add_request(req("early", [5], max_tokens=2))  # queued before the loop starts
    eng.lifecycle.fire(EngineEvent.HANDSHAKE_SENT)
    eng.lifecycle.fire(EngineEvent.LOOP_STARTED)
    assert eng.lifecycle.state is EngineState.IDLE and eng.has_unfinished_requests()
    toks, _fin = drain(eng)
    assert len(toks["early"]) == 2 and eng.lifecycle.state is EngineState.IDLE


# -- correctness -------------------------------------------------------------------------------


def test_greedy_tokens_match_dense_reference_under_continuous_batching() -> None:
    eng = EngineCore(EngineConfig(model="tiny", device="cpu", max_model_len=64, block_size=4,
                                  max_num_batched_tokens=24, kv_cache_memory_bytes=1 << 20))
    arch, params = TinyRandomSource(seed=0).load()
    prompts = {f"p{i}": [(7 * i + 3 * j) % 500 + 3 for j in range(5 + 6 * i)] for i in range(4)}
    for rid, p in list(prompts.items())[:2]:
        eng.add_request(req(rid, p, max_tokens=10, ignore_eos=True))
    early: dict[str, list[int]] = defaultdict(list)
    for _ in range(2):  # later arrivals join a running batch mid-flight
        for o in eng.step().outputs:
            early[o.request_id] += o.new_token_ids
    for rid, p in list(prompts.items())[2:]:
        eng.add_request(req(rid, p, max_tokens=10, ignore_eos=True))
    toks, _fin = drain(eng)
    for rid, p in prompts.items():
        assert early[rid] + toks[rid] == dense_greedy(arch, params, p, 10), rid


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    sp = {"max_tokens": 12, "temperature": 0.9, "top_k": 50, "top_p": 0.9, "seed": 1234,
          "ignore_eos": True}
    alone = EngineCore(TINY)
    alone.add_request(req("x", [10, 11, 12], **sp))
    solo = drain(alone)[0]["x"]
    crowd = EngineCore(TINY)
    crowd.add_request(req("y", [40, 41], max_tokens=12, temperature=1.0, seed=9, ignore_eos=True))
    crowd.add_request(req("x", [10, 11, 12], **sp))
    crowd.add_request(req("z", [7] * 20, max_tokens=5, ignore_eos=True))
    toks = drain(crowd)[0]
    assert toks["x"] == solo
    other = EngineCore(TINY)
    other.add_request(req("x", [10, 11, 12], **{**sp, "seed": 99}))
    assert drain(other)[0]["x"] != solo
    # top_k=1 is greedy whatever the temperature.
    g1, g2 = EngineCore(TINY), EngineCore(TINY)
    g1.add_request(req("g", [3, 4], max_tokens=6, ignore_eos=True))
    g2.add_request(req("g", [3, 4], max_tokens=6, temperature=5.0, top_k=1, seed=3,
                       ignore_eos=True))
    assert drain(g1)[0]["g"] == drain(g2)[0]["g"]


def test_stop_conditions() -> None:
    eng = EngineCore(NULL)
    t = [null_token(1, i) for i in range(2, 12)]
    eng.add_request(req("stop", [5, 5], max_tokens=50, seed=1, stop_token_ids=[t[3]]))
    eng.add_request(req("len", [5, 5], max_tokens=4, seed=1))
    eng.add_request(req("mml", [5] * 250, max_tokens=50, seed=1))
    toks, fin = drain(eng)
    assert toks["stop"] == t[:4]
    assert fin["stop"].finish_reason is FinishReason.STOP and fin["stop"].stop_reason == t[3]
    assert toks["len"] == t[:4] and fin["len"].finish_reason is FinishReason.LENGTH
    assert len(toks["mml"]) == 6 and fin["mml"].finish_reason is FinishReason.LENGTH


def test_eos_stops_unless_ignored() -> None:
    arch, params = TinyRandomSource(seed=0).load()
    prompt = [17, 4, 9]
    greedy = dense_greedy(arch, params, prompt, 6)
    # Make the model's second greedy token the EOS id: equivalent to a model that says EOS.
    eng = EngineCore(TINY)
    eng.arch = type(arch)(**{**arch.__dict__, "eos_token_id": greedy[1]})
    eng.add_request(req("eos", prompt, max_tokens=6))
    eng.add_request(req("ign", prompt, max_tokens=6, ignore_eos=True))
    toks, fin = drain(eng)
    assert toks["eos"] == greedy[:2] and fin["eos"].finish_reason is FinishReason.STOP
    assert fin["eos"].stop_reason is None
    assert toks["ign"] == greedy and fin["ign"].finish_reason is FinishReason.LENGTH


# -- invalid requests and aborts ---------------------------------------------------------------


def test_invalid_requests_finish_with_error_and_engine_keeps_serving() -> None:
    trace: list = []  # type: ignore[type-arg]
    eng = EngineCore(NULL, trace=trace)
    eng.add_request(req("live", [5], max_tokens=3, seed=0))
    bad = {
        "empty": req("empty", []),
        "oov": req("oov", [5, 512]),
        "neg": req("neg", [-1]),
        "long": req("long", [5] * 257),
        "live": req("live", [5]),
        "mt": req("mt", [5], max_tokens=0),
        "tp": req("tp", [5], top_p=0.0),
    }
    for r in bad.values():
        eng.add_request(r)
    assert eng.has_pending_outputs()
    _toks, fin = drain(eng)
    for rid, msg in [("empty", "empty"), ("oov", "512 is outside"), ("neg", "-1 is outside"),
                     ("long", "257 tokens"), ("mt", "max_tokens"), ("tp", "top_p")]:
        assert fin[rid].finish_reason is FinishReason.ERROR and msg in (fin[rid].error or ""), rid
    # A live id sent again ends the live request with ERROR: one finish per id, nothing after.
    assert fin["live"].finish_reason is FinishReason.ERROR and "sent again" in fin["live"].error
    check_trace(trace)
    with pytest.raises(TypeError, match="request_id must be str"):
        eng.add_request(EngineCoreRequest(7, [5]))  # type: ignore[arg-type]


def test_a_decoded_adds_ids_become_the_history_and_a_callers_are_copied() -> None:
    """An engine process's ADD (codec.checked_request_type: decoded, its ids range-checked)
    keeps its list as the request's history; a caller's request is never written to."""
    eng = EngineCore(NULL)
    checked = checked_request_type(eng.arch.vocab_size)
    mine = req("mine", [5, 6], max_tokens=3)
    wired = checked("wired", [5, 6], SamplingParams(max_tokens=3))
    eng.add_request(mine)
    eng.add_request(wired)
    assert eng.scheduler.requests["wired"].all_token_ids is wired.prompt_token_ids
    assert eng.scheduler.requests["mine"].all_token_ids is not mine.prompt_token_ids
    toks, fin = drain(eng)
    assert len(toks["mine"]) == len(toks["wired"]) == 3 and fin["wired"].finished
    assert mine.prompt_token_ids == [5, 6]


def test_abort_ends_live_requests_with_abort_output_and_ignores_others() -> None:
    trace: list = []  # type: ignore[type-arg]
    eng = EngineCore(NULL, trace=trace)
    for i in range(6):
        eng.add_request(req(f"r{i}", [5, 6], max_tokens=20, seed=i))
    assert len(eng.step().outputs) == 6  # one token each
    eng.abort_requests(["r0", "r2", "r4", "unknown"])
    eng.abort_requests("r0")  # a bare id; already finished: no-op
    toks, fin = drain(eng)
    for i in range(6):
        want = FinishReason.ABORT if i % 2 == 0 else FinishReason.LENGTH
        assert fin[f"r{i}"].finish_reason is want
    assert toks["r0"] == [] and len(toks["r1"]) == 19
    eng.abort_requests(["r1"])  # finished: no-op
    assert not eng.has_pending_outputs() and eng.lifecycle.state is EngineState.IDLE
    # An id may be reused once its request finished.
    eng.add_request(req("r0", [5], max_tokens=2))
    assert len(drain(eng)[0]["r0"]) == 2
    check_trace(trace)


def test_abort_of_a_waiting_request_before_any_step() -> None:
    eng = EngineCore(NULL)
    eng.add_request(req("w", [5], max_tokens=5))
    eng.abort_requests(["w"])
    assert not eng.has_unfinished_requests()
    out = eng.step()
    assert [(o.request_id, o.finish_reason) for o in out.outputs] == [("w", FinishReason.ABORT)]
    assert out.finished_requests == ["w"]
    assert eng.lifecycle.state is EngineState.IDLE


# -- utilities ---------------------------------------------------------------------------------


def test_utility_allow_list() -> None:
    eng = EngineCore(NULL)
    assert eng.call_utility("echo", [{"a": [1, 2]}]) == {"a": [1, 2]}
    for name in ("shutdown", "__init__", "_pause", "step", "add_request", "nope"):
        with pytest.raises(UtilityError) as ei:
            eng.call_utility(name, [])
        assert ei.value.method == name
    assert eng.call_utility("collective_rpc", ["ping"]) == ["pong from rank 0"]
    with pytest.raises(ValueError, match="not a worker RPC method"):
        eng.collective_rpc("sleep", (2,))
    with pytest.raises(ValueError, match="not a worker RPC method"):
        eng.collective_rpc("__class__")
    assert eng.collective_rpc("describe")[0]["model"] == "null"
    assert eng.call_utility("is_sleeping", []) is False


def test_get_stats_and_scheduler_stats() -> None:
    eng = EngineCore(NULL)
    for i in range(3):
        eng.add_request(req(f"s{i}", [5] * 20, max_tokens=5))
    out = eng.step()
    assert out.scheduler_stats is not None and out.scheduler_stats.num_running == 3
    s = eng.get_stats()
    assert s.num_running == 3 and s.num_live == 3 and s.state is EngineState.RUNNING
    assert s.num_free_blocks == s.num_gpu_blocks - 6 and s.kv_cache_usage > 0


def test_save_sharded_state_round_trips(tmp_path: object) -> None:
    from safetensors.torch import load_file

    eng = EngineCore(TINY)
    files = eng.call_utility("save_sharded_state", [str(tmp_path)])
    assert isinstance(files, list) and len(files) == 1
    saved = load_file(files[0])
    params = eng.executor.driver.model.params  # type: ignore[union-attr]
    assert saved.keys() == params.keys()
    assert all(torch.equal(saved[k], params[k]) for k in params)


def test_profile_writes_a_chrome_trace(tmp_path: object) -> None:
    eng = EngineCore(TINY)
    assert eng.call_utility("profile", ["start", str(tmp_path)]) is None
    with pytest.raises(RuntimeError, match="already running"):
        eng.profile("start")
    eng.add_request(req("p", [5, 6], max_tokens=2))
    drain(eng)
    path = eng.call_utility("profile", ["stop"])
    assert isinstance(path, str) and os.path.dirname(path) == str(tmp_path)
    with open(path) as f:
        assert json.load(f)["traceEvents"]
    with pytest.raises(RuntimeError, match="not running"):
        eng.profile("stop")
    with pytest.raises(ValueError):
        eng.profile("pause")


def test_prefix_caching_reuses_blocks_and_keeps_tokens() -> None:
    cfg = EngineConfig(model="tiny", device="cpu", max_model_len=128, block_size=4,
                       enable_prefix_caching=True, kv_cache_memory_bytes=1 << 20)
    eng = EngineCore(cfg)
    prompt = list(range(20, 42))
    eng.add_request(req("first", prompt, max_tokens=5, ignore_eos=True))
    first = drain(eng)
    eng.add_request(req("second", prompt, max_tokens=5, ignore_eos=True))
    second = drain(eng)
    assert second[0]["second"] == first[0]["first"]
    assert first[1]["first"].num_cached_tokens == 0
    assert second[1]["second"].num_cached_tokens == 20  # 5 full blocks; the last token recomputed
    assert eng.get_stats().prefix_cache_hits == 5
    assert eng.call_utility("reset_prefix_cache", []) is True
    eng.add_request(req("third", prompt, max_tokens=5, ignore_eos=True))
    third = drain(eng)
    assert third[1]["third"].num_cached_tokens == 0 and third[0]["third"] == first[0]["first"]


# -- shutdown and faults -----------------------------------------------------------------------


def test_shutdown_aborts_live_requests_and_is_idempotent() -> None:
    trace: list = []  # type: ignore[type-arg]
    eng = EngineCore(NULL, trace=trace)
    eng.add_request(req("a", [5], max_tokens=10))
    eng.add_request(req("b", [5], max_tokens=10))
    eng.step()
    fut = eng.pause_scheduler("wait")
    assert isinstance(fut, Future) and not fut.done()
    eng.shutdown()
    eng.shutdown()
    assert eng.lifecycle.state is EngineState.SHUTDOWN
    with pytest.raises(UtilityError, match="shut down"):
        fut.result(timeout=0)
    final = eng.take_final_outputs()
    assert final is not None
    assert sorted((o.request_id, o.finish_reason) for o in final.outputs) == [
        ("a", FinishReason.ABORT), ("b", FinishReason.ABORT)]
    assert eng.take_final_outputs() is None
    with pytest.raises(ClientClosedError):
        eng.add_request(req("c", [5]))
    with pytest.raises(ClientClosedError):
        eng.step()
    check_trace(trace)


def test_fault_hook_sees_named_points_and_a_forward_fault_kills_the_engine() -> None:
    seen: list[tuple[FaultPoint, str | None]] = []
    eng = EngineCore(NULL)
    eng.fault_hook = lambda point, method=None: seen.append((point, method))
    eng.call_utility("echo", [1])
    eng.add_request(req("a", [5], max_tokens=3))
    eng.step()
    eng.sleep(0, "keep")
    eng.wake_up()
    # Members, not strings: a misspelt point cannot reach the hook.
    assert all(type(point) is FaultPoint for point, _ in seen)
    assert seen == [(FaultPoint.UTILITY, "echo"), (FaultPoint.STEP, None),
                    (FaultPoint.FORWARD, None), (FaultPoint.SLEEP, None),
                    (FaultPoint.WAKE_UP, None)]

    def boom(point: str) -> None:
        if point == "forward":
            raise RuntimeError("injected")

    eng.fault_hook = boom
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    assert eng.lifecycle.state is EngineState.DEAD
    with pytest.raises(EngineDeadError) as ei:
        eng.step()
    assert isinstance(ei.value.__cause__, RuntimeError)
    eng.shutdown()  # allowed from DEAD
    assert eng.lifecycle.state is EngineState.SHUTDOWN


def test_illegal_lifecycle_calls_raise_spec_violation_and_change_nothing() -> None:
    eng = EngineCore(NULL, inproc=False)  # CONSTRUCTING: no pausing before the loop runs
    eng.add_request(req("a", [5], max_tokens=3))
    with pytest.raises(SpecViolation):
        eng.pause_scheduler("abort")
    assert eng.lifecycle.state is EngineState.CONSTRUCTING and eng.num_live_requests() == 1


def test_engine_step_benchmark_rows_are_sane() -> None:
    from enginewire.benchmarks.engine_step import _measure

    row = _measure("null", 32, steps=10, burst=5)
    assert row["batch"] == 32 and row["steps"] == 10
    assert 0 < row["step_us_min"] <= row["step_us"]
    assert row["tokens_per_s"] == pytest.approx(32 / (row["step_us"] * 1e-6))


def test_sampling_filters() -> None:
    from enginewire.runtime.sampling import sample

    class P:
        def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0,
                     seed: int = 0) -> None:
            self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
            self.generator = None

    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0, -5.0]] * 4)
    draws = [sample(logits, [P(1.0, top_k=2, seed=s), P(1.0, top_p=0.01, seed=s),
                             P(0.0), P(50.0, seed=s)]) for s in range(40)]
    assert {d[0] for d in draws} == {1, 2}  # top-k keeps exactly the two best
    assert {d[1] for d in draws} == {1}  # a tiny top-p keeps only the best
    assert {d[2] for d in draws} == {1}  # greedy
    assert len({d[3] for d in draws}) >= 4  # hot and unfiltered: nearly uniform


@pytest.mark.parametrize("sp", [{"temperature": 1e-45}, {"temperature": 1.0, "top_p": 1e-300}],
                         ids=["subnormal-temperature", "top-p-below-float32"])
def test_extreme_sampling_values_sample_and_keep_the_engine(sp: dict[str, float]) -> None:
    # Both pass validation (temperature >= 0, top_p in (0, 1]) and once made every
    # probability NaN: torch.multinomial raised and the engine died for one request.
    eng = EngineCore(TINY)
    eng.add_request(req("x", [3, 4], max_tokens=4, seed=1, ignore_eos=True, **sp))
    eng.add_request(req("g", [3, 4], max_tokens=4, ignore_eos=True))
    toks, fin = drain(eng)
    assert fin["x"].finish_reason is FinishReason.LENGTH
    assert toks["x"] == toks["g"]  # both limits are greedy
    assert eng.state is not EngineState.DEAD


def test_null_step_delay_stands_in_for_compute() -> None:
    import time

    eng = EngineCore(EngineConfig(model="null", device="cpu", null_step_delay_s=0.02))
    eng.add_request(req("d", [5], max_tokens=3))
    t0 = time.perf_counter()
    drain(eng)
    assert time.perf_counter() - t0 >= 3 * 0.02


def test_a_fault_at_step_is_fatal_and_fails_deferred_replies() -> None:
    eng = EngineCore(NULL)
    eng.add_request(req("a", [5], max_tokens=30))
    eng.step()
    fut = eng.pause_scheduler("wait")
    assert isinstance(fut, Future)

    def boom(point: str) -> None:
        raise MemoryError("injected at " + point)

    eng.fault_hook = boom
    with pytest.raises(MemoryError):
        eng.step()
    assert eng.lifecycle.state is EngineState.DEAD
    with pytest.raises(EngineDeadError):
        fut.result(timeout=0)
    with pytest.raises(EngineDeadError):
        eng.add_request(req("b", [5]))


# -- request tensors -------------------------------------------------------------------------


def test_request_tensors_the_model_does_not_accept_finish_with_an_error_naming_them() -> None:
    trace: list = []  # type: ignore[type-arg]
    eng = EngineCore(NULL, trace=trace)
    embeds = torch.zeros(4, 64, dtype=torch.bfloat16)
    eng.add_request(EngineCoreRequest("emb", [5, 6, 7, 8], SamplingParams(max_tokens=2),
                                      tensors={"prompt_embeds": embeds, "extra": [1, 2]}))
    eng.add_request(EngineCoreRequest("empty-map", [5], SamplingParams(max_tokens=2),
                                      tensors={}))  # nothing to drop: served as usual
    eng.add_request(req("plain", [5], max_tokens=2))
    toks, fin = drain(eng)
    err = fin["emb"].error or ""
    assert fin["emb"].finish_reason is FinishReason.ERROR and toks.get("emb", []) == []
    assert "'prompt_embeds' (bfloat16[4, 64])" in err and "'extra' (list)" in err
    assert "model 'null'" in err and "accepted tensors: none" in err
    for rid in ("empty-map", "plain"):
        assert fin[rid].finish_reason is FinishReason.LENGTH and len(toks[rid]) == 2
    check_trace(trace)


def test_request_tensors_decoded_from_the_wire_are_refused_through_inproc_client() -> None:
    import numpy as np

    from enginewire.protocol.codec import Encoder, decode_input, encode_input
    from enginewire.protocol.messages import RequestType
    from enginewire.runtime.factory import make_client

    sent = EngineCoreRequest("wire", [5, 6], SamplingParams(max_tokens=2),
                             tensors={"prompt_embeds": np.ones((2, 64), dtype=np.float32)})
    frames = encode_input(Encoder(), RequestType.ADD, sent)
    kind, decoded = decode_input(frames)
    assert kind is RequestType.ADD and isinstance(decoded, EngineCoreRequest)
    with make_client(NULL, multiprocess=False, asyncio=False) as client:
        client.add_request(decoded)
        fin = None
        for _ in range(10):
            outs = [o for o in client.get_output().outputs if o.request_id == "wire"]
            if outs:
                fin = outs[0]
                break
    assert fin is not None and fin.finish_reason is FinishReason.ERROR
    assert "'prompt_embeds' (float32[2, 64])" in (fin.error or "")


# -- columnar outputs (the process wrapper's wire form) ----------------------------------------


def _run_batches(stream: bool, cfg: EngineConfig) -> list[EngineCoreOutputs]:
    eng = EngineCore(cfg, stream_outputs=stream)
    eng.add_request(req("len", [5, 6, 7], max_tokens=6, ignore_eos=True))
    eng.add_request(req("stop", [9, 10], max_tokens=40, ignore_eos=True, seed=0,
                        stop_token_ids=[null_token(0, 4)]))  # its third token
    eng.add_request(req("bad", []))  # ERROR output, not a stream entry
    batches = []
    for _ in range(200):
        if not (eng.has_unfinished_requests() or eng.has_pending_outputs()):
            break
        batches.append(eng.step())
        if len(batches) == 2:
            eng.abort_requests(["len"])  # ABORT output mid-stream
    eng.shutdown()
    return batches


def test_stream_columns_expand_to_exactly_the_struct_outputs() -> None:
    plain = _run_batches(False, NULL)
    streamed = _run_batches(True, NULL)
    assert len(plain) == len(streamed)
    assert any(b.stream_ids for b in streamed)
    reasons = {o.request_id: o.finish_reason for b in plain for o in b.outputs if o.finished}
    assert reasons == {"len": FinishReason.ABORT, "stop": FinishReason.STOP,
                       "bad": FinishReason.ERROR}
    for p, s in zip(plain, streamed, strict=True):
        assert not p.stream_ids and not p.stream_tokens
        assert len(s.stream_ids) == len(s.stream_tokens)
        # Columns hold only plain decodes: no finish, one token.
        assert all(o.finished or not o.new_token_ids or o.num_cached_tokens
                   for o in s.outputs)
        key = lambda o: o.request_id  # noqa: E731
        assert sorted(s.expanded().outputs, key=key) == sorted(p.outputs, key=key)
        assert s.expanded().finished_requests == p.finished_requests


def test_cached_token_counts_stay_in_structs() -> None:
    cfg = EngineConfig(model="null", device="cpu", block_size=4, enable_prefix_caching=True)
    eng = EngineCore(cfg, stream_outputs=True)
    prompt = list(range(20, 42))
    for rid in ("first", "second"):
        eng.add_request(req(rid, prompt, max_tokens=4, ignore_eos=True))
        seen: list[EngineCoreOutput] = []
        while eng.has_unfinished_requests():
            b = eng.step()
            if rid == "second":
                assert rid not in b.stream_ids  # its outputs carry num_cached_tokens
            seen += b.expanded().outputs
        assert sum(len(o.new_token_ids) for o in seen) == 4
    eng.shutdown()


def test_a_pause_that_aborts_more_than_a_batch_holds_sends_them_over_several_steps() -> None:
    """70,000 live requests aborted at once made one batch a client refuses (at most
    Limits.max_batch outputs): the front end declared a healthy engine dead."""
    from enginewire.protocol.codec import DEFAULT_LIMITS

    eng = EngineCore(EngineConfig(model="null", device="cpu", max_num_seqs=8))
    n = DEFAULT_LIMITS.max_batch + 4000
    for i in range(n):
        eng.add_request(EngineCoreRequest(f"r{i}", [1], SamplingParams(max_tokens=2)))
    eng.pause_scheduler("abort")
    seen: list[str] = []
    while eng.has_pending_outputs():
        batch = eng.step()
        assert len(batch.outputs) <= DEFAULT_LIMITS.max_batch
        assert batch.finished_requests is not None
        assert len(batch.finished_requests) <= DEFAULT_LIMITS.max_batch
        seen += [o.request_id for o in batch.outputs if o.finish_reason is FinishReason.ABORT]
    assert len(seen) == n == len(set(seen))


def test_final_outputs_of_a_shutdown_come_in_batches_a_client_takes() -> None:
    from enginewire.protocol.codec import DEFAULT_LIMITS

    eng = EngineCore(EngineConfig(model="null", device="cpu"))
    n = DEFAULT_LIMITS.max_batch + 10
    for i in range(n):
        eng.add_request(EngineCoreRequest(f"r{i}", [1], SamplingParams(max_tokens=2)))
    eng.shutdown()
    sizes = []
    while (final := eng.take_final_outputs()) is not None:
        sizes.append(len(final.outputs))
    assert sizes == [DEFAULT_LIMITS.max_batch, 10]


def test_max_num_seqs_is_bounded_by_what_a_batch_holds() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=1 << 16)


def test_outputs_answered_just_before_shutdown_are_among_its_final_outputs() -> None:
    """An ABORT or ERROR queued for the next step when shutdown() comes is the only answer
    its request will get: the final outputs must carry it, or its owner waits forever."""
    eng = EngineCore(NULL)
    eng.add_request(req("live", [5], max_tokens=10))
    eng.abort_requests(["live"])  # ABORT output pending, no step taken
    eng.add_request(req("bad", []))  # ERROR output pending (empty prompt)
    assert eng.has_pending_outputs()
    eng.shutdown()
    outs: list[EngineCoreOutput] = []
    while (final := eng.take_final_outputs()) is not None:
        outs += final.outputs
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [
        ("bad", FinishReason.ERROR), ("live", FinishReason.ABORT)]


def test_abort_of_a_bare_string_is_that_one_id() -> None:
    """abort_requests("ab") aborts request "ab"; iterated per character it would abort "a"
    (and "b") instead and leave "ab" running."""
    eng = EngineCore(NULL)
    for rid in ("ab", "a", "b"):
        eng.add_request(req(rid, [5], max_tokens=10))
    eng.abort_requests("ab")
    aborted = [o.request_id for o in eng.step().outputs if o.finish_reason is not None]
    assert aborted == ["ab"]
    assert eng.has_unfinished_requests()
    eng.abort_requests(["a", "b"])
    fin = drain(eng)[1]
    assert {rid: o.finish_reason for rid, o in fin.items()} == {
        "a": FinishReason.ABORT, "b": FinishReason.ABORT}
    eng.shutdown()


def test_a_decode_batch_finishing_together_frees_its_blocks_and_hands_over_its_requests(
) -> None:
    """The requests a steady-decode step finishes are freed in one KV call and kept (not
    torn down inside the step) until the caller takes them, or the next step drops them;
    a finished request's counters are written back, as ``_finish_on`` reads them."""
    config = EngineConfig(model="null", max_num_seqs=32, max_num_batched_tokens=4096)
    e = EngineCore(config, inproc=True, stream_outputs=True)
    total = e.kv.num_free_blocks
    for rnd in range(2):
        for i in range(32):
            e.add_request(EngineCoreRequest(f"{rnd}-{i}", [3 + i, 4, 5, 6, 7],
                                            SamplingParams(max_tokens=20, ignore_eos=True)))
        ended: list[object] = []
        while e.has_unfinished_requests():
            out = e.step()
            if out.finished_requests:
                assert len(out.finished_requests) == 32  # one batch, one step
                ended = e.take_ended() if rnd == 0 else list(e.scheduler.ended)
        assert {r.request_id for r in ended} == {f"{rnd}-{i}" for i in range(32)}
        assert all(r.block_ids == [] and r.num_tokens == 25 for r in ended)
        assert e.kv.num_free_blocks == total and e.kv.audit().total_refs == 0
        assert len(e.scheduler.ended) == (0 if rnd == 0 else 32)  # taken, or still held
    e.add_request(EngineCoreRequest("next", [3], SamplingParams(max_tokens=2)))
    e.step()
    assert e.scheduler.ended == []  # the step dropped what nobody took
