"""model_tests/mutants.py: the bank of seeded bugs, each a source patch of the clean runtime
that applies and reverts cleanly, here and (through the preload hook) in spawned engines."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from enginewire.protocol.messages import EngineCoreRequest, FinishReason, SamplingParams
from enginewire.runtime import make_client
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.preload import PRELOAD_ENV
from enginewire.testing import mutants
from enginewire.testing.source_patch import PatchDriftError


@pytest.fixture(autouse=True)
def _nothing_left_on() -> Iterator[None]:
    assert mutants.active() is None and mutants.ENV_VAR not in os.environ
    yield
    mutants.revert()


@pytest.mark.parametrize("name", sorted(mutants.BANK))
def test_every_mutant_applies_and_reverts_cleanly(name: str) -> None:
    # Each old snippet occurs once in today's runtime (else PatchDriftError names it).
    funcs = [p.resolve() for p in mutants.BANK[name].patches]
    codes = [f.__code__ for f in funcs]
    preload_before = os.environ.get(PRELOAD_ENV)
    mutants.apply(name)
    assert mutants.active() == name
    assert all(f.__code__ is not c for f, c in zip(funcs, codes, strict=True))
    # What the engine processes started from now on inherit, to apply it too.
    assert os.environ[mutants.ENV_VAR] == name
    assert mutants.PRELOAD_ENTRY in os.environ[PRELOAD_ENV].split(",")
    mutants.revert()
    assert mutants.active() is None
    assert all(f.__code__ is c for f, c in zip(funcs, codes, strict=True))
    assert mutants.ENV_VAR not in os.environ and os.environ.get(PRELOAD_ENV) == preload_before


def test_every_class_of_bug_has_a_mutant() -> None:
    # Issue #30: the bank holds at least 25 seeded bugs, at least one of each class.
    assert len(mutants.BANK) >= 25
    by_kind: dict[str, list[str]] = {}
    for m in mutants.BANK.values():
        by_kind.setdefault(m.kind, []).append(m.name)
    assert set(by_kind) == set(mutants.KINDS), set(mutants.KINDS) - set(by_kind)
    # A row without a declared class, or without a bug, fails where it is written.
    patch = mutants.BANK["duplicate_live_id_accepted"].patches
    with pytest.raises(ValueError, match="is not a class of the bank; give one of quiescence"):
        mutants.Mutant("x", "a bug", ("inproc",), kind="typo", patches=patch)
    with pytest.raises(ValueError, match="no patches"):
        mutants.Mutant("x", "a bug", ("inproc",), kind="abort")


def test_one_mutant_at_a_time_and_a_user_preload_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PRELOAD_ENV, "users.own:hook")
    mutants.apply("abort_not_acknowledged")
    mutants.apply("abort_not_acknowledged")  # the one on: nothing to do
    assert os.environ[PRELOAD_ENV] == f"users.own:hook,{mutants.PRELOAD_ENTRY}"
    with pytest.raises(RuntimeError, match="'abort_not_acknowledged' is on: revert"):
        mutants.apply("abort_leaks_kv_blocks")
    mutants.revert()
    assert os.environ[PRELOAD_ENV] == "users.own:hook"
    mutants.revert()  # none on: nothing to do


def test_an_unknown_name_names_the_bank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no mutant 'bogus'; the bank has: abort_"):
        mutants.apply("bogus")
    mutants.apply_from_env()  # unset: nothing
    assert mutants.active() is None
    monkeypatch.setenv(mutants.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="ENGINEWIRE_TESTING_MUTANT='bogus' names no mutant;"
                                         " the bank has: abort_"):
        mutants.apply_from_env()
    # The switch of a campaign's child: refused before anything runs.
    from enginewire.testing.campaign import run_campaign

    with pytest.raises(ValueError, match="names no mutant"):
        run_campaign(client="inproc", examples=1, steps=1, results_dir=str(tmp_path))


def test_a_drifted_snippet_names_the_mutant_and_the_function(
        monkeypatch: pytest.MonkeyPatch) -> None:
    row = mutants.BANK["length_limit_off_by_one"]
    (patch,) = row.patches
    drifted = dataclasses.replace(patch, edits=(("max_model_len + 0)", "max_model_len + 1)"),))
    monkeypatch.setitem(mutants.BANK, row.name, dataclasses.replace(row, patches=(drifted,)))
    code = patch.resolve().__code__
    with pytest.raises(PatchDriftError, match=r"^mutant length_limit_off_by_one: patch of"
                       r" enginewire\.runtime\.scheduler:Request\.__init__: the snippet"
                       r" 'max_model_len \+ 0\)' occurs 0 times"):
        mutants.apply(row.name)
    assert patch.resolve().__code__ is code and mutants.active() is None
    assert mutants.ENV_VAR not in os.environ


def _tokens_until_length(multiprocess: bool) -> int:
    client = make_client(EngineConfig(model="null", max_model_len=16),
                         multiprocess=multiprocess, asyncio=False)
    try:
        client.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(
            max_tokens=100, ignore_eos=True)))
        tokens = 0
        while True:
            for out in client.get_output(timeout=30).outputs:
                tokens += len(out.new_token_ids)
                if out.finish_reason is not None:
                    assert out.finish_reason is FinishReason.LENGTH
                    return tokens
    finally:
        client.shutdown()


def test_a_mutant_reaches_a_spawned_engine_and_this_process() -> None:
    # The scheduler lives in the engine process only: a spawned engine ends one token late
    # only if the preload hook applied the mutant there.
    assert _tokens_until_length(True) == 16 - 3
    mutants.apply("length_limit_off_by_one")
    assert _tokens_until_length(True) == 16 - 3 + 1
    assert _tokens_until_length(False) == 16 - 3 + 1
    mutants.revert()
    assert _tokens_until_length(True) == 16 - 3
