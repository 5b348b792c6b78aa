"""Wire messages: pinned positional layout, schema evolution, round trips and a fuzzer.

Fuzz invariant (h11's fuzzer): decoding any bytes either returns a valid message of the
expected type or raises ProtocolError, nothing else. CI runs a few hundred examples; the
campaign sets ENGINEWIRE_FUZZ_EXAMPLES=100000.
"""

from __future__ import annotations

import os
import random
import re
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from enginewire.protocol import (
    PROTOCOL_VERSION,
    SESSION_BYTES,
    AttachRequest,
    Decoder,
    Encoder,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Limits,
    ProtocolError,
    ReadyResponse,
    RequestType,
    SamplingParams,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
    decode_input,
    decode_outputs,
    encode_input,
)
from enginewire.protocol.messages import PowerNotice

FUZZ_EXAMPLES = int(os.environ.get("ENGINEWIRE_FUZZ_EXAMPLES", "300"))

# --- pinned layout -----------------------------------------------------------------------

# The positional order IS the wire format. Append new fields at the end (with a default),
# bump nothing, and add them here; never reorder, rename, retype or remove.
LAYOUT: dict[type[msgspec.Struct], tuple[str, ...]] = {
    SamplingParams: (
        "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos",
    ),
    EngineCoreRequest: (
        "request_id", "prompt_token_ids", "sampling_params", "arrival_time", "priority",
        "tensors", "client_index", "data_parallel_rank",
    ),
    UtilityRequest: ("client_index", "call_id", "method", "args"),
    EngineCoreOutput: (
        "request_id", "new_token_ids", "finish_reason", "stop_reason", "num_cached_tokens",
        "error",
    ),
    UtilityOutput: ("call_id", "failure_message", "result"),
    SchedulerStats: (
        "num_running", "num_waiting", "kv_cache_usage", "num_preempted", "step_counter",
    ),
    EngineCoreOutputs: (
        "engine_index", "outputs", "timestamp", "finished_requests", "scheduler_stats",
        "utility_output", "stream_ids", "stream_tokens", "session", "refusal", "power",
    ),
    PowerNotice: ("method", "result"),
    AttachRequest: ("session", "integrity", "client_index", "goodbye"),
    ReadyResponse: (
        "protocol_version", "engine_index", "num_gpu_blocks", "block_size", "max_model_len",
        "model", "device", "front_end_timeout_s",
    ),
}  # fmt: skip



@pytest.mark.parametrize("cls", list(LAYOUT), ids=lambda c: c.__name__)
def test_positional_layout_is_pinned(cls: type[msgspec.Struct]) -> None:
    assert cls.__struct_fields__ == LAYOUT[cls]
    cfg = cls.__struct_config__
    assert cfg.array_like and cfg.frozen
    # Every field after the required ones has a default, so a shorter array still decodes.
    n_required = len(cls.__struct_fields__) - len(cls.__struct_defaults__)
    assert n_required <= {ReadyResponse: 7, UtilityRequest: 3}.get(cls, 2)


def test_request_type_bytes_and_finish_reasons_are_pinned() -> None:
    assert {t.name: t.value for t in RequestType} == {
        "ADD": b"\x00",
        "ABORT": b"\x01",
        "UTILITY": b"\x03",
        "ATTACH": b"\x04",
    }
    assert {f.name: int(f) for f in FinishReason} == {
        "STOP": 0,
        "LENGTH": 1,
        "ABORT": 2,
        "ERROR": 3,
    }
    assert str(FinishReason.LENGTH) == "length"


# --- schema evolution --------------------------------------------------------------------


def test_older_shorter_encoding_decodes_with_defaults() -> None:
    # What a peer that predates every optional field would send.
    old_add = msgspec.msgpack.encode(["r1", [1, 2, 3]])
    kind, req = decode_input([RequestType.ADD.value + old_add])
    assert kind is RequestType.ADD
    assert req == EngineCoreRequest("r1", [1, 2, 3])
    assert isinstance(req, EngineCoreRequest) and req.sampling_params == SamplingParams()

    old_out = msgspec.msgpack.encode([3, [["a", [7]]]])
    assert decode_outputs([old_out]) == EngineCoreOutputs(3, [EngineCoreOutput("a", [7])])

    old_sp = msgspec.msgpack.encode(["r2", [5], [32, 0.5]])
    _, req2 = decode_input([RequestType.ADD.value + old_sp])
    assert isinstance(req2, EngineCoreRequest)
    assert req2.sampling_params == SamplingParams(max_tokens=32, temperature=0.5)


