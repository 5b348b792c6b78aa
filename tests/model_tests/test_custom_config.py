"""The conformance suite and the stateful machine on a test engineer's own EngineConfig.

Both promise to run on any valid config: limits come from the client's config, token checks
only where the oracle can predict tokens (the null model), and a scenario that cannot run
says so with ``NotApplicable`` instead of passing or failing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from enginewire.runtime.config import EngineConfig
from enginewire.testing import conformance as cf
from enginewire.testing.oracle import OracleViolation
from enginewire.testing.stateful import (
    LONG_MAX_TOKENS,
    WAIT_MODE_TOKENS,
    CampaignStats,
    EngineClientStateMachine,
    RuleLimits,
    builtin_factory,
)

os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")  # a tiny engine inherits it

# The docs' default: max_model_len 256, far below the 2003 the campaign's long requests need.
DEFAULT_NULL = EngineConfig(model="null")
# Short sequences, small blocks, prefix caching on: every limit the rules read is tight.
SMALL = EngineConfig(model="null", max_num_seqs=2, max_model_len=16, block_size=4,
                     enable_prefix_caching=True)
FEW = settings(max_examples=4, stateful_step_count=15, deadline=None, database=None,
               derandomize=True, suppress_health_check=list(HealthCheck))


def _campaign(kind: str, config: EngineConfig, examples: int = 4,
              **machine: Any) -> CampaignStats:
    stats = CampaignStats()
    factory = builtin_factory(kind, config)
    runner: Any = run_state_machine_as_test  # untyped in Hypothesis
    runner(
        lambda: EngineClientStateMachine(factory, kind=kind, stats=stats, **machine),
        settings=settings(FEW, max_examples=examples))
    return stats


# --- the stateful machine ----------------------------------------------------------------------


def test_rule_limits_follow_the_config() -> None:
    lim = RuleLimits.of(DEFAULT_NULL)
    assert (lim.long_tokens, lim.wait_tokens) == (253, 253)  # 256 less the 3-token prompt
    assert lim.cap(8, 24) == 24 and lim.cap(250, 24) == 6
    assert any("not judged" in n for n in lim.notes(multiprocess=True))
    assert any("still judged" in n for n in lim.notes(multiprocess=False))
    assert lim.prefix_prompt_len is None  # prefix caching is off
    small = RuleLimits.of(SMALL)
    assert small.prefix_prompt_len == 5 and small.long_tokens == 13
    roomy = RuleLimits.of(EngineConfig(model="null", max_model_len=2048))
    assert (roomy.long_tokens, roomy.wait_tokens) == (LONG_MAX_TOKENS, WAIT_MODE_TOKENS)
    assert roomy.notes(multiprocess=True) == []
    assert RuleLimits.of(None) == RuleLimits()  # a client without a config: the defaults


@pytest.mark.parametrize("kind", ["inproc", "sync"])
def test_docs_snippet_on_the_default_null_config(kind: str) -> None:
    """docs/campaigns.md's snippet with EngineConfig(model="null"): no request outlives
    max_model_len, so none ends LENGTH short of its max_tokens."""
    stats = _campaign(kind, DEFAULT_NULL)
    assert stats.steps > 0
    assert any("add_then_abort" in n for n in stats.limits_notes)


def test_small_config_with_prefix_caching() -> None:
    stats = _campaign("inproc", SMALL, examples=40)  # in-process: milliseconds each
    assert stats.rules["prefix_cache_hit"] > 0, dict(stats.rules)


def test_tiny_model_checks_tokens_only_where_predictable() -> None:
    """exact_tokens defaults to the null model only: the tiny model's tokens are its own."""
    import torch  # the in-process tiny engine runs on this process's threads

    torch.set_num_threads(1)
    tiny = EngineConfig(model="tiny", max_model_len=64)
    stats = _campaign("inproc", tiny, examples=8)
    assert stats.rules["add"] + stats.rules["abort_mid_generation"] > 0  # tokens were judged
    factory = builtin_factory("inproc", tiny)
    with pytest.raises(ValueError, match="exact_tokens=True predicts the null model"):
        EngineClientStateMachine(factory, kind="inproc", exact_tokens=True)
    assert EngineClientStateMachine._exact_tokens(None, "null") is True
    assert EngineClientStateMachine._exact_tokens(None, "tiny") is False
    assert EngineClientStateMachine._exact_tokens(False, "null") is False


