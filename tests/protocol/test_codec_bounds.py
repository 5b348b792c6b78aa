"""Every list field has a bound, enforced from the msgpack headers before the list exists;
msgpack nested too deeply is a ProtocolError, and its request id is still read."""

from __future__ import annotations

import msgspec
import pytest

from enginewire.protocol.codec import Limits, decode_input, decode_outputs, peek_request_id
from enginewire.protocol.messages import RequestType
from enginewire.spec import ProtocolError

SMALL = Limits(max_call_bytes=1024, max_prompt_tokens=100, max_stop_tokens=10, max_batch=50)


def _arr(n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big")


def test_a_long_prompt_is_refused_from_its_header() -> None:
    n = 5000  # a payload over max_call_bytes: screened before the decode
    payload = b"\x93" + msgspec.msgpack.encode("r") + _arr(n) + b"\x01" * n + b"\x90"
    with pytest.raises(ProtocolError, match=r"at most 100 prompt tokens.*headers"):
        decode_input([RequestType.ADD.value + payload], SMALL)


def test_stop_ids_have_a_bound_small_payload_or_large() -> None:
    for n in (20, 5000):
        sp = b"\x96\x04\x00\x00\x00\xc0" + _arr(n) + b"\x01" * n
        payload = b"\x93" + msgspec.msgpack.encode("r") + b"\x91\x01" + sp
        with pytest.raises(ProtocolError, match="at most 10 stop token ids"):
            decode_input([RequestType.ADD.value + payload], SMALL)


def test_a_long_abort_list_is_refused_from_its_header() -> None:
    with pytest.raises(ProtocolError, match="at most 50 request ids"):
        decode_input([RequestType.ABORT.value + _arr(10**6) + b"\xa1a" * 60], SMALL)


def test_a_large_batch_is_refused_from_its_headers() -> None:
    n = 40_000  # over 64 KiB of payload: screened
    ids = _arr(n) + b"\xa1a" * n
    payload = b"\x97\x00\x90\x00\xc0\xc0\xc0" + ids
    with pytest.raises(ProtocolError, match="at most 50 outputs"):
        decode_outputs([payload], SMALL)


def test_deep_nesting_is_a_protocol_error_and_names_its_request() -> None:
    payload = b"\x93" + msgspec.msgpack.encode("deep") + b"\x91" * (2 << 20) + b"\x01\x90"
    with pytest.raises(ProtocolError, match="nested too deeply"):
        decode_input([RequestType.ADD.value + payload])
    assert peek_request_id([payload]) == "deep"
    out = b"\x92\x00" + b"\x91" * (2 << 20) + b"\x90"
    with pytest.raises(ProtocolError):
        decode_outputs([out])
