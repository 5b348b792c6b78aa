"""The campaign (enginewire.testing.campaign): bounded runs on every client, the mutant table,
and the oracle's own judgements (so a campaign that passes cannot be a campaign that checks
nothing)."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import sys
from pathlib import Path

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from enginewire.protocol.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from enginewire.runtime.model import TINY_ARCH, null_token
from enginewire.spec import ClientState
from enginewire.testing import mutants
from enginewire.testing.campaign import (
    _failure_of,
    _seed_only_draws,
    _settings,
    reproducer_program,
    run_campaign,
)
from enginewire.testing.oracle import Coverage, Oracle, OracleViolation, null_tokens
from enginewire.testing.stateful import CampaignStats
from enginewire.testing.unreached import UNREACHED, why_unreached

os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")  # spawned engines inherit it

# Small enough for CI on 2 cores: a few examples per client, short programs, the null model
# (whose engines start in well under a second: they never load torch).
CI_EXAMPLES = 5
CI_STEPS = 20


def _report(results: Path, pattern: str) -> dict:
    (path,) = sorted(results.glob(pattern))
    return json.loads(path.read_text())


# --- the oracle judges (no engine) --------------------------------------------------------------


def _out(rid: str, tokens: list[int], finish: FinishReason | None = None,
         error: str | None = None) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=[EngineCoreOutput(rid, tokens, finish, None, 0, error)])


def test_null_tokens_match_the_null_model() -> None:
    got = null_tokens(42, 3, 5, TINY_ARCH.vocab_size)
    assert got == [null_token(42, 3 + i) for i in range(5)]


def test_oracle_accepts_a_correct_stream() -> None:
    o = Oracle(exact_tokens=True)
    want = null_tokens(7, 2, 3, TINY_ARCH.vocab_size)
    o.add("a", 3, want, None)
    assert o.observe(_out("a", want[:2])) == []
    assert o.observe(_out("a", want[2:], FinishReason.LENGTH)) == ["a"]
    assert o.finished_ids == ["a"] and o.live_ids() == []


@pytest.mark.parametrize("case", ["short_length", "wrong_token", "abort_unasked",
                                  "after_finish", "never_sent", "error_unasked", "past_stop"])
def test_oracle_rejects(case: str) -> None:
    o = Oracle(exact_tokens=True)
    want = null_tokens(1, 2, 4, TINY_ARCH.vocab_size)
    o.add("a", 4, want, 1 if case == "past_stop" else None)
    batches = {
        "short_length": [_out("a", want[:3], FinishReason.LENGTH)],
        "wrong_token": [_out("a", [want[0] + 1])],
        "abort_unasked": [_out("a", want[:1], FinishReason.ABORT)],
        "after_finish": [_out("a", want, FinishReason.LENGTH), _out("a", [])],
        "never_sent": [_out("b", [1])],
        "error_unasked": [_out("a", [], FinishReason.ERROR, "boom")],
        "past_stop": [_out("a", want[:3])],
    }[case]
    with pytest.raises(OracleViolation):
        for b in batches:
            o.observe(b)


def test_oracle_models_races_as_sets() -> None:
    """An aborted request may still end naturally; a parked one need not finish."""
    o = Oracle(exact_tokens=True)
    want = null_tokens(3, 1, 2, TINY_ARCH.vocab_size)
    o.add("a", 2, want, None)
    o.add("b", 2, null_tokens(4, 1, 2, TINY_ARCH.vocab_size), None)
    o.abort(["a"])
    o.observe(_out("a", want, FinishReason.LENGTH))  # the finish won the race: allowed
    drained = o.pause("keep")
    assert drained == [] and o.must_finish_ids() == []
    assert o.expected_client_states() == frozenset({ClientState.SLEEPING})
    assert o.wake(None) is True and o.must_finish_ids() == ["b"]


def test_oracle_wake_tags() -> None:
    o = Oracle(exact_tokens=False)
    o.pause("abort", level=1)
    assert o.expect_wake(["weights"]) is False and not o.resume_allowed()
    assert o.wake(["weights"]) is False
    assert o.wake(["kv_cache", "scheduling"]) is True and o.resume_allowed()


def test_unreached_table_names_only_spec_transitions() -> None:
    """The declared 'never reached, because' table stays in sync with the spec machines."""
    declared = set(Coverage().declared())
    stale = [k for k in UNREACHED if k not in declared]
    assert not stale, f"UNREACHED names transitions the spec no longer has: {stale}"
    assert all(why.strip() for why in UNREACHED.values())
    # Transitions the campaign reaches are not excused: a few it must reach, spot-checked.
    for reached in [("engine", "RUNNING", "PAUSE_WAIT", "DRAINING"),
                    ("engine_request", "RUNNING", "ERROR", "FINISHED_ERROR"),
                    ("client", "CONSTRUCTING", "CONSTRUCTION_FAILED", "SHUTDOWN")]:
        assert reached in declared and reached not in UNREACHED


def test_report_gives_every_unreached_transition_a_reason() -> None:
    assert why_unreached("engine SHUTDOWN -SHUTDOWN-> SHUTDOWN") == UNREACHED[
        ("engine", "SHUTDOWN", "SHUTDOWN", "SHUTDOWN")]
    assert why_unreached("engine RUNNING -SHUTDOWN-> SHUTDOWN").startswith("NOT REACHED")
    # A run with no in-process client cannot see the engine's side: not called a gap there.
    unseen = why_unreached("engine RUNNING -SHUTDOWN-> SHUTDOWN", engine_observed=False)
    assert unseen.startswith("not observed") and "--client inproc" in unseen
    assert why_unreached("client READY -SHUTDOWN-> SHUTDOWN", engine_observed=False
                         ).startswith("NOT REACHED")
    assert why_unreached("engine SHUTDOWN -SHUTDOWN-> SHUTDOWN", engine_observed=False
                         ) == UNREACHED[("engine", "SHUTDOWN", "SHUTDOWN", "SHUTDOWN")]
    # Every client kind kills engines now (standalone included): a death no rule drove is a gap.
    assert why_unreached("utility PENDING -ENGINE_DIED-> FAILED_DEAD").startswith("NOT REACHED")


def test_coverage_lists_what_was_never_reached() -> None:
    cov = Coverage()
    cov.add([("client", "CONSTRUCTING", "HANDSHAKE_OK", "READY", 0.0)])
    rep = cov.report()
    assert rep["transitions_reached"] == 1
    assert "client CONSTRUCTING -HANDSHAKE_OK-> READY" not in rep["never_reached_transitions"]
    assert "client READY -ADD_REQUEST-> RUNNING" in rep["never_reached_transitions"]


def test_reproducer_falls_back_to_the_recorded_program() -> None:
    """A flaky report prints no program; the machine's own record of the failing example is
    the reproducer then, made runnable like a shrunk one."""
    recorded = ["state = EngineClientStateMachine()", "state.echo(value=[1, 'a'])",
                "state.crash(how='sigkill', observers=True)"]
    text = reproducer_program(["Traceback ...", "FlakyStrategyDefinition: ..."], "sync", "null",
                              True, recorded)
    assert "Not shrunk" in text
    assert "state = EngineClientStateMachine(factory, kind='sync'" in text
    assert text.splitlines()[-2:] == recorded[1:]
    # A program Hypothesis printed (shrunk) wins over the record.
    shrunk = reproducer_program(["state = EngineClientStateMachine()", "state.poll()"], "sync",
                                "null", True, recorded)
    assert "Not shrunk" not in shrunk and shrunk.splitlines()[-1] == "state.poll()"
    compile(text, "<reproducer>", "exec")  # valid Python as printed
    # A standalone run's program builds its engine and pool, and stops the engine at the end.
    lone = reproducer_program(
        ["state = StandaloneEngineStateMachine()",
         "state.handover_after_vanish(left=1, then='asleep', next_kind='async')"],
        "standalone", "null", True)
    assert "state = StandaloneEngineStateMachine(pool, faults=True" in lone
    assert lone.splitlines()[-1] == "pool.close()"
    compile(lone, "<reproducer>", "exec")


class _FailsOnce(RuleBasedStateMachine):
    """Fails in the first example that reaches its second step, and never again: Hypothesis'
    replay of that example goes on past where it failed, and it reports the run as flaky."""

    failed = False
    stats = CampaignStats()

    def __init__(self) -> None:
        super().__init__()
        self.program = ["state = _FailsOnce()"]

    @rule(n=st.integers(0, 3))
    def step(self, n: int) -> None:
        self.program.append(f"state.step(n={n!r})")
        if len(self.program) == 3 and not type(self).failed:
            type(self).failed = True
            err = OracleViolation("the original failure")
            self.stats.record_failure("step", err, self.program)
            raise err


def test_a_flaky_replay_reports_the_original_failure_as_its_headline(tmp_path: Path) -> None:
    stats = _FailsOnce.stats
    stats.begin_round()
    sets = _settings("ci", 10, 5, None, tmp_path, shrink=False)
    with pytest.raises(Flaky) as caught:
        run_state_machine_as_test(_FailsOnce, settings=sets)
    failure, flaky, program = _failure_of(caught.value, stats)
    assert failure == "OracleViolation: the original failure (in step)"
    assert flaky is not None and flaky.startswith(type(caught.value).__name__)
    assert program is not None and program[0] == "state = _FailsOnce()" and len(program) == 3
    # A failure that replays is reported as Hypothesis raised it, its program Hypothesis'.
    assert _failure_of(OracleViolation("plain"), stats) == ("OracleViolation: plain", None, None)


def test_a_seed_draws_alike_whatever_modules_are_loaded(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Hypothesis mixes the constants of every local module loaded so far into its draws; in
    a campaign a seed alone decides them, so the CLI, a mutant's child and a test replay the
    same examples."""
    def draws() -> list[int]:
        seen: list[int] = []

        @settings(derandomize=True, database=None, max_examples=200, phases=[Phase.generate])
        @given(st.integers(0, 2**40))
        def test(n: int) -> None:
            seen.append(n)

        with _seed_only_draws():
            test()
        return seen

    before = draws()
    module = tmp_path / "campaign_constants_probe.py"
    module.write_text(f"VALUES = {[1_000_003 + 7_919 * i for i in range(20)]}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module.stem, raising=False)
    importlib.import_module(module.stem)
    assert draws() == before


# --- bounded campaigns on the real engine ------------------------------------------------------


@pytest.mark.parametrize("client", ["inproc", "sync", "async"])
def test_bounded_campaign(client: str, tmp_path: Path) -> None:
    examples = CI_EXAMPLES * (4 if client == "inproc" else 1)  # in-process steps are cheap
    assert run_campaign(client=client, examples=examples, steps=CI_STEPS,
                        results_dir=str(tmp_path)) == 0
    report = _report(tmp_path, "campaign-*.json")
    (res,) = report["clients"]
    assert res["client"] == client and res["failure"] is None
    assert res["examples"] >= examples and res["steps"] >= examples * 5
    assert res["steps_per_s"] > 0
    assert report["coverage"]["transitions_reached"] > 10


# What a mutant's detection must say, where another failure could stand in for it.
SYMPTOMS = {
    "dp_member_client_read_outside_lock": r"'NoneType' object has no attribute 'call_utility",
    "dp_power_follows_combined_reply": r"sleep, yet the client is (READY|RUNNING)",
    # The elastic class (issue 46), on the data-parallel machine with its scale rules.
    "dp_leaver_still_routed": r"routed to an engine that was not serving",
    "dp_leaver_leftovers_never_ended": r"did not finish",
    "dp_joiner_serves_before_commit": r"before the scale commits",
    # Several front ends (issue 47, stateful_fe.py): each by the property it breaks.
    "fe_outputs_routed_to_front_end_0": r"^OracleViolation: isolation:",
    "fe_gone_requests_left_running": r"^OracleViolation: own-death-ends-own-requests:",
    "fe_power_notice_to_caller_only": r"^OracleViolation: power view converges:",
    "fe_finish_sent_twice": r"^OracleViolation: exactly-once:",
}


def test_every_symptom_names_a_mutant_of_the_bank() -> None:
    assert set(SYMPTOMS) <= set(mutants.BANK)


_BANK = sorted(mutants.BANK)


# The mutant table is the slow tier's longest file: half in each of two classes, which the
# two workers take side by side (``--dist loadscope``: a class is scheduled as a unit, a
# module's functions as another), where one worker ran all of it while the other idled.
@pytest.mark.slow
class TestMutantTableEven:
    @pytest.mark.parametrize("name", _BANK[::2])
    def test_mutant_is_detected(self, name: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
        check_mutant_is_detected(name, tmp_path, capsys)


@pytest.mark.slow
class TestMutantTableOdd:
    @pytest.mark.parametrize("name", _BANK[1::2])
    def test_mutant_is_detected(self, name: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
        check_mutant_is_detected(name, tmp_path, capsys)


def test_the_two_halves_of_the_mutant_table_are_the_bank() -> None:
    assert sorted([*_BANK[::2], *_BANK[1::2]]) == sorted(mutants.BANK)


def check_mutant_is_detected(name: str, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    """The mutant table, one row per test: the campaign must find every seeded bug."""
    # The attach-path mutants run on one engine that front ends take turns on, some rules of
    # which need a handover of a given kind first: they get more examples. So does an abort
    # overtaking its ADD (an idle engine's input thread must win a race; 22 of 24 runs of 8
    # examples met one). The run stops at its first detection.
    # The membership mutants show only on a data-parallel example that drew restarts and then
    # an after-pick kill (or a sleep racing a stop): they get more examples too.
    # So do the elastic ones: a scale of the right shape (a drain with streams, two joiners).
    timing = (mutants.BANK[name].clients == ("standalone",) or name == "abort_applied_before_add"
              or mutants.BANK[name].kind in ("membership", "elastic"))
    examples = 24 if timing else 8
    assert run_campaign(mutant=name, examples=examples, steps=25,
                        results_dir=str(tmp_path)) == 1, (
        (tmp_path / f"mutant-{name}.log").read_text()[-3000:])
    report = _report(tmp_path, f"mutant-{name}-*.json")
    failing = [c for c in report["clients"] if c["failure"]]
    # The attach-path mutants run on front ends taking turns on one standalone engine, the
    # membership ones on the data-parallel machine.
    clients = mutants.BANK[name].clients
    made = ("state = StandaloneEngineStateMachine(pool" if clients == ("standalone",)
            else "state = FrontEndsStateMachine(engine" if clients == ("fe",)
            else "state = ElasticDPStateMachine(pool" if mutants.BANK[name].kind == "elastic"
            else "state = DataParallelStateMachine(pool" if clients[0].startswith("dp-")
            else "state = EngineClientStateMachine(factory")
    assert failing and made in failing[0]["reproducer"]
    # Found by its own symptom, not by another failure met on the way (the membership
    # mutants once "passed" on an unrelated oracle failure their race rules never reached).
    if name in SYMPTOMS:
        assert re.search(SYMPTOMS[name], failing[0]["failure"]), failing[0]["failure"]
    # The verdict says how long the campaign took to find it, and in which example.
    assert re.search(rf"mutant {name}: DETECTED in [0-9.]+ s \(example [0-9]+\)",
                     capsys.readouterr().out)


# --- front ends taking turns on an engine started on its own -----------------------------------


def test_bounded_campaign_on_a_standalone_engine(tmp_path: Path) -> None:
    """The campaign's rules on attached front ends, with handovers mid-program and the engine
    faults: an engine serves example after example until a fault kills it, and a new one
    carries on; each is judged when it goes (its exit and leaks)."""
    # 25 steps: the derandomized draws of 5 x 20 met one handover only once the rule set
    # grew (abort_mid_generation); 5 x 25 meets 18, and 2 engine deaths (a SIGSTOP and an
    # injected exit) since the standalone crash and handover_after_fault joined the rules.
    assert run_campaign(client="standalone", examples=CI_EXAMPLES, steps=25,
                        results_dir=str(tmp_path)) == 0
    (res,) = _report(tmp_path, "campaign-*.json")["clients"]
    assert res["client"] == "standalone" and res["failure"] is None
    assert res["examples"] >= CI_EXAMPLES
    rules = res["rules"]
    assert sum(rules.get(f"handover_{how}", 0) for how in (
        "after_shutdown", "after_vanish", "mid_stream", "after_fault")) >= 2
    # Every engine a fault killed was replaced, but the last one's, which the run's end may
    # reap instead.
    deaths = rules.get("crash", 0)
    assert deaths >= 1 and deaths <= res["engines_started"] <= 1 + deaths


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["shutdown", "vanish", "mid_stream"])
def test_handover_program(how: str) -> None:
    """Each way a front end can leave the engine (running, asleep, paused, a read and a
    deferred call pending), then a sync or an async front end carries on: a fixed program,
    so every case runs whatever the campaign draws."""
    from enginewire.testing.campaign import _config
    from enginewire.testing.stateful import (
        AttachPool,
        CampaignStats,
        StandaloneEngine,
        StandaloneEngineStateMachine,
    )

    stats = CampaignStats()
    pool = AttachPool(StandaloneEngine(_config("null")), stats)
    try:
        state = StandaloneEngineStateMachine(pool, stats=stats, exact_tokens=True)
        cases = [("running", "async"), ("pending", "async"), ("asleep", "sync"),
                 ("paused", "sync"), ("pending", "sync")]
        if how == "mid_stream":  # always vanishing with requests running, then a gap
            cases = [("running", "async"), ("running", "sync")]
        try:
            for then, kind in cases:
                state.add(prompt=[5, 6], max_tokens=4, seed=1, stop_at=None, ignore_eos=True,
                          temperature=0.0, top_p=1.0, reuse=7)
                if how == "mid_stream":
                    state.handover_mid_stream(left=3, next_kind=kind)
                else:
                    getattr(state, f"handover_after_{how}")(left=3, then=then, next_kind=kind)
                state.client_state_matches_model()
                state.drain()
        except BaseException:
            with contextlib.suppress(Exception):
                state.teardown()  # as Hypothesis would: lets the failed rule's client go
            raise
        state.teardown()
    finally:
        pool.close()  # stops the engine: its exit status and every leak are judged


@pytest.mark.parametrize("seed", [-1, 1 << 64, 1.5, True, "3"])
def test_a_seed_out_of_range_is_refused_before_the_run(seed: object, tmp_path: Path) -> None:
    # Every other command takes a seed in [0, 2**64); the campaign took -1 unchecked.
    with pytest.raises(ValueError, match="seed must be an integer"):
        run_campaign(client="inproc", seed=seed, results_dir=str(tmp_path))  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())  # refused before any report was written


def test_a_standalone_engine_exits_when_its_campaign_is_killed(tmp_path: Path) -> None:
    # A campaign killed by a signal (a CI timeout's SIGTERM) runs no cleanup; its standalone
    # engine, which waits for front ends without a deadline, lived on as an orphan for good.
    from enginewire.testing.conformance import check_exits_with_parent

    check_exits_with_parent(
        "import sys\n"
        "from enginewire.runtime.config import EngineConfig\n"
        "from enginewire.testing.stateful import StandaloneEngine\n"
        "engine = StandaloneEngine(EngineConfig(model='null'))\n"
        "print(engine.pid, flush=True)\n"
        "sys.stdin.read()\n",
        "the standalone engine", env={**os.environ, "TMPDIR": str(tmp_path)})