def test_newer_longer_encoding_decodes_ignoring_appended_fields() -> None:
    # A newer peer appended fields we do not know; positional decoding ignores the tail.
    new_out = msgspec.msgpack.encode([0, [["a", [7], None, None, 0, None, "future"]], 1.5])
    got = decode_outputs([new_out])
    assert got.outputs == [EngineCoreOutput("a", [7])] and got.timestamp == 1.5


def test_missing_required_field_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="EngineCoreRequest"):
        decode_input([RequestType.ADD.value + msgspec.msgpack.encode(["only-id"])])


# --- strategies --------------------------------------------------------------------------

ints = st.integers(-(2**63), 2**63 - 1)
small_ints = st.integers(0, 2**31 - 1)
floats = st.floats(allow_nan=False)
finite = st.floats(allow_nan=False, allow_infinity=False)
texts = st.text(max_size=24)
# Values that round-trip through untyped msgpack unchanged (no tuples, sets or NaN).
values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | ints | floats | texts | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)

sampling_params = st.builds(
    SamplingParams,
    max_tokens=small_ints,
    # finite: SamplingParams refuses inf when built (test_sampling_params.py)
    temperature=finite,
    top_p=finite,
    top_k=ints,
    seed=st.none() | ints,
    stop_token_ids=st.lists(small_ints, max_size=4),
    ignore_eos=st.booleans(),
)
requests = st.builds(
    EngineCoreRequest,
    request_id=texts,
    prompt_token_ids=st.lists(small_ints, max_size=64),
    sampling_params=sampling_params,
    arrival_time=floats,
    priority=ints,
    tensors=st.none() | st.dictionaries(texts, values, max_size=3),
    client_index=small_ints,
)
utility_requests = st.builds(
    UtilityRequest,
    client_index=small_ints,
    call_id=ints,
    method=texts,
    args=st.lists(values, max_size=4),
)
finish_reasons = st.none() | st.sampled_from(list(FinishReason))
outputs = st.builds(
    EngineCoreOutput,
    request_id=texts,
    new_token_ids=st.lists(small_ints, max_size=8),
    finish_reason=finish_reasons,
    stop_reason=st.none() | ints | texts,
    num_cached_tokens=small_ints,
    error=st.none() | texts,
)
utility_outputs = st.builds(
    UtilityOutput, call_id=ints, failure_message=st.none() | texts, result=values
)
scheduler_stats = st.builds(
    SchedulerStats,
    num_running=small_ints,
    num_waiting=small_ints,
    kv_cache_usage=floats,
    num_preempted=small_ints,
    step_counter=small_ints,
)
output_batches = st.builds(
    EngineCoreOutputs,
    engine_index=small_ints,
    outputs=st.lists(outputs, max_size=8),
    timestamp=floats,
    finished_requests=st.none() | st.lists(texts, max_size=4),
    scheduler_stats=st.none() | scheduler_stats,
    utility_output=st.none() | utility_outputs,
)
ready_responses = st.builds(
    ReadyResponse,
    protocol_version=st.just(PROTOCOL_VERSION),
    engine_index=small_ints,
    num_gpu_blocks=small_ints,
    block_size=small_ints,
    max_model_len=small_ints,
    model=texts,
    device=texts,
)
abort_ids = st.lists(texts, max_size=8)

MESSAGES: list[tuple[Any, st.SearchStrategy[Any]]] = [
    (EngineCoreRequest, requests),
    (UtilityRequest, utility_requests),
    (list[str], abort_ids),
    (EngineCoreOutputs, output_batches),
    (EngineCoreOutput, outputs),
    (UtilityOutput, utility_outputs),
    (SchedulerStats, scheduler_stats),
    (SamplingParams, sampling_params),
    (ReadyResponse, ready_responses),
]
any_message = st.one_of(*[st.tuples(st.just(t), s) for t, s in MESSAGES])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_message)
def test_every_message_round_trips(case: tuple[Any, Any]) -> None:
    type_, msg = case
    frames = Encoder().encode(msg)
    assert Decoder(type_).decode(frames) == msg


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(list(RequestType)), st.data())
def test_input_round_trips_through_type_byte(kind: RequestType, data: st.DataObject) -> None:
    strategy = {
        RequestType.ADD: requests,
        RequestType.ABORT: abort_ids,
        RequestType.UTILITY: utility_requests,
        RequestType.ATTACH: st.builds(
            AttachRequest, st.binary(min_size=SESSION_BYTES, max_size=SESSION_BYTES),
            st.booleans()),
    }[kind]
    msg = data.draw(strategy)
    got_kind, got = decode_input(encode_input(Encoder(), kind, msg))
    assert got_kind is kind and got == msg


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrays=st.dictionaries(
        texts,
        hnp.arrays(
            dtype=hnp.scalar_dtypes() | hnp.byte_string_dtypes() | hnp.unicode_string_dtypes(),
            shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
        ),
        max_size=3,
    ),
    threshold=st.sampled_from([0, 16, 1 << 20]),
    as_torch=st.booleans(),
)
# Found by this test: an empty tensor may report stride 0, which a byte view refused.
@example(arrays={"0": np.array(False), "": np.array([], dtype=np.int16)}, threshold=0,
         as_torch=True)
