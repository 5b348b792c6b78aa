"""The codec: tensors as zero-copy frames, strict limits, utility results, buffer reuse."""

from __future__ import annotations

import threading
from typing import Any
from unittest import mock

import msgspec
import numpy as np
import pytest
import torch
import zmq

from enginewire.protocol import (
    ENGINE_DEAD_SENTINEL,
    PROTOCOL_VERSION,
    Decoder,
    Encoder,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Limits,
    ProtocolError,
    ReadyResponse,
    RequestType,
    SamplingParams,
    StructResult,
    UtilityOutput,
    UtilityRequest,
    check_ready,
    codec,
    decode_input,
    decode_outputs,
    decode_ready,
    decode_utility_result,
    encode_input,
    is_dead_sentinel,
    peek_request_id,
    register_result_type,
    utility_output,
)
from enginewire.protocol.codec import EXT_NUMPY, EXT_TORCH, check_sendable, split_input

torch.set_num_threads(1)

def _msg(type_byte: Any, frames: Any) -> list[Any]:
    """``[type byte + payload, aux...]``: a client message's frames as the engine sees them."""
    head = type_byte if isinstance(type_byte, bytes) else bytes(type_byte.buffer)
    first = frames[0]
    body = first if isinstance(first, bytes) else bytes(getattr(first, "buffer", first))
    return [head + body, *frames[1:]]



def _addr(view: Any) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _round_trip(value: Any, threshold: int = 256) -> tuple[Any, int]:
    frames = Encoder(size_threshold=threshold).encode(UtilityRequest(0, 1, "m", [value]))
    got = Decoder(UtilityRequest).decode(frames)
    return got.args[0], len(frames) - 1


# --- tensors and arrays ------------------------------------------------------------------

TORCH_CASES = {
    "bf16": torch.arange(300, dtype=torch.float32).to(torch.bfloat16),
    "f32-2d": torch.randn(8, 16),
    "int64": torch.arange(100),
    "bool": torch.arange(500) % 3 == 0,
    "complex": torch.randn(40, dtype=torch.complex64),
    "non-contiguous": torch.arange(1000, dtype=torch.float16).reshape(20, 50)[:, ::3].t(),
    "0-d": torch.tensor(3.5, dtype=torch.float64),
    "empty": torch.empty(0, 7, dtype=torch.bfloat16),
    "uint8": torch.arange(256, dtype=torch.uint8),
}


@pytest.mark.parametrize("threshold", [0, 256, 1 << 30], ids=["all-aux", "default", "inline"])
@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_torch_tensors_round_trip(name: str, threshold: int) -> None:
    t = TORCH_CASES[name]
    got, n_aux = _round_trip(t, threshold)
    assert isinstance(got, torch.Tensor)
    assert got.dtype == t.dtype and got.shape == t.shape
    assert torch.equal(got, t)
    nbytes = t.numel() * t.element_size()
    assert n_aux == (1 if nbytes >= threshold else 0)


NUMPY_CASES = {
    "f4": np.arange(200, dtype=np.float32),
    "big-endian": np.arange(100, dtype=">i8"),
    "non-contiguous": np.arange(600, dtype=np.int16).reshape(20, 30)[::2, ::3],
    "fortran": np.asfortranarray(np.arange(120.0).reshape(10, 12)),
    "0-d": np.array(7, dtype=np.uint32),
    "empty": np.zeros((0, 3), dtype=np.float64),
    "unicode": np.array(["ab", "cde"] * 40),
    "bool": np.arange(300) % 2 == 0,
}


@pytest.mark.parametrize("threshold", [0, 1 << 30], ids=["all-aux", "inline"])
@pytest.mark.parametrize("name", list(NUMPY_CASES))
def test_numpy_arrays_round_trip(name: str, threshold: int) -> None:
    a = NUMPY_CASES[name]
    got, n_aux = _round_trip(a, threshold)
    assert isinstance(got, np.ndarray)
    assert got.dtype == a.dtype and got.shape == a.shape
    np.testing.assert_array_equal(got, a)
    assert n_aux == (1 if threshold == 0 else 0)


