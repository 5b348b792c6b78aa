"""The differential oracle (enginewire.testing.reference): a lone run on a fresh engine is the
engine's own answer for a request alone, batching keeps greedy tokens within its tie
tolerance, a wrong token list fails with OracleViolation, and the campaign's machines judge
every finished greedy request with it."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from enginewire.protocol.messages import EngineCoreRequest, FinishReason, SamplingParams
from enginewire.runtime import executor as executor_module
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine import EngineCore
from enginewire.testing.campaign import _config, run_campaign
from enginewire.testing.oracle import OracleViolation
from enginewire.testing.reference import (
    TIE_TOLERANCE,
    DifferentialOracle,
    ReferenceRun,
    reference_config,
    reference_unavailable,
)
from enginewire.testing.stateful import CampaignStats, EngineClientStateMachine, builtin_factory

os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")  # spawned engines inherit it

torch = pytest.importorskip("torch")

# The campaign's tiny config (max_num_seqs 16, max_model_len 2048), on the CPU, where the
# tolerance was measured.
TINY = msgspec.structs.replace(_config("tiny"), device="cpu")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # As the campaign runs: one torch thread (2 shared cores).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _requests(n: int, seed: int, *, long: bool = False) -> list[EngineCoreRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = rng.randint(1, 8) if not long or i % 3 else rng.randint(20, 120)
        prompt = [rng.randint(3, 511) for _ in range(plen)]
        sp = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.5,
                            stop_token_ids=[rng.randint(3, 511)] if i % 4 == 0 else [])
        out.append(EngineCoreRequest(f"q{i}", prompt, sp))
    return out


def _run(engine: EngineCore, reqs: list[EngineCoreRequest], per_step: int
         ) -> dict[str, tuple[list[int], FinishReason]]:
    """Add ``per_step`` requests a step (all of them at once when it is that many) and step
    until every one finished."""
    toks: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    ends: dict[str, FinishReason] = {}
    pending = list(reqs)
    for _ in range(100_000):
        for _ in range(min(per_step, len(pending))):
            engine.add_request(pending.pop(0))
        out = engine.step()
        for o in out.outputs:
            toks[o.request_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                ends[o.request_id] = FinishReason(o.finish_reason)
        if not pending and len(ends) == len(reqs):
            return {rid: (toks[rid], ends[rid]) for rid in toks}
    raise AssertionError("the engine did not finish its requests")


# --- the reference ------------------------------------------------------------------------------


def test_reference_is_unavailable_where_rounding_was_not_measured() -> None:
    assert reference_unavailable(TINY) is None
    assert "null model" in str(reference_unavailable(EngineConfig(model="null")))
    assert "float16" in str(reference_unavailable(
        msgspec.structs.replace(TINY, dtype="float16")))
    assert "cuda" in str(reference_unavailable(msgspec.structs.replace(TINY, device="cuda")))
    with pytest.raises(ValueError, match="no lone reference"):
        DifferentialOracle.for_config(EngineConfig(model="null"))
    ref = reference_config(msgspec.structs.replace(TINY, enable_prefix_caching=True,
                                                   data_parallel_size=2))
    assert (ref.enable_prefix_caching, ref.max_num_seqs, ref.data_parallel_size) == (False, 1, 1)


def test_reference_agrees_with_the_engine_on_lone_requests() -> None:
    """Each request alone on the campaign's own config gives the reference's tokens and ending
    (the reference is the engine, not a second implementation of it)."""
    oracle = DifferentialOracle.for_config(TINY)
    engine = EngineCore(TINY)
    try:
        for req in _requests(30, seed=1, long=True):
            got, end = _run(engine, [req], 1)[req.request_id]
            want = oracle.engine.run(req)
            assert (got, end) == (list(want.tokens), want.finish), req
            assert len(want.ties) == len(want.tokens)
    finally:
        engine.shutdown()


def test_reference_runs_are_cached_per_prompt_and_params() -> None:
    oracle = DifferentialOracle.for_config(TINY)
    req = EngineCoreRequest("a", [7, 8, 9, 10], SamplingParams(max_tokens=5, seed=1))
    first = oracle.engine.run(req)
    runs = oracle.engine.runs
    # Another id, seed and top_p: the same greedy run.
    again = EngineCoreRequest("b", [7, 8, 9, 10],
                              SamplingParams(max_tokens=5, seed=2, top_p=0.5))
    assert oracle.engine.run(again) is first and oracle.engine.runs == runs
    longer = EngineCoreRequest("c", [7, 8, 9, 10], SamplingParams(max_tokens=6))
    assert oracle.engine.run(longer).tokens[:5] == first.tokens
    assert oracle.engine.runs == runs + 1


@pytest.mark.parametrize(("budget", "blocks"), [(512, None), (32, 24)])
def test_batched_greedy_tokens_equal_lone_runs(budget: int, blocks: int | None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The measurement behind the tie tolerance: batched (16 at a time, requests arriving
    mid-run; with a small budget chunked prefill beside other requests, and with few blocks
    preemption by recompute) and lone logits are not bit-identical on the CPU, yet stay far
    inside TIE_TOLERANCE, and every greedy token is the lone run's."""
    rows: dict[str, list[Any]] = {}
    sample = executor_module.sample

    def recording(logits: Any, reqs: Any) -> list[int]:
        for i, r in enumerate(reqs):
            rows.setdefault(r.request_id, []).append(logits[i].clone())
        return sample(logits, reqs)

    monkeypatch.setattr(executor_module, "sample", recording)
    config = msgspec.structs.replace(TINY, max_num_batched_tokens=budget,
                                     num_gpu_blocks_override=blocks,
                                     max_model_len=2048 if blocks is None else 256)
    reqs = _requests(48, seed=budget, long=True)
    engine = EngineCore(config)
    lone = EngineCore(reference_config(config))
    try:
        batched = _run(engine, reqs, 3)
        if blocks is not None:
            assert engine.scheduler.num_preemptions > 0
        batched_rows, rows = rows, {}
        oracle = DifferentialOracle.for_config(config)
        worst = 0.0
        for req in reqs:
            rid = req.request_id
            assert _run(lone, [req], 1)[rid] == batched[rid]
            for a, b in zip(batched_rows[rid], rows[rid], strict=True):
                worst = max(worst, float((a - b).abs().max()))
            assert oracle.check(req, *batched[rid]) is False  # no near-tie was needed
        assert worst < TIE_TOLERANCE / 10, worst
    finally:
        engine.shutdown()
        lone.shutdown()


