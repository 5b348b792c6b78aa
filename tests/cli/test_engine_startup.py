"""`enginewire engine` start-up: a missing front end and several front-end keys."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from enginewire.cli import main
from enginewire.runtime import engine_proc, make_client, security
from enginewire.runtime.config import EngineConfig

BOUND_S = 60.0


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


def test_curve_server_key_picks_the_front_end_among_several_peers(tmp_path: Path) -> None:
    peers = tmp_path / "peers"
    peers.mkdir()
    front = security.load_or_create_keypair(peers / "front.key_secret")
    security.load_or_create_keypair(peers / "other.key_secret")
    engine_pair = security.load_or_create_keypair(tmp_path / "engine.key_secret")
    inp = f"tcp://127.0.0.1:{_free_port()}"
    out = f"tcp://127.0.0.1:{_free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "enginewire.cli", "engine", "--model", "null",
         "--input-address", inp, "--output-address", out,
         "--curve-key", str(tmp_path / "engine.key_secret"), "--curve-peer", str(peers),
         "--curve-server-key", str(peers / "front.key")],
    )
    try:
        curve = security.CurveConfig(front, frozenset({engine_pair.public}))
        client = make_client(EngineConfig(model="null"), multiprocess=True, asyncio=False,
                             launch_engine=False, input_address=inp, output_address=out,
                             curve=curve, ready_timeout_s=BOUND_S)
        with client:
            assert client.call_utility("echo", "two peers", timeout=BOUND_S) == "two peers"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(BOUND_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(BOUND_S)