@pytest.mark.parametrize("threshold", [0, 1 << 30], ids=["aux", "inline"])
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_bool_array_bytes_other_than_0_or_1_are_refused(kind: str, threshold: int) -> None:
    """torch and numpy read such a byte differently (and 2 & 1 is False): refused."""
    value: Any = torch.zeros(300, dtype=torch.bool) if kind == "torch" else np.zeros(300, bool)
    frames = list(Encoder(size_threshold=threshold).encode(UtilityRequest(0, 1, "m", [value])))
    if threshold == 0:
        raw = bytearray(frames[1])
        raw[17] = 2
        frames[1] = raw
    else:  # the array's bytes end the payload: the last one is the array's last element
        frames[0] = bytes(frames[0])[:-1] + b"\x02"
    with pytest.raises(ProtocolError, match="bool array bytes of 0 or 1"):
        Decoder(UtilityRequest).decode(frames)


def test_numpy_scalar_travels_as_0d_array() -> None:
    got, _ = _round_trip(np.float32(1.25))
    assert got.shape == () and got.dtype == np.float32 and got == np.float32(1.25)


def test_inline_arrays_own_their_memory() -> None:
    got, n_aux = _round_trip(torch.arange(4))
    assert n_aux == 0
    got += 1  # writable, and not aliasing a bytes object
    assert got.tolist() == [1, 2, 3, 4]


def test_request_tensors_field_and_frames() -> None:
    embeds = torch.randn(16, 32, dtype=torch.bfloat16)
    req = EngineCoreRequest("r", [1, 2], tensors={"prompt_embeds": embeds, "tiny": torch.ones(2)})
    frames = encode_input(Encoder(), RequestType.ADD, req)
    assert frames[0][:1] == b"\x00" and len(frames) == 2  # type byte + payload, one aux
    kind, got = decode_input(frames)
    assert kind is RequestType.ADD and isinstance(got, EngineCoreRequest)
    assert got.tensors is not None
    assert torch.equal(got.tensors["prompt_embeds"], embeds)
    assert torch.equal(got.tensors["tiny"], torch.ones(2))


def test_64mib_tensor_crosses_the_codec_without_a_copy() -> None:
    t = torch.empty(64 * 1024 * 1024, dtype=torch.uint8)
    t[:: 1 << 20] = 7
    frames = Encoder().encode(EngineCoreRequest("big", [1], tensors={"x": t}))
    assert len(frames) == 2
    aux = frames[1]
    assert isinstance(aux, memoryview) and aux.nbytes == t.nbytes
    assert _addr(aux) == t.data_ptr()  # the frame IS the tensor's memory
    # Received as a zmq.Frame (what recv(copy=False) gives), decoded in place.
    zframes = [zmq.Frame(bytes(frames[0])), zmq.Frame(aux)]
    _, got = decode_input(_msg(b"\x00", zframes))
    assert isinstance(got, EngineCoreRequest) and got.tensors is not None
    x = got.tensors["x"]
    assert x.data_ptr() == _addr(zframes[1].buffer)
    assert int(x[1 << 20]) == 7 and x.shape == t.shape


def test_64mib_numpy_array_decodes_in_place() -> None:
    a = np.zeros(8 * 1024 * 1024, dtype=np.float64)
    frames = Encoder().encode(UtilityOutput(1, None, a))
    assert _addr(frames[1]) == a.ctypes.data
    got = Decoder(UtilityOutput).decode(frames)
    assert got.result.ctypes.data == _addr(frames[1])


@pytest.mark.parametrize(
    "value",
    [
        object(),
        np.array([object()]),
        np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]),
        torch.eye(3).to_sparse(),
    ],
    ids=["object", "object-array", "structured-array", "sparse-tensor"],
)
def test_unencodable_values_raise_type_error_and_never_pickle(value: object) -> None:
    with pytest.raises(TypeError, match="cannot encode"):
        Encoder().encode(UtilityOutput(1, None, value))