def test_arrays_round_trip_inside_messages(
    arrays: dict[str, np.ndarray[Any, Any]], threshold: int, as_torch: bool
) -> None:
    import torch

    values: dict[str, Any] = {}
    for k, a in arrays.items():
        if as_torch and a.dtype.kind in "biufc" and a.dtype.isnative:
            a = np.ascontiguousarray(a)
            values[k] = torch.from_numpy(a)
        else:
            values[k] = a
    frames = encode_input(Encoder(size_threshold=threshold), RequestType.ADD,
                          EngineCoreRequest("r", [1], tensors=values))
    _, got = decode_input(frames)
    assert isinstance(got, EngineCoreRequest) and got.tensors is not None
    assert got.tensors.keys() == values.keys()
    for k, v in values.items():
        back = got.tensors[k]
        assert type(back) is type(v) and back.dtype == v.dtype and back.shape == v.shape
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(back, v)
        else:  # bit-exact, NaNs included
            assert back.numpy().tobytes() == v.numpy().tobytes()


# --- fuzzing -----------------------------------------------------------------------------

TARGETS: list[Any] = [
    EngineCoreRequest,
    UtilityRequest,
    list[str],
    EngineCoreOutputs,
    UtilityOutput,
    ReadyResponse,
]
# msgpack bytes that stress a decoder: never-used 0xc1, huge container headers, ext headers.
SPECIAL = [0xC1, 0xDD, 0xDF, 0xDC, 0xC7, 0xC8, 0xC9, 0xD4, 0xD8, 0xC4, 0xC6, 0xFF, 0x00, 0x7F]


def _mutate(payload: bytes, rng: random.Random) -> bytes:
    data = bytearray(payload)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:  # flip bits
            data[min(pos, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:  # truncate
            del data[pos:]
        elif op == 2:  # insert a stress byte
            data[pos:pos] = bytes([rng.choice(SPECIAL)])
        elif op == 3 and data:  # overwrite with a stress byte
            data[min(pos, len(data) - 1)] = rng.choice(SPECIAL)
        else:  # duplicate a slice
            data[pos:pos] = data[pos : pos + rng.randint(1, 8)]
    return bytes(data)


def _check_decode(target: Any, frames: list[bytes]) -> None:
    try:
        got = Decoder(target).decode(frames)
    except ProtocolError:
        return
    origin = getattr(target, "__origin__", target)
    assert isinstance(got, origin)
    Encoder().encode(got)  # whatever decoded is a valid, sendable message


def _corpus_frames(rng: random.Random, msg_frames: list[bytes | memoryview]) -> list[bytes]:
    frames = [bytes(f) for f in msg_frames]
    frames[0] = _mutate(frames[0], rng)
    if rng.random() < 0.1:
        frames.append(rng.randbytes(rng.randrange(64)))
    return frames


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    target=st.sampled_from(TARGETS),
    seed=st.integers(0, 2**32),
    raw=st.one_of(st.none(), st.binary(max_size=256)),
    data=st.data(),
)
def test_fuzz_decode_returns_message_or_protocol_error(
    target: Any, seed: int, raw: bytes | None, data: st.DataObject
) -> None:
    rng = random.Random(seed)
    if raw is not None:
        frames = [raw]
    else:  # a real message, mutated
        frames = _corpus_frames(rng, Encoder().encode(data.draw(any_message)[1]))
    _check_decode(target, frames)
    # The engine-side entry point with a random type byte too.
    type_byte = rng.choice([b"\x00", b"\x01", b"\x03", b"\x02", b"", b"\x00\x00"])
    try:
        decode_input([type_byte + bytes(frames[0]), *frames[1:]])
    except ProtocolError:
        pass


def test_fuzz_mutated_real_frames_seeded() -> None:
    """A fast seeded mutation loop over a corpus of real frames (including tensors)."""
    import numpy as np

    rng = random.Random(1234)
    enc = Encoder(size_threshold=16)
    corpus: list[list[bytes | memoryview]] = [
        enc.encode(EngineCoreRequest("r", list(range(40)), tensors={"e": np.arange(12.0)})),
        enc.encode(EngineCoreRequest("r", [1], tensors={"e": np.arange(2)})),
        enc.encode(EngineCoreOutputs(1, [EngineCoreOutput("a", [1], FinishReason.STOP)] * 3)),
        enc.encode(UtilityRequest(0, 7, "m", [1, "x", {"k": np.ones(3)}])),
        enc.encode(UtilityOutput(7, None, [1.5, np.zeros((2, 2))])),
        enc.encode(["a", "b"]),
        enc.encode(ReadyResponse(PROTOCOL_VERSION, 0, 10, 16, 128, "m", "cpu")),
    ]
    for _ in range(FUZZ_EXAMPLES * 4):
        frames = _corpus_frames(rng, rng.choice(corpus))
        if len(frames) > 1 and rng.random() < 0.3:  # damage an aux frame instead
            frames[1] = frames[1][: rng.randrange(len(frames[1]) + 1)]
        _check_decode(rng.choice(TARGETS), frames)


# --- stream columns ----------------------------------------------------------------------


def test_stream_columns_round_trip_and_expand_in_order() -> None:
    batch = EngineCoreOutputs(
        2, [EngineCoreOutput("z", [], FinishReason.ABORT)], 1.5, ["z"],
        stream_ids=["a", "b"], stream_tokens=[7, 8],
    )
    got = decode_outputs(Encoder().encode(batch))
    assert got == batch
    assert got.expanded() == EngineCoreOutputs(
        2, [EngineCoreOutput("a", [7]), EngineCoreOutput("b", [8]),
            EngineCoreOutput("z", [], FinishReason.ABORT)], 1.5, ["z"])
    plain = EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1])])
    assert plain.expanded() is plain


