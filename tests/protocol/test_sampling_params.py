"""Non-finite floats in SamplingParams: refused by name, when built and when decoded.

``temperature=inf`` passed the range check (``>= 0``) and silently turned off top-k and
top-p; ``nan`` failed it with a message that did not say why."""

from __future__ import annotations

import math

import msgspec
import pytest

from enginewire.protocol.codec import decode_input
from enginewire.protocol.messages import EngineCoreRequest, RequestType, SamplingParams
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine import EngineCore
from enginewire.spec import ProtocolError

BAD = [("temperature", math.inf), ("temperature", -math.inf), ("temperature", math.nan),
       ("top_p", math.inf), ("top_p", math.nan), ("top_p", -math.inf)]


@pytest.mark.parametrize("field, value", BAD)
def test_built_with_a_non_finite_float_is_a_value_error_naming_the_field(
        field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        msgspec.structs.replace(SamplingParams(), **{field: value})


@pytest.mark.parametrize("field, value", BAD)
def test_decoded_with_a_non_finite_float_is_a_protocol_error_naming_the_field(
        field: str, value: float) -> None:
    sp: list[float] = [16, 0.5, 1.0]  # max_tokens, temperature, top_p
    sp[1 if field == "temperature" else 2] = value
    payload = msgspec.msgpack.encode(["r", [1, 2], sp])
    with pytest.raises(ProtocolError, match=f"SamplingParams.{field}="):
        decode_input([RequestType.ADD.value + payload])


def test_finite_values_still_pass_and_the_engine_serves_them() -> None:
    sp = SamplingParams(max_tokens=3, temperature=1e6, top_p=1e-9, seed=1)
    eng = EngineCore(EngineConfig(model="null"))
    eng.add_request(EngineCoreRequest("r", [1, 2], sp))
    tokens: list[int] = []
    for _ in range(20):
        tokens += [t for o in eng.step().outputs for t in o.new_token_ids]
        if not eng.has_unfinished_requests():
            break
    assert len(tokens) == 3