# --- strict decoding ---------------------------------------------------------------------


def _tensor_ext(header: list[Any], code: int = EXT_TORCH) -> bytes:
    ext = msgspec.msgpack.Ext(code, msgspec.msgpack.encode(header))
    return msgspec.msgpack.encode([1, None, ext])


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        ([], "no frames"),
        ([b"\x93\x01"], "truncated"),
        ([b"\xc1"], "msgpack"),
        ([msgspec.msgpack.encode(["x", None, None])], "Expected `int`"),
        ([msgspec.msgpack.encode([1, None, msgspec.msgpack.Ext(9, b"")])], "unknown msgpack ext"),
        ([_tensor_ext(["float32", [4], 0])], "aux frame 0"),
        ([_tensor_ext(["float32", [4], 1]), b"\x00" * 16], "aux frame 1"),
        ([_tensor_ext(["float32", [4], 0]), b"\x00" * 15], "expected 16 bytes"),
        ([_tensor_ext(["float32", [-1], b""])], "shape"),
        ([_tensor_ext(["float32", [1] * 65, b"\x00" * 4])], "shape"),
        ([_tensor_ext(["str", [1], b"\x00"])], "torch dtype"),
        ([_tensor_ext(["O", [1], b"\x00" * 8], EXT_NUMPY)], "numpy dtype string"),
        ([_tensor_ext(["i4,f4", [1], b"\x00" * 8], EXT_NUMPY)], "numpy dtype string"),
        ([_tensor_ext(["not a dtype", [1], b"\x00"], EXT_NUMPY)], "numpy dtype string"),
        ([_tensor_ext(["<f3", [1], b"\x00" * 3], EXT_NUMPY)], "numpy dtype string"),
        ([_tensor_ext(["a", [1], b"\x00"], EXT_NUMPY)], "numpy dtype string"),
        ([_tensor_ext(["float32", "x"])], "array header"),
        ([msgspec.msgpack.encode([1, None, msgspec.msgpack.Ext(3, b"\x91\x01")])], "tagged"),
    ],
)
def test_malformed_frames_raise_protocol_error_saying_what_was_expected(
    frames: list[bytes], expected: str
) -> None:
    with pytest.raises(ProtocolError, match=expected) as info:
        Decoder(UtilityOutput).decode(frames)
    assert "expected" in str(info.value).lower()


@pytest.mark.parametrize("frames", [[5], [b"\x90", 5], [None], "text", [b"\x90", object()]])
def test_non_buffer_frames_are_a_protocol_error(frames: Any) -> None:
    with pytest.raises(ProtocolError):
        Decoder(list[str]).decode(frames)


def test_limits_are_enforced() -> None:
    limits = Limits(max_frame_bytes=1000, max_frames=3, max_prompt_tokens=10, max_batch=2)
    enc = Encoder()
    add = enc.encode(EngineCoreRequest("r", list(range(11))))
    with pytest.raises(ProtocolError, match="at most 10 prompt tokens"):
        decode_input(_msg(b"\x00", add), limits)
    with pytest.raises(ProtocolError, match="at most 1000 bytes"):
        decode_input(_msg(b"\x00", enc.encode(EngineCoreRequest("r", [1] * 2000))), limits)
    with pytest.raises(ProtocolError, match="at most 3 frames"):
        decode_input(_msg(b"\x00", [add[0], b"", b"", b""]), limits)
    out = EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1])] * 3)
    with pytest.raises(ProtocolError, match="at most 2 outputs"):
        decode_outputs(enc.encode(out), limits)
    with pytest.raises(ProtocolError, match="at most 2 finished"):
        decode_outputs(enc.encode(EngineCoreOutputs(finished_requests=["a", "b", "c"])), limits)
    with pytest.raises(ProtocolError, match="at most 2 request ids"):
        decode_input(_msg(b"\x01", enc.encode(["a", "b", "c"])), limits)
    with pytest.raises(ProtocolError, match=r"expected a valid list\[str\]"):
        decode_input(_msg(b"\x01", enc.encode([1])), limits)
    # Within the limits the same decoders succeed.
    assert decode_input(_msg(b"\x01", enc.encode(["a", "b"])), limits)[1] == ["a", "b"]


