"""`enginewire engine` start-up: a missing front end is named in one line with its deadline."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from enginewire.cli import main
from enginewire.runtime import engine_proc, security


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_no_front_end_names_the_address_and_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # A CURVE engine queues its handshake only on an authenticated connection, so with
    # nobody listening it gives up at the deadline (shortened here from 30 s).
    monkeypatch.setattr(engine_proc, "HANDSHAKE_SEND_S", 0.3)
    front = security.load_or_create_keypair(tmp_path / "front.key_secret")
    inp = f"tcp://127.0.0.1:{_free_port()}"
    rc = main(["engine", "--model", "null", "--input-address", inp, "--output-address",
               f"tcp://127.0.0.1:{_free_port()}", "--curve-key",
               str(tmp_path / "engine.key_secret"), "--curve-peer", front.public.decode()])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 3, err
    assert len(lines) == 1 and inp in lines[0] and "0.3 s" in lines[0], err