# --- the check ----------------------------------------------------------------------------------


class _Fixed:
    """A reference engine that answers one crafted run."""

    def __init__(self, run: ReferenceRun) -> None:
        self.answer = run
        self.runs = 0

    def run(self, req: EngineCoreRequest) -> ReferenceRun:
        return self.answer


def _fixed(tokens: list[int], finish: FinishReason = FinishReason.LENGTH,
           ties: dict[int, set[int]] | None = None) -> DifferentialOracle:
    near = tuple(frozenset((ties or {}).get(i, ())) for i in range(len(tokens)))
    return DifferentialOracle(_Fixed(ReferenceRun(tuple(tokens), finish, near)))  # type: ignore[arg-type]


REQ = EngineCoreRequest("r7", [5, 6, 7], SamplingParams(max_tokens=6))


@pytest.mark.parametrize(("got", "finish", "at"), [
    ([10, 11, 12, 99, 14, 15], FinishReason.LENGTH, 3),  # a wrong token
    ([10, 11, 12], FinishReason.LENGTH, 3),  # too short
    ([10, 11, 12, 13, 14, 15], FinishReason.STOP, 6),  # the wrong ending
])
def test_a_corrupted_token_list_is_a_violation(got: list[int], finish: FinishReason,
                                               at: int) -> None:
    oracle = _fixed([10, 11, 12, 13, 14, 15])
    with pytest.raises(OracleViolation) as info:
        oracle.check(REQ, got, finish, history="was parked by sleep(level=1, keep)")
    text = str(info.value)
    assert "'r7'" in text and f"at token {at}" in text
    assert "[10, 11, 12, 13, 14, 15] (6 tokens) ending LENGTH" in text
    assert "parked by sleep(level=1, keep)" in text
    assert oracle.statistics().compared == 1