@pytest.mark.parametrize("type_byte", [b"\x02", b"\x05", b"R", b"\x91"])
def test_unknown_request_type_byte_is_refused(type_byte: bytes) -> None:
    with pytest.raises(ProtocolError, match="request-type byte"):
        decode_input(_msg(type_byte, [msgspec.msgpack.encode(["a"])]))


@pytest.mark.parametrize("frames", [[], [b""], [b"", b"\x91\xa1a"], [memoryview(b"")]])
def test_a_message_without_a_type_byte_is_refused(frames: list[Any]) -> None:
    with pytest.raises(ProtocolError, match=r"no frames|empty frame"):
        decode_input(frames)


def test_the_type_byte_leads_the_payload_in_one_frame() -> None:
    frames = encode_input(Encoder(), RequestType.ABORT, ["a", "b"])
    assert frames == [b"\x01" + msgspec.msgpack.encode(["a", "b"])]
    for first in (frames[0], bytearray(frames[0]), memoryview(frames[0]), zmq.Frame(frames[0])):
        assert decode_input([first]) == (RequestType.ABORT, ["a", "b"])
    assert split_input(frames[0]) == (b"\x01", memoryview(frames[0])[1:])


def test_wrong_payload_for_type_byte_is_refused() -> None:
    abort = Encoder().encode(["a", "b"])
    with pytest.raises(ProtocolError, match="EngineCoreRequest"):
        decode_input(_msg(RequestType.ADD.value, abort))
    with pytest.raises(ProtocolError, match="UtilityRequest"):
        decode_input([zmq.Frame(RequestType.UTILITY.value + abort[0])])


def test_an_engines_adds_decode_with_their_token_ids_range_checked() -> None:
    """With ``vocab_size`` an ADD whose ids are in range decodes to the checked subclass (the
    engine then skips its own scan); any other decodes as without it: the same value, or
    the same ProtocolError."""
    checked = codec.checked_request_type(512)
    assert codec.checked_request_type(512) is checked and issubclass(checked, EngineCoreRequest)
    assert msgspec.structs.fields(checked) != msgspec.structs.fields(EngineCoreRequest)
    assert [f.name for f in msgspec.structs.fields(checked)] == list(
        EngineCoreRequest.__struct_fields__)
    enc = Encoder()
    ok = EngineCoreRequest("r", [0, 5, 511], SamplingParams(max_tokens=2), 1.5)
    kind, got = decode_input(encode_input(enc, RequestType.ADD, ok), vocab_size=512)
    assert kind is RequestType.ADD and type(got) is checked
    assert msgspec.structs.asdict(got) == msgspec.structs.asdict(ok)
    for ids in ([0, 512], [-1, 5]):
        bad = EngineCoreRequest("r", ids)
        _, got = decode_input(encode_input(enc, RequestType.ADD, bad), vocab_size=512)
        assert type(got) is EngineCoreRequest and got == bad, ids
    malformed = _msg(RequestType.ADD.value, enc.encode(["r", [1, "x"]]))
    with pytest.raises(ProtocolError) as plain:
        decode_input(malformed)
    with pytest.raises(ProtocolError) as vocab:
        decode_input(malformed, vocab_size=512)
    assert str(vocab.value) == str(plain.value)
    # Only an ADD has token ids; other messages decode as they always do.
    assert decode_input(encode_input(enc, RequestType.ABORT, ["a"]), vocab_size=512) == (
        RequestType.ABORT, ["a"])
    with pytest.raises(TypeError, match="EngineCoreRequest only"):
        Decoder(UtilityRequest, vocab_size=512)
    with pytest.raises(ValueError, match="vocab_size=0"):
        codec.checked_request_type(0)


