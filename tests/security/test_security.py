"""runtime/security.py without an engine: key files, allow-lists, the ZAP handler and the
monitors against raw sockets, the tcp policy, ipc permissions, stale directories, no pickle."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from enginewire.runtime import security
from enginewire.runtime.ipc import IpcDir, cleanup_stale_dirs
from enginewire.runtime.security import (
    CurveConfig,
    KeyPair,
    TransportGuard,
    check_transport,
    curve_from_options,
    generate_keypair,
    load_or_create_keypair,
    load_public_keys,
    local_engine_pair,
    restrict_ipc_socket,
)

BOUND_S = 10.0
ROOT = Path(__file__).resolve().parents[2]


# --- keys --------------------------------------------------------------------------------------


def test_key_file_created_private_then_reloaded(tmp_path: Path) -> None:
    path = tmp_path / "client.key_secret"
    pair = load_or_create_keypair(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    public_file = tmp_path / "client.key"
    assert b"secret-key" not in public_file.read_bytes()
    assert load_or_create_keypair(path) == pair  # loaded, not regenerated
    assert load_public_keys([public_file]) == {pair.public}
    assert load_public_keys([tmp_path]) == {pair.public}  # a directory of *.key files
    assert load_public_keys([pair.public.decode()]) == {pair.public}
    assert pair.secret.decode() not in repr(pair)


def test_key_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "engine.key_secret"
    load_or_create_keypair(path)
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        load_or_create_keypair(path)
    with pytest.raises(PermissionError):
        CurveConfig.from_files(path, [generate_keypair().public])


def test_missing_key_file_without_create(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_or_create_keypair(tmp_path / "none.key_secret", create=False)


def test_bad_keys_are_refused() -> None:
    good = generate_keypair()
    with pytest.raises(ValueError):
        KeyPair(good.public, generate_keypair().secret)  # not this secret's public key
    with pytest.raises(ValueError):
        load_public_keys([b"~" * 40])  # not Z85
    with pytest.raises(ValueError):
        CurveConfig(good, frozenset())
    with pytest.raises(ValueError):
        CurveConfig(good, frozenset({generate_keypair().public}), server_key=good.public)
    two = CurveConfig(good, frozenset({generate_keypair().public, generate_keypair().public}))
    with pytest.raises(ValueError, match="server_key"):
        two.remote_server_key()


def test_curve_from_options_for_command_lines(tmp_path: Path) -> None:
    assert curve_from_options(None, []) is None
    with pytest.raises(ValueError, match="both"):
        curve_from_options(tmp_path / "e.key_secret", [])
    peer = load_or_create_keypair(tmp_path / "client.key_secret")
    curve = curve_from_options(tmp_path / "engine.key_secret", [str(tmp_path / "client.key")])
    assert curve is not None and curve.remote_server_key() == peer.public


def test_local_engine_pair_admits_each_other() -> None:
    client, engine = local_engine_pair()
    assert engine.keypair.public in client.peer_keys
    assert engine.remote_server_key() == client.keypair.public


# --- tcp policy and ipc permissions ---------------------------------------------------------


def test_plain_tcp_refused_unless_allowed(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="allow_insecure_tcp"):
        check_transport(["tcp://127.0.0.1:5555"], None, False)
    with caplog.at_level(logging.WARNING, "enginewire.runtime.security"):
        check_transport(["tcp://127.0.0.1:5555"], None, True)
    assert "INSECURE" in caplog.text
    check_transport(["ipc:///tmp/x"], None, False)  # ipc relies on its private directory
    check_transport(["tcp://127.0.0.1:5555"], local_engine_pair()[0], False)


def test_ipc_dir_and_socket_files_are_private(tmp_path: Path) -> None:
    d = IpcDir(tmp_path)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.bind(d.address("input"))
        restrict_ipc_socket(d.address("input"))
        st_dir, st_sock = d.path.stat(), (d.path / "input").stat()
        assert stat.S_IMODE(st_dir.st_mode) == 0o700 and st_dir.st_uid == os.getuid()
        assert stat.S_ISSOCK(st_sock.st_mode)
        assert stat.S_IMODE(st_sock.st_mode) & 0o077 == 0
    finally:
        sock.close(linger=0)
        ctx.term()
        d.remove()
    assert not d.path.exists()


@pytest.fixture
def short_root() -> Iterator[Path]:
    # pytest's tmp_path can be too deep for sun_path (IpcDir would fall back to /tmp).
    root = Path(tempfile.mkdtemp(prefix="ewsec", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_stale_dir_of_sigkilled_owner_is_cleaned_never_reused(short_root: Path) -> None:
    tmp_path = short_root
    code = ("import os, signal, sys; from pathlib import Path;"
            "from enginewire.runtime.ipc import IpcDir;"
            "d = IpcDir(Path(sys.argv[1])); (d.path / 'input').touch();"
            "print(d.path, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL
    stale = Path(done.stdout.strip())
    assert stale.exists()  # SIGKILL left it behind
    # A symlink with an owner-less name is never followed nor removed.
    target = tmp_path / "precious"
    target.mkdir()
    link = tmp_path / "enginewire-999999999-1-beef"
    link.symlink_to(target)
    mine = IpcDir(tmp_path)
    try:
        assert not stale.exists() and mine.path != stale
        assert link.is_symlink() and target.exists()
        assert cleanup_stale_dirs(tmp_path) == []  # a live owner's directory stays
        assert mine.path.exists()
    finally:
        mine.remove()


# --- CURVE at the socket layer --------------------------------------------------------------


class Listener:
    """A client-side ROUTER guarded like MPClient's, on loopback tcp."""

    def __init__(self, curve: CurveConfig) -> None:
        self.ctx = zmq.Context()
        self.guard = TransportGuard(self.ctx, curve, side="client")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.guard.serve(self.router, "input")
        self.router.bind("tcp://127.0.0.1:*")
        self.address = self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        self.router.close(linger=0)
        self.guard.close()
        self.ctx.term()


