"""Client-side tracking of a batch with many outputs the spec forbids (an engine sending for
ids this client never sent, up to Limits.max_batch of them): linear work, a bounded message.
Counted in elements copied, never timed."""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from enginewire.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from enginewire.runtime import client as client_module
from enginewire.runtime.client import InprocClient
from enginewire.runtime.config import EngineConfig
from enginewire.spec import SpecViolation


@pytest.fixture
def client() -> Iterator[InprocClient]:
    c = InprocClient(EngineConfig(model="null", device="cpu"))
    try:
        yield c
    finally:
        c.shutdown()


def test_many_forbidden_outputs_are_listed_once_and_named_in_a_bounded_message(
        client: InprocClient, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 2000
    copied = [0]

    def counting_list(items: Iterable[Any] = ()) -> list[Any]:
        out = builtins.list(items)
        copied[0] += len(out)
        return out

    # The refusal path lists what is left of the batch; the old code listed it again at
    # each refused output (some n * n / 2 copies here; half a minute for a batch of 64k).
    monkeypatch.setattr(client_module, "list", counting_list, raising=False)
    client._track_add(EngineCoreRequest("ok", [5]))
    outs = [EngineCoreOutput(f"ghost{i}", [1]) for i in range(n)]
    outs.insert(n // 2, EngineCoreOutput("ok", [7], FinishReason.LENGTH))
    with pytest.raises(SpecViolation) as info:
        client._track_outputs(EngineCoreOutputs(outputs=outs))
    assert copied[0] <= n, copied[0]
    message = str(info.value)
    assert message.startswith(f"{n} engine output(s) the spec forbids")
    assert "'ghost0', 'ghost1'" in message and f"and {n - 20} more" in message
    assert "'ghost20'" not in message and len(message) < 1000
    # The one legal output, between the refused ones, advanced and is delivered next.
    assert client.live_requests() == []
    (rest,) = client._redeliver
    assert [(o.request_id, o.finish_reason) for o in rest.outputs] == [
        ("ok", FinishReason.LENGTH)]