def test_module_level_decoders_are_safe_across_threads() -> None:
    msgs = [
        EngineCoreOutputs(i, [EngineCoreOutput(str(i), [i])], utility_output=UtilityOutput(
            i, None, torch.full((100,), i, dtype=torch.int64)))
        for i in range(8)
    ]  # fmt: skip
    encoded = [Encoder().encode(m) for m in msgs]
    bad: list[int] = []

    def work(k: int) -> None:
        for r in range(300):
            i = (k + r) % len(msgs)
            got = decode_outputs(encoded[i])
            assert got.utility_output is not None
            if got.outputs != msgs[i].outputs or int(got.utility_output.result[99]) != i:
                bad.append(i)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads) and bad == []


def test_peek_request_id_salvages_the_id_of_a_bad_add() -> None:
    bad = msgspec.msgpack.encode(["req-7", "not a token list"])
    with pytest.raises(ProtocolError):
        decode_input(_msg(b"\x00", [bad]))
    assert peek_request_id([bad]) == "req-7"
    assert peek_request_id([b"\xc1"]) is None
    assert peek_request_id([msgspec.msgpack.encode([5])]) is None


def test_dead_sentinel() -> None:
    assert is_dead_sentinel([ENGINE_DEAD_SENTINEL])
    assert is_dead_sentinel(ENGINE_DEAD_SENTINEL)
    assert is_dead_sentinel([zmq.Frame(ENGINE_DEAD_SENTINEL)])
    assert not is_dead_sentinel([ENGINE_DEAD_SENTINEL, b""])
    assert not is_dead_sentinel(Encoder().encode(EngineCoreOutputs()))
    with pytest.raises(ProtocolError, match="sentinel"):
        decode_outputs([ENGINE_DEAD_SENTINEL])


# --- versioning --------------------------------------------------------------------------


def test_ready_handshake_refuses_another_protocol_version() -> None:
    ok = ReadyResponse(PROTOCOL_VERSION, 0, 100, 16, 2048, "tiny", "cpu")
    check_ready(ok)
    assert decode_ready(Encoder().encode(ok)) == ok
    old = msgspec.structs.replace(ok, protocol_version=PROTOCOL_VERSION + 1)
    with pytest.raises(
        ProtocolError, match=rf"version {PROTOCOL_VERSION + 1}.*version {PROTOCOL_VERSION}"
    ):
        check_ready(old)
    # A future peer whose ReadyResponse changed shape still gets the version message.
    future = msgspec.msgpack.encode([PROTOCOL_VERSION + 5, {"shape": "changed"}])
    with pytest.raises(ProtocolError, match=f"version {PROTOCOL_VERSION + 5}"):
        decode_ready([future])


# --- utility results ---------------------------------------------------------------------


class Stats(msgspec.Struct, frozen=True):
    name: str
    counts: list[int]
    weights: Any = None


register_result_type(Stats)


def _through_wire(out: UtilityOutput) -> UtilityOutput:
    frames = Encoder().encode(EngineCoreOutputs(utility_output=out))
    got = decode_outputs(frames).utility_output
    assert got is not None
    return got


def test_registered_struct_results_come_back_typed() -> None:
    result = [Stats("a", [1, 2], torch.arange(100.0)), {"k": Stats("b", [])}, 3]
    reply = _through_wire(utility_output(4, "get_stats", result=result))
    assert reply.failure_message is None and isinstance(reply.result[0], StructResult)
    rebuilt = decode_utility_result(reply.result)
    assert isinstance(rebuilt, list)
    assert rebuilt[0].name == "a" and rebuilt[0].counts == [1, 2]
    assert torch.equal(rebuilt[0].weights, torch.arange(100.0))
    assert rebuilt[1] == {"k": Stats("b", [])} and rebuilt[2] == 3
    # In process (no wire) the same helper unwraps.
    assert decode_utility_result(utility_output(4, "m", result=Stats("c", [])).result) == Stats(
        "c", []
    )