@pytest.fixture
def keys() -> tuple[CurveConfig, CurveConfig]:
    return local_engine_pair()


@pytest.fixture
def listener(keys: tuple[CurveConfig, CurveConfig]) -> Iterator[Listener]:
    lis = Listener(keys[0])
    try:
        yield lis
    finally:
        lis.close()


def _dealer(ctx: zmq.Context[Any], address: str, pair: KeyPair | None = None,
            server: bytes | None = None) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if pair is not None:
        sock.curve_secretkey = pair.secret
        sock.curve_publickey = pair.public
        sock.curve_serverkey = server
    sock.connect(address)
    return sock


def _wait_refusals(guard: TransportGuard, n: int) -> None:
    deadline = time.monotonic() + BOUND_S
    while guard.refusal_count < n:
        assert time.monotonic() < deadline, f"refusals so far: {list(guard.refusals)}"
        time.sleep(0.02)


@pytest.mark.parametrize("who", ["no_curve", "unknown_key", "wrong_server_key"])
def test_peer_without_the_right_key_is_refused_and_logged(
    who: str, listener: Listener, keys: tuple[CurveConfig, CurveConfig],
    caplog: pytest.LogCaptureFixture,
) -> None:
    client_curve, engine_curve = keys
    ctx = zmq.Context()
    try:
        with caplog.at_level(logging.WARNING, "enginewire.runtime.security"):
            if who == "no_curve":
                bad = _dealer(ctx, listener.address)
            elif who == "unknown_key":
                bad = _dealer(ctx, listener.address, generate_keypair(),
                              client_curve.keypair.public)
            else:
                bad = _dealer(ctx, listener.address, engine_curve.keypair,
                              generate_keypair().public)
            with contextlib.suppress(zmq.Again):  # never connected: nothing to send to
                bad.send(b"let me in", zmq.NOBLOCK)
            _wait_refusals(listener.guard, 1)
        assert "refused a peer" in caplog.text
        assert "errno" not in caplog.text  # a protocol-error code is named, not an errno
        if who == "unknown_key":  # with the peer's address, so it can be traced
            assert "from 127.0.0.1 is not on the allow-list" in caplog.text
        good = _dealer(ctx, listener.address, engine_curve.keypair,
                       engine_curve.remote_server_key())
        good.send(b"engine")
        assert listener.router.poll(int(BOUND_S * 1000))
        _identity, body = listener.router.recv_multipart()
        assert body == b"engine"  # only the admitted peer's frame ever arrives
        assert not listener.router.poll(200)
    finally:
        ctx.destroy(linger=0)


