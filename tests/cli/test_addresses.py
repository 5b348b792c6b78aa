"""`enginewire engine` checks its addresses as text: nothing connects before the engine does."""

from __future__ import annotations

import select
import socket

import pytest

from enginewire.cli import UsageError, _check_address


def test_checking_a_tcp_address_opens_no_connection() -> None:
    # A trial connect reached the front end, whose CURVE handshake then logged a refused peer
    # per address per engine start; a plain listener sees the same connection attempt.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        _check_address("--input-address", f"tcp://127.0.0.1:{port}")
        readable, _, _ = select.select([listener], [], [], 0.5)
        assert readable == [], "checking the address connected to it"


@pytest.mark.parametrize("address", [
    "tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:65535", "tcp://eth0:5555",
    "tcp://my-host.example_1:80", "tcp://127.0.0.1;10.0.0.1:5555", "ipc:///tmp/engine-in",
    "ipc://@abstract-name", "ipc://relative/path",
])
def test_forms_libzmq_connects_to_are_accepted(address: str) -> None:
    _check_address("--input-address", address)


@pytest.mark.parametrize(("address", "why"), [
    ("tcp://127.0.0.1", "tcp://HOST:PORT"),
    ("tcp://:5555", "tcp://HOST:PORT"),
    ("tcp://*:5555", "tcp://HOST:PORT"),  # bind-only wildcard
    ("tcp://h:0", "port in [1, 65535]"),
    ("tcp://h:65536", "port in [1, 65535]"),
    ("tcp://h:abc", "port in [1, 65535]"),
    ("tcp://no such host:5555", "tcp://HOST:PORT"),
    ("tcp://127.0.0.1:5555 ", "tcp://HOST:PORT"),
    ("ipc://", "the path is empty"),
    ("ipc:///tmp/" + "x" * 120, "unix socket path"),
    ("inproc://engine", "tcp://HOST:PORT or ipc://PATH"),  # another process cannot reach it
    ("udp://h:1", "tcp://HOST:PORT or ipc://PATH"),
])
def test_malformed_addresses_are_usage_errors(address: str, why: str) -> None:
    with pytest.raises(UsageError, match="--output-address") as info:
        _check_address("--output-address", address)
    assert why in str(info.value)