def test_results_of_scalars_are_not_walked() -> None:
    """Big results are handed back as decoded (no per-element rebuild on the event loop);
    a Struct deeper down is still rebuilt."""
    flat, table = list(range(100_000)), {str(i): i for i in range(1000)}
    assert decode_utility_result(flat) is flat and decode_utility_result(table) is table
    nested = [[1, "x", None], {"s": StructResult(_name(Stats), {"name": "n", "counts": []})}]
    assert decode_utility_result(nested) == [[1, "x", None], {"s": Stats("n", [])}]


def _name(cls: type) -> str:
    reply = _through_wire(utility_output(1, "m", result=cls("n", [])))
    assert isinstance(reply.result, StructResult)
    return reply.result.name


def test_unregistered_tag_on_the_client_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="register_result_type"):
        decode_utility_result(StructResult("nope.Missing", {}))


def test_register_result_type_refuses_name_clash_and_non_structs() -> None:
    class Other(msgspec.Struct):
        x: int

    with pytest.raises(ValueError, match="already registered"):
        register_result_type(Other, name=f"{Stats.__module__}.{Stats.__qualname__}")
    with pytest.raises(TypeError):
        register_result_type(dict)


class _Unsendable:
    pass


@pytest.mark.parametrize(
    "result",
    [_Unsendable(), [1, {"x": _Unsendable()}], lambda: 1, np.array([None]), {1, _Unsendable}],
    ids=["object", "nested", "lambda", "object-array", "set-with-class"],
)
def test_unsendable_result_becomes_a_failure_naming_method_and_type(result: object) -> None:
    reply = utility_output(9, "collective_rpc", result=result)
    assert reply.call_id == 9 and reply.result is None
    assert reply.failure_message is not None
    assert "collective_rpc" in reply.failure_message
    assert type(result).__qualname__ in reply.failure_message
    _through_wire(reply)  # and the failure itself is sendable


def test_utility_output_error_and_plain_results() -> None:
    assert (
        utility_output(1, "m", error=RuntimeError("boom")).failure_message == "RuntimeError: boom"
    )
    assert utility_output(1, "m", error="custom").failure_message == "custom"
    reply = _through_wire(utility_output(2, "m", result={"a": [1, 2.5, "x", None]}))
    assert reply == UtilityOutput(2, None, {"a": [1, 2.5, "x", None]})


def test_utility_probe_checks_tensors_without_touching_their_data() -> None:
    t = torch.zeros(4096, 4096, dtype=torch.uint8).t()  # non-contiguous: encoding copies
    a = np.zeros((2048, 2048))[:, ::2]
    with mock.patch.object(codec, "tensor_bytes", side_effect=AssertionError("copied")):
        with mock.patch.object(codec, "numpy_bytes", side_effect=AssertionError("copied")):
            reply = utility_output(1, "m", result=[t, a])
    assert reply.failure_message is None and reply.result[0] is t and reply.result[1] is a
    bad = utility_output(1, "m", result=torch.eye(2).to_sparse())
    assert bad.failure_message is not None and "layout" in bad.failure_message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_copied_to_the_host_and_round_trip() -> None:
    t = torch.randn(1000, 33, device="cuda", dtype=torch.bfloat16)[:, 1:]
    got, n_aux = _round_trip(t)
    assert n_aux == 1 and got.device.type == "cpu"
    assert torch.equal(got, t.cpu())


# --- encoding into a caller's buffer; bounds ---------------------------------------------


def test_encode_into_writes_the_callers_buffer() -> None:
    buf = bytearray(b"stale" * 100)
    msg = EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1])])
    frames = Encoder().encode_into(msg, buf)
    assert frames[0] is buf and bytes(buf) == Encoder().encode(msg)[0]
    assert decode_outputs(frames) == msg



@pytest.mark.parametrize("field", ["max_frame_bytes", "max_frames", "max_prompt_tokens",
                                   "max_batch"])
@pytest.mark.parametrize("value", [0, -1, "8", True, 1.5, 1 << 62])
def test_limits_refuse_bounds_that_would_refuse_everything_or_nothing(
        field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"Limits.{field}="):
        Limits(**{field: value})