def test_the_real_reference_rejects_a_corrupted_token() -> None:
    oracle = DifferentialOracle.for_config(TINY)
    want = oracle.engine.run(REQ)
    bad = list(want.tokens)
    bad[2] = next(t for t in range(3, 512) if t != bad[2] and t not in want.ties[2])
    assert oracle.check(REQ, list(want.tokens), want.finish) is False
    with pytest.raises(OracleViolation, match="at token 2"):
        oracle.check(REQ, bad, want.finish)


def test_a_near_tie_broken_the_other_way_ends_the_comparison() -> None:
    """Where the lone run's top two logits are within the tolerance, another pick is a
    legitimate divergence: what follows (another continuation) is not judged."""
    oracle = _fixed([10, 11, 12, 13], ties={1: {11, 40}})
    assert oracle.check(REQ, [10, 40, 7, 7, 7], FinishReason.STOP) is True
    with pytest.raises(OracleViolation, match="at token 1"):
        oracle.check(REQ, [10, 41, 12, 13], FinishReason.LENGTH)  # 41 was not close
    stats = oracle.statistics()
    assert (stats.compared, stats.diverged_at_tie) == (2, 1)


# --- in the campaign ------------------------------------------------------------------------------


# No shrinking: a failure here is the point, not something to minimise.
FEW = settings(max_examples=4, stateful_step_count=20, deadline=None, database=None,
               derandomize=True, suppress_health_check=list(HealthCheck),
               phases=[Phase.explicit, Phase.generate])


def _machine_run(reference: DifferentialOracle) -> CampaignStats:
    stats = CampaignStats()
    factory = builtin_factory("inproc", TINY)

    def make() -> EngineClientStateMachine:
        machine = EngineClientStateMachine(factory, kind="inproc", stats=stats)
        machine.reference = reference
        return machine

    runner: Any = run_state_machine_as_test  # untyped in Hypothesis
    runner(make, settings=FEW)
    return stats


def test_the_machine_compares_every_finished_greedy_request() -> None:
    oracle = DifferentialOracle.for_config(TINY)
    stats = _machine_run(oracle)
    assert stats.reference_compared > 0
    assert oracle.statistics().compared == stats.reference_compared
    assert stats.seconds["(differential oracle)"] > 0


def test_the_machine_fails_on_tokens_that_differ_from_the_lone_run() -> None:
    """The hook, end to end: a reference that disagrees on every request fails the run."""
    real = DifferentialOracle.for_config(TINY).engine

    class _Off:
        runs = 0

        def run(self, req: EngineCoreRequest) -> ReferenceRun:
            want = real.run(req)
            return ReferenceRun(((want.tokens[0] + 1) % 512, *want.tokens[1:]), want.finish,
                                tuple(frozenset() for _ in want.tokens))

    with pytest.raises(OracleViolation, match="differs from its lone run"):
        _machine_run(DifferentialOracle(_Off()))  # type: ignore[arg-type]


def test_tiny_campaign_passes_with_the_check_on(tmp_path: Path) -> None:
    assert run_campaign(client="inproc", model="tiny", examples=4, steps=20,
                        results_dir=str(tmp_path)) == 0
    (path,) = tmp_path.glob("campaign-*.json")
    (res,) = json.loads(path.read_text())["clients"]
    assert res["failure"] is None and "(differential oracle)" in res["rule_seconds"]
