"""The campaign machine judges a client by what its factory declares (``factory.contract``,
``Declared``): where vLLM's client differs from enginewire's in how it refuses calls after
shutdown, checks ids and delivers a death, the machine follows the declaration, and without
it the same behaviour fails. The in-process client plays the declared behaviour behind a
proxy (``_Declaring``), so none of this needs vLLM."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from enginewire.protocol.messages import EngineCoreOutput, EngineCoreOutputs
from enginewire.spec.client import ClientState
from enginewire.spec.errors import ClientClosedError, EngineDeadError
from enginewire.testing import conformance as cf
from enginewire.testing._conformance_driver import Declared
from enginewire.testing.campaign import _config
from enginewire.testing.oracle import OracleViolation
from enginewire.testing.stateful import EngineClientStateMachine, builtin_factory

os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")

# The calls whose refusal a declaring client gives differently.
_CALLS = frozenset({"add_request", "abort_requests", "get_output", "call_utility",
                    "call_utility_all", "sleep", "wake_up", "is_sleeping", "pause_scheduler",
                    "resume_scheduler"})


class _Declaring:
    """The in-process client, behaving as vLLM's does where ``plays`` says: ``closed_is_dead``
    (after shutdown EngineDeadError for ClientClosedError, an abort a no-op),
    ``dead_once`` (get_output raises the death once, then returns nothing, as a bounded
    read of a blocked queue does); ``accepts_add`` breaks the spec even so (an add after
    shutdown returns), ``ghost`` too (a read after the delivered death returns outputs), and
    ``closed_blocks`` (a read after shutdown blocks, as vLLM's does: no error is ever queued)."""

    def __init__(self, inner: Any, plays: frozenset[str]) -> None:
        self._inner = inner
        self._plays = plays
        self._death_delivered = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in _CALLS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if name == "get_output" and "closed_blocks" in self._plays and \
                    self._inner.state is ClientState.SHUTDOWN:
                time.sleep(kwargs.get("timeout") or 0.05)  # vLLM's read after its shutdown
                return EngineCoreOutputs()
            if name == "get_output" and self._death_delivered and "dead_once" in self._plays:
                if "ghost" in self._plays:
                    return EngineCoreOutputs(outputs=[EngineCoreOutput("ghost", [3])])
                return EngineCoreOutputs()
            try:
                return attr(*args, **kwargs)
            except ClientClosedError as e:
                if "accepts_add" in self._plays and name == "add_request":
                    return None
                if "closed_is_dead" not in self._plays:
                    raise
                if name == "abort_requests":
                    return None
                raise EngineDeadError() from e
            except EngineDeadError:
                if name == "get_output":
                    self._death_delivered = True
                raise

        return call


class _Factory:
    """The built-in in-process factory with a contract, its clients behind ``_Declaring``."""

    def __init__(self, contract: dict[str, str], plays: frozenset[str]) -> None:
        self.contract = contract
        self._plays = plays
        self._inner = builtin_factory("inproc", _config("null"))

    def __call__(self, **options: Any) -> cf.ClientUnderTest:
        cut = self._inner(**options)
        return cf.ClientUnderTest(_Declaring(cut.client, self._plays), "inproc", cut.trace,
                                  cut.loop, inject=cut.inject)


def _declares(*names: Declared) -> dict[str, str]:
    return {n.value: "as vLLM's client does" for n in names}


@pytest.fixture
def machine() -> Iterator[Callable[..., EngineClientStateMachine]]:
    made: list[EngineClientStateMachine] = []

    def make(contract: dict[str, str], *plays: str) -> EngineClientStateMachine:
        made.append(EngineClientStateMachine(_Factory(contract, frozenset(plays)),
                                             kind="inproc", exact_tokens=True))
        return made[-1]

    yield make
    for state in made:
        state.teardown()


def test_closed_is_dead_accepts_engine_dead_after_shutdown(machine: Any) -> None:
    state = machine(_declares(Declared.CLOSED_IS_DEAD), "closed_is_dead")
    state.shutdown(with_pending=False)  # every call refused at once, judged in the rule
    state.call_after_end()
    state.poll()
    state.echo(value=1)
    state.client_state_matches_model()


def test_engine_dead_after_shutdown_fails_undeclared(machine: Any) -> None:
    state = machine({}, "closed_is_dead")
    with pytest.raises(OracleViolation, match="on a closed client: raised EngineDeadError"):
        state.shutdown(with_pending=False)


def test_closed_is_dead_still_fails_a_call_accepted_after_shutdown(machine: Any) -> None:
    state = machine(_declares(Declared.CLOSED_IS_DEAD), "closed_is_dead", "accepts_add")
    with pytest.raises(OracleViolation, match="add on a closed client: returned"):
        state.shutdown(with_pending=False)


def test_no_duplicate_id_check_turns_the_duplicate_rule_off(machine: Any) -> None:
    (rule,) = [r for r in EngineClientStateMachine.setup_state().rules
               if r.function.__name__ == "add_duplicate"]
    declaring = machine(_declares(Declared.NO_DUPLICATE_ID_CHECK))
    assert not all(p(declaring) for p in rule.preconditions)
    plain = machine({})
    assert all(p(plain) for p in rule.preconditions)
    plain.add_duplicate(pick=0)  # our client refuses the live id: the rule judges it


def test_dead_delivered_once_owes_no_second_death(machine: Any) -> None:
    state = machine(_declares(Declared.DEAD_DELIVERED_ONCE), "dead_once")
    state.crash(how="step_raise", observers=False)  # a read gets the death; then silence
    assert state.oracle.death_delivered
    state.call_after_end()
    state.poll()
    state.client_state_matches_model()


def test_a_death_delivered_once_fails_undeclared(machine: Any) -> None:
    state = machine({}, "dead_once")
    with pytest.raises(OracleViolation, match=r"after 1000 reads \(0 with outputs\), none"
                                              " raised EngineDeadError"):
        state.crash(how="step_raise", observers=False)


def test_dead_delivered_once_still_fails_outputs_after_the_death(machine: Any) -> None:
    state = machine(_declares(Declared.DEAD_DELIVERED_ONCE), "dead_once", "ghost")
    with pytest.raises(OracleViolation, match=r"returned outputs for \['ghost'\] after its"
                                              " death was delivered"):
        state.crash(how="step_raise", observers=False)


def test_closed_is_dead_still_fails_a_read_that_blocks_after_shutdown(machine: Any) -> None:
    """A shut-down client judged as a dead one owes its reads the error; one whose reads only
    time out (vLLM's: nothing is queued at shutdown) fails within the death bound's margin,
    not after a thousand reads."""
    state = machine(_declares(Declared.CLOSED_IS_DEAD), "closed_is_dead", "closed_blocks")
    start = time.monotonic()
    with pytest.raises(OracleViolation, match="get_output on a closed client: no outputs and"
                                              r" no error for .* the read blocks"):
        state.shutdown(with_pending=False)
    assert time.monotonic() - start < 20