def test_an_integer_past_64_bits_is_a_value_error_naming_the_range() -> None:
    for big in (1 << 64, -(1 << 63) - 1):
        with pytest.raises(ValueError, match="64-bit"):
            Encoder().encode(UtilityRequest(0, 1, "echo", [big]))
        with pytest.raises(ValueError, match="64-bit"):
            Encoder().encode_into(UtilityRequest(0, 1, "echo", [big]), bytearray())


def test_a_utility_call_payload_has_its_own_bound_against_decode_amplification() -> None:
    """Untyped arguments: N empty maps cost N bytes on the wire and ~70 N once decoded, so a
    call's msgpack payload is bounded on its own (arrays go as aux frames, outside it)."""
    import tracemalloc

    limits = Limits(max_call_bytes=64 * 1024)
    n = 200_000
    payload = msgspec.msgpack.encode(UtilityRequest(0, 1, "echo", [[{}] * 10]))
    body = b"\x94\x00\x01\xa4echo\xdd" + n.to_bytes(4, "big") + b"\x80" * n
    for frames in ([body], [RequestType.UTILITY.value + body]):
        tracemalloc.start()
        try:
            with pytest.raises(ProtocolError, match="max_call_bytes"):
                if len(frames[0]) == len(body):
                    Decoder(UtilityRequest, limits).decode(frames)
                else:
                    decode_input(frames, limits)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 * n, f"refused only after allocating {peak} bytes"
    with pytest.raises(ProtocolError, match="max_call_bytes"):
        Decoder(UtilityRequest, limits).decode_payload(body)
    assert Decoder(UtilityRequest, limits).decode(payload).method == "echo"
    # The sender refuses it first, naming the bound, and says where large data goes.
    frames = encode_input(Encoder(), RequestType.UTILITY, UtilityRequest(0, 1, "echo",
                                                                          ["x" * 100_000]))
    with pytest.raises(ValueError, match=r"max_call_bytes=65536.*arrays"):
        check_sendable(RequestType.UTILITY, frames, limits)
    check_sendable(RequestType.ADD, frames, limits)  # other messages: the frame bound only


@pytest.mark.parametrize("frames", [[], None, [None], 5, [b""], ()])
def test_client_side_decoders_raise_only_protocol_errors(frames: Any) -> None:
    for decode in (decode_ready, decode_outputs):
        with pytest.raises(ProtocolError):
            decode(frames)
    assert is_dead_sentinel(frames) is False


# --- hostile payloads a peer with a valid key can send (red-team audit) ------------------------

_MAPS = 4_000_000  # empty maps: 1 byte each on the wire, ~64 bytes each decoded untyped