def test_a_kind_that_is_not_the_factorys_is_refused_at_construction() -> None:
    """The rules choose their paths by ``kind``: a sync machine over an in-process client once
    ran and reported a handful of unrelated rule failures instead of naming the mix-up."""
    factory = builtin_factory("inproc", DEFAULT_NULL)
    before = threading.active_count()
    with pytest.raises(ValueError, match="kind='sync' but the factory built a 'inproc' client"):
        EngineClientStateMachine(factory, kind="sync")
    assert threading.active_count() == before  # the client it built was shut down
    with pytest.raises(ValueError, match="kind must be one of"):
        EngineClientStateMachine(factory, kind="Sync")
    with pytest.raises(ValueError, match="kind must be one of"):
        builtin_factory("mp", DEFAULT_NULL)


@pytest.fixture
def small_machine() -> Iterator[EngineClientStateMachine]:
    state = EngineClientStateMachine(builtin_factory("inproc", SMALL), kind="inproc")
    try:
        yield state
    finally:
        state.teardown()


def test_prefix_cache_hit_is_judged(small_machine: EngineClientStateMachine) -> None:
    small_machine.prefix_cache_hit(first=7)
    repeat = max(small_machine._cached, key=lambda r: int(r[1:]))
    assert small_machine._cached[repeat] == SMALL.block_size


def test_prefix_cache_hit_catches_a_cache_that_never_hits(
        small_machine: EngineClientStateMachine) -> None:
    kv = small_machine.cut.client.engine.scheduler.kv
    kv.claim_cached_prefix = lambda req: 0  # the engine computes every prompt in full
    with pytest.raises(OracleViolation, match="num_cached_tokens=0"):
        small_machine.prefix_cache_hit(first=7)
    small_machine._busy = None  # the rule failed as intended; tear down normally


def test_cached_tokens_reported_without_prefix_caching_is_a_violation() -> None:
    state = EngineClientStateMachine(builtin_factory("inproc", DEFAULT_NULL), kind="inproc")
    try:
        with pytest.raises(OracleViolation, match="prefix caching off"):
            state._check_cached("r1", 16)
    finally:
        state.teardown()


def test_short_lived_client_fails_when_one_block_holds_a_sequence() -> None:
    """block_size >= max_model_len: one block holds a whole sequence, so the rule must size
    a failing pool another way."""
    config = EngineConfig(model="null", block_size=1024, max_model_len=1024)
    state = EngineClientStateMachine(builtin_factory("inproc", config), kind="inproc")
    try:
        state.short_lived_client(fails=True)
        state.short_lived_client(fails=False)
    finally:
        state.teardown()


# --- the conformance suite ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=["inproc", "sync"])
def small(request: pytest.FixtureRequest) -> Iterator[cf.ClientUnderTest]:
    cut = cf.open_client(request.param, SMALL)
    try:
        yield cut
    finally:
        cut.shutdown()


def test_live_scenarios_fit_a_short_max_model_len(small: cf.ClientUnderTest) -> None:
    cf.check_generate(small)
    cf.check_abort_half(small)
    cf.check_sleep_wake(small, 1, "keep")
    cf.check_prefix_caching(small)
    with pytest.raises(ValueError, match="max_model_len leaves 12 tokens"):
        cf.check_generate(small, max_tokens=100)


def test_failed_sleep_check_wakes_the_engine(small: cf.ClientUnderTest,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kw: Any) -> dict[str, cf.Finished]:
        raise AssertionError("injected: the check fails while the engine sleeps")

    monkeypatch.setattr(cf, "collect", broken)
    with pytest.raises(AssertionError, match="injected"):
        cf.check_sleep_wake(small, 1, "abort")
    monkeypatch.undo()
    assert not small.is_sleeping()
    cf.check_generate(small, n=1)


def test_prefix_caching_not_applicable_without_it() -> None:
    with cf.open_client("inproc", DEFAULT_NULL) as cut:
        with pytest.raises(cf.NotApplicable, match="prefix caching"):
            cf.check_prefix_caching(cut)


@pytest.mark.parametrize("kind", ["inproc", "sync"])
def test_builtin_factory_meets_the_factory_contract(kind: str) -> None:
    """config= replaces the factory's config (the audit's TypeError); the in-process client
    refuses engine-process options with NotApplicable."""
    factory = builtin_factory(kind, DEFAULT_NULL)
    cf.check_construction_failure_leaks_nothing(factory, EngineConfig(model="no-such-model"))
    if kind == "inproc":
        for option in ("engine_fault", "engine_startup_delay_s"):
            with pytest.raises(cf.NotApplicable, match=option):
                factory(**{option: 1.0})
