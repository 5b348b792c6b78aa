"""The conformance suite on a test engineer's own client class, as its docstring shows: wrapped
in a ``ClientUnderTest``, it passes when it behaves and fails, naming what, when it does not."""

from __future__ import annotations

from typing import Any

import pytest

from enginewire import AsyncMPClient, EngineCoreOutputs, EngineDeadError, SyncMPClient
from enginewire.runtime.config import EngineConfig
from enginewire.testing import conformance as cf

CONFIG = EngineConfig(model="null", max_num_seqs=8)


class CountingAsyncClient(AsyncMPClient):
    """A user's own async client: a thin subclass that counts what it sends."""

    added = 0

    async def add_request_async(self, request: Any) -> None:
        await super().add_request_async(request)
        self.added += 1


class LossyClient(SyncMPClient):
    """Broken: loses the second batch that carries outputs."""

    batches = 0

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        out = super().get_output(timeout)
        if out.outputs:
            self.batches += 1
            if self.batches == 2:
                return EngineCoreOutputs(engine_index=out.engine_index)
        return out


class SwallowingClient(SyncMPClient):
    """Broken: turns the engine's death into empty batches."""

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        try:
            return super().get_output(timeout)
        except EngineDeadError:
            return EngineCoreOutputs()


def factory_for(cls: type, kind: str = "sync") -> cf.ClientFactory:
    def factory(**options: Any) -> cf.ClientUnderTest:
        config, trace = options.pop("config", CONFIG), []
        return cf.ClientUnderTest(cls(config, trace=trace, **options), kind, trace)

    return factory


def test_an_own_async_client_runs_without_a_private_loop() -> None:
    # Before, the driver called the sync names on it: AttributeError 'add_request'.
    with factory_for(CountingAsyncClient, "async")() as cut:
        cf.check_generate(cut, n=3, max_tokens=4)
        cf.check_trace(cut)
        assert cut.client.added == 3
    assert cut.loop is not None and cut.loop.loop.is_closed()


def test_a_client_kind_outside_the_three_is_refused() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        cf.ClientUnderTest(object(), "threaded")


def test_a_client_that_loses_a_batch_fails_naming_the_request() -> None:
    with factory_for(LossyClient)() as cut, pytest.raises(AssertionError,
                                                          match="expected LENGTH after exactly"):
        cf.check_generate(cut, n=2, max_tokens=6)


def test_a_client_that_swallows_the_engines_death_fails_by_name() -> None:
    # Before, the check read empty batches until its 60 s wait ran out and failed as
    # "timed out ...; unfinished: ['doomed']", naming neither the death nor the client.
    with pytest.raises(AssertionError, match="swallowed the engine's death"):
        cf.check_engine_fatal_error(factory_for(SwallowingClient))


def test_a_well_behaved_subclass_passes_the_fatal_error_check() -> None:
    cf.check_engine_fatal_error(factory_for(SyncMPClient))