def _peak_bytes(fn: Any) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _array_of_maps(n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n


def test_salvaging_ids_of_refused_messages_never_decodes_them_whole() -> None:
    from enginewire.protocol.codec import peek_call_id, peek_request_id

    call = b"\x94\x00\x07" + msgspec.msgpack.encode("echo") + _array_of_maps(_MAPS)
    add = b"\x92" + msgspec.msgpack.encode("rid") + _array_of_maps(_MAPS)
    assert peek_call_id([call]) == 7 and peek_request_id([add]) == "rid"
    assert _peak_bytes(lambda: peek_call_id([call])) < 1 << 20
    assert _peak_bytes(lambda: peek_request_id([add])) < 1 << 20
    assert peek_call_id([b"\x92\x00\xc3"]) is None  # a bool is not a call id


def test_a_large_add_whose_tensors_are_not_arrays_is_refused_before_decoding() -> None:
    payload = (b"\x96" + msgspec.msgpack.encode("r") + b"\x91\x01\x90" + b"\xcb" + bytes(8)
               + b"\x00" + b"\x81\xa1x" + _array_of_maps(_MAPS))

    def decode() -> None:
        with pytest.raises(ProtocolError, match="tensors to map names to arrays"):
            decode_input([RequestType.ADD.value + payload])

    assert _peak_bytes(decode) < 3 * len(payload)  # the frame copy, not 64 bytes per map
    # A large legitimate ADD (a long prompt, arrays in tensors) decodes as before.
    req = EngineCoreRequest("big", list(range(300_000)),
                            tensors={"e": torch.ones(3), "n": np.zeros(2)})
    _, got = decode_input(encode_input(Encoder(), RequestType.ADD, req))
    assert isinstance(got, EngineCoreRequest) and len(got.prompt_token_ids) == 300_000
    assert got.tensors is not None and torch.equal(got.tensors["e"], torch.ones(3))


def test_a_ready_frame_is_not_decoded_untyped() -> None:
    from enginewire.protocol.codec import decode_ready

    frame = b"\x92\x01" + _array_of_maps(_MAPS)

    def decode() -> None:
        with pytest.raises(ProtocolError):
            decode_ready(frame)

    assert _peak_bytes(decode) < 1 << 20


def test_a_message_of_exactly_max_frames_frames_decodes_one_more_is_refused() -> None:
    """max_frames is inclusive: an ADD whose tensors fill the bound exactly must reach the
    engine; the engine's frame count bound is the one thing between a peer and N frames."""
    req = EngineCoreRequest("r", [1, 2], tensors={"a": np.zeros(512, np.float32),
                                                  "b": np.ones(512, np.float32)})
    frames = encode_input(Encoder(), RequestType.ADD, req)
    n = len(frames)
    assert n == 3  # the payload and one aux frame per tensor
    kind, obj = decode_input(frames, Limits(max_frames=n))
    assert kind is RequestType.ADD and np.array_equal(obj.tensors["b"], req.tensors["b"])
    with pytest.raises(ProtocolError, match=f"at most {n - 1} frames, got {n}"):
        decode_input(frames, Limits(max_frames=n - 1))


def test_sender_and_engine_agree_at_exactly_max_call_bytes() -> None:
    """The client's check_sendable must refuse exactly what the engine's decoder refuses: a call
    of max_call_bytes (the type byte not counted) passes both, one byte over fails both."""
    frames = encode_input(Encoder(), RequestType.UTILITY,
                          UtilityRequest(0, 1, "echo", ["x" * 1000]))
    payload = len(frames[0]) - 1  # the msgpack payload behind the type byte
    at = Limits(max_call_bytes=payload)
    check_sendable(RequestType.UTILITY, frames, at)
    assert decode_input(frames, at)[1].args == ["x" * 1000]
    under = Limits(max_call_bytes=payload - 1)
    with pytest.raises(ValueError, match=f"payload of {payload} bytes"):
        check_sendable(RequestType.UTILITY, frames, under)
    with pytest.raises(ProtocolError, match="max_call_bytes"):
        decode_input(frames, under)


def test_checked_bounds_what_the_unchecked_decode_let_through() -> None:
    """``Decoder.checked`` gives what ``decode_payload`` gives for a payload already decoded
    by ``decode_unchecked``: the same batch, the same refusals, without decoding it twice."""
    dec = Decoder(EngineCoreOutputs)
    ok = msgspec.msgpack.encode(EngineCoreOutputs(stream_ids=["a", "b"], stream_tokens=[1, 2]))
    assert dec.checked(ok, dec.decode_unchecked(ok)) == dec.decode_payload(ok)
    uneven = msgspec.msgpack.encode(EngineCoreOutputs(stream_ids=["a", "b"], stream_tokens=[1]))
    obj = dec.decode_unchecked(uneven)  # msgspec alone takes it
    with pytest.raises(ProtocolError, match="as many stream tokens as stream ids"):
        dec.checked(uneven, obj)
    small = Decoder(EngineCoreOutputs, Limits(max_batch=3))
    over = msgspec.msgpack.encode(EngineCoreOutputs(
        outputs=[EngineCoreOutput("r", [1])] * 4))
    with pytest.raises(ProtocolError, match="at most 3"):
        small.checked(over, small.decode_unchecked(over))