@pytest.mark.parametrize(("ids", "tokens"), [(["a", "b"], [1]), (["a"], [1, 2])])
def test_expanding_columns_of_different_lengths_raises_rather_than_dropping(
    ids: list[str], tokens: list[int]
) -> None:
    # Built in memory (an in-process engine's batch), so no decoder's post-check ran.
    with pytest.raises(ValueError, match="stream ids but"):
        EngineCoreOutputs(stream_ids=ids, stream_tokens=tokens).expanded()


def test_each_expanded_output_has_a_token_list_of_its_own() -> None:
    got = EngineCoreOutputs(stream_ids=["a", "b"], stream_tokens=[5, 5]).expanded().outputs
    got[0].new_token_ids.append(6)
    assert got[1].new_token_ids == [5]
    assert all(type(o.new_token_ids) is list for o in got)


@pytest.mark.parametrize(("ids", "tokens"), [(["a", "b"], [1]), (["a"], [1, 2]), ([], [3])])
def test_stream_columns_of_different_lengths_are_a_protocol_error(
    ids: list[str], tokens: list[int]
) -> None:
    frames = Encoder().encode(EngineCoreOutputs(stream_ids=ids, stream_tokens=tokens))
    with pytest.raises(ProtocolError, match="as many stream tokens as stream ids"):
        decode_outputs(frames)


def test_stream_columns_count_toward_the_batch_limit() -> None:
    limits = Limits(max_batch=3)
    ok = EngineCoreOutputs(stream_ids=["a", "b", "c"], stream_tokens=[1, 2, 3])
    assert decode_outputs(Encoder().encode(ok), limits) == ok
    over = EngineCoreOutputs(0, [EngineCoreOutput("d", [4])], stream_ids=["a", "b", "c"],
                             stream_tokens=[1, 2, 3])
    with pytest.raises(ProtocolError, match="at most 3 outputs"):
        decode_outputs(Encoder().encode(over), limits)


def test_protocol_page_says_what_the_encoder_writes() -> None:
    """docs/protocol.md's "Encoded as" line for each struct matches the bytes: msgspec writes
    every field of an array_like struct whatever its omit_defaults, so a page promising
    omitted defaults would mislead a front-end author sizing or parsing frames."""
    from pathlib import Path

    from enginewire.protocol.catalogue import _INBOUND, _OUTBOUND

    page = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text("utf-8")
    dummy = {str: "x", int: 0, list[int]: [], float: 0.0}
    for cls in (*_INBOUND, *_OUTBOUND):
        said = re.search(rf"### `{cls.__name__}`\n.*?\nEncoded as ([^\n]*)", page, re.S)
        assert said, cls.__name__
        # Only the required fields, so every other one is at its default.
        short = [bytes(SESSION_BYTES) if f.name == "session" else dummy[f.type]
                 for f in msgspec.structs.fields(cls) if f.required]
        obj = msgspec.msgpack.decode(msgspec.msgpack.encode(short), type=cls)
        written = msgspec.msgpack.decode(msgspec.msgpack.encode(obj))
        every_field = len(written) == len(cls.__struct_fields__)
        assert every_field == ("every field, defaults included" in said[1]), (cls, said[1])
        assert "omitted=True" not in said[1] or not every_field, (cls, said[1])