def test_half_open_connections_are_dropped_at_the_handshake_deadline(
    keys: tuple[CurveConfig, CurveConfig], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection that never handshakes holds a file descriptor until libzmq's deadline
    (30 s by default): a scanner's idle connections exhausted the front end's fds."""
    assert security.HANDSHAKE_DEADLINE_MS < 30_000
    monkeypatch.setattr(security, "HANDSHAKE_DEADLINE_MS", 300)
    lis = Listener(keys[0])
    try:
        host, port = lis.address.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=BOUND_S) as idle:
            idle.settimeout(BOUND_S)
            t0 = time.monotonic()
            while idle.recv(4096):  # the server's greeting, then EOF when it drops us
                pass
            assert time.monotonic() - t0 < 5.0
    finally:
        lis.close()


def test_guard_threads_do_not_outlive_close(keys: tuple[CurveConfig, CurveConfig]) -> None:
    lis = Listener(keys[0])
    assert any(t.name.startswith("EngineWireMonitor") for t in threading.enumerate())
    lis.close()
    names = [t.name for t in threading.enumerate()]
    assert not [n for n in names if n.startswith("EngineWireMonitor")], names


# --- no code from the wire ------------------------------------------------------------------

_FORBIDDEN = re.compile(
    r"^\s*(import|from)\s+(pickle|cPickle|_pickle|cloudpickle|dill|marshal|shelve)\b"
    r"|\b(pickle|cloudpickle|marshal)\.(loads?|dumps?)\(|\beval\(|\bexec\(",
    re.MULTILINE,
)


def test_no_pickle_marshal_or_eval_in_the_wire_layers() -> None:
    hits = []
    for layer in ("protocol", "runtime", "spec"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            for m in _FORBIDDEN.finditer(path.read_text()):
                hits.append(f"{path.relative_to(ROOT)}: {m.group(0).strip()}")
    assert not hits, hits


def test_public_key_file_is_0644_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        load_or_create_keypair(tmp_path / "e.key_secret")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "e.key").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "e.key_secret").stat().st_mode) == 0o600


def test_a_dangling_link_as_key_file_is_named(tmp_path: Path) -> None:
    link = tmp_path / "gone.key_secret"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="symbolic link to nothing"):
        load_or_create_keypair(link)


def test_refusal_log_memory_is_bounded() -> None:
    ctx = zmq.Context()
    try:
        guard = TransportGuard(ctx, None, side="test")
        for i in range(1000):  # a scanner with a fresh key each time: one log key
            guard._refused(f"CURVE public key K{i} is not on the allow-list",
                           log_key="allow-list")
        assert guard.refusal_count == 1000 and len(guard._last_logged) == 1
        for i in range(2000):
            guard._warn_once(f"dropped input tcp://10.0.0.{i}", "%s", i)
        assert len(guard._last_logged) <= 256
        guard.close()
    finally:
        ctx.term()


def test_a_link_at_the_public_key_place_leaves_no_half_made_pair(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("not a key")
    (tmp_path / "n.key").symlink_to(target)
    for _ in range(2):  # the second call used to succeed silently, without a public key
        with pytest.raises(ValueError, match="public key's place"):
            load_or_create_keypair(tmp_path / "n.key_secret")
    assert not (tmp_path / "n.key_secret").exists() and target.read_text() == "not a key"


def test_a_key_in_a_directory_that_does_not_exist_yet_is_created(tmp_path: Path) -> None:
    secret = tmp_path / "home" / ".config" / "enginewire" / "client.key_secret"
    pair = load_or_create_keypair(secret)
    assert secret.stat().st_mode & 0o777 == 0o600
    assert secret.parent.stat().st_mode & 0o777 == 0o700
    assert load_or_create_keypair(secret) == pair


def test_a_fifo_at_the_secret_key_place_is_refused_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "f.key_secret"
    os.mkfifo(fifo, 0o600)  # reading it would block for good
    with pytest.raises(ValueError, match="not a regular file"):
        load_or_create_keypair(fifo)


@pytest.mark.parametrize("mode", [0o640, 0o620, 0o604, 0o700])
def test_a_secret_key_open_to_the_group_or_others_is_refused(tmp_path: Path, mode: int) -> None:
    """Any group or other bit on the secret (not only world-readable) gives its CURVE identity
    to another account: refused, naming the fix, never loaded."""
    path = tmp_path / "g.key_secret"
    load_or_create_keypair(path)
    os.chmod(path, mode)
    if mode & 0o077:
        with pytest.raises(PermissionError, match="chmod 600"):
            load_or_create_keypair(path)
    else:  # owner-only bits (here execute) do not widen who can read it
        assert load_or_create_keypair(path).public


def test_a_secret_key_owned_by_another_user_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key file another account owns (and so can read or replace) is not ours to trust."""
    path = tmp_path / "o.key_secret"
    load_or_create_keypair(path)
    if os.geteuid() == 0:
        os.chown(path, 4242, 4242)  # really someone else's file
    else:  # cannot give a file away: look at it as another uid would
        monkeypatch.setattr(security.os, "getuid", lambda: path.stat().st_uid + 1)
    with pytest.raises(PermissionError, match="must belong to uid"):
        load_or_create_keypair(path)


@pytest.mark.parametrize("half", ["public", "secret"])
def test_a_failed_key_write_leaves_neither_half_of_the_pair(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, half: str) -> None:
    """Disk full while writing either file of a new pair. A lone or empty secret would be
    loaded next time (and fail there, naming no cause) and the public key peers need never
    written; an empty public file would be copied to peers as a key. Nothing may remain, and
    the next try makes a whole pair."""
    real = security._certificate

    def failing(kind: str, public: bytes, secret: bytes | None) -> bytes:
        if (secret is None) == (half == "public"):
            raise OSError(28, "No space left on device")
        cert: bytes = real(kind, public, secret)
        return cert

    secret = tmp_path / "h.key_secret"
    monkeypatch.setattr(security, "_certificate", failing)
    with pytest.raises(OSError, match="No space left"):
        load_or_create_keypair(secret)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.setattr(security, "_certificate", real)
    pair = load_or_create_keypair(secret)
    assert load_public_keys([tmp_path / "h.key"]) == {pair.public}
