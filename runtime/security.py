"""Transport security: CURVE keys and allow-lists, a logging ZAP handler, tcp/ipc checks.

Theory of operation
-------------------
The client *binds* (ROUTER input, PULL output) and engines *connect*, so the binding side is
the CURVE **server** and each engine is a CURVE **client**:

* the front end holds a key pair and an allow-list of engine public keys. Its sockets are
  CURVE servers, and a ZAP handler (pyzmq's ``ThreadAuthenticator`` with a callback) admits
  only listed keys. It is started *before* the sockets bind: a CURVE server without a ZAP
  handler would admit any key.
* an engine holds its own key pair and the front end's public key (its allow-list, usually of
  one). A CURVE client checks the server's key as part of the handshake, so an engine never
  talks to a listener that lacks the front end's secret key.

Refusals are logged, never silent: a key off the allow-list by the ZAP callback, a peer that
speaks no CURVE (or a wrong server key) by a socket monitor that reports failed handshakes.
The monitor of an engine's input socket also reports a connection dropped by ``MAXMSGSIZE``
(a frame over ``Limits.max_frame_bytes``), which libzmq refuses before allocating it.

Key files use the ZeroMQ certificate format (``zmq.auth.load_certificate`` reads them): a
secret certificate ``NAME.key_secret`` (mode 0600, owned by the user, else refused) and a
public one ``NAME.key`` beside it. ``load_or_create_keypair`` makes both on first use.

Plain tcp carries prompts and outputs in clear text to anyone on the path and accepts any
peer: it is refused unless ``allow_insecure_tcp=True``, and then logged as a warning.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

__all__ = [
    "ZAP_DOMAIN",
    "CurveConfig",
    "KeyPair",
    "TransportGuard",
    "check_transport",
    "curve_from_options",
    "generate_keypair",
    "load_or_create_keypair",
    "load_public_keys",
    "local_engine_pair",
    "public_key_file",
    "restrict_ipc_socket",
]

logger = logging.getLogger(__name__)

ZAP_DOMAIN = "enginewire"
_Z85_KEY_LEN = 40  # a 32-byte Curve25519 key in Z85
_MONITOR_POLL_MS = 100
_monitor_ids = itertools.count()
# A refused peer retries every reconnect interval (100 ms): warn once per reason per window.
_LOG_WINDOW_S = 10.0
_MAX_REFUSALS_KEPT = 256

# A bound socket drops a connection that has not completed its handshake by then (libzmq's
# default is 30 s): half-open connections from a scanner hold a file descriptor each, and
# a real peer handshakes in milliseconds.
HANDSHAKE_DEADLINE_MS = 10_000

# What a protocol-error code in a handshake-failed event means (libzmq reports ZMTP codes
# there, not errnos).
_PROTOCOL_ERRORS = {int(getattr(zmq, n)): n.removeprefix("PROTOCOL_ERROR_")
                    for n in dir(zmq) if n.startswith("PROTOCOL_ERROR_")}

# Handshake outcomes worth a warning: each is a peer turned away at the socket layer.
_REFUSAL_EVENTS: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (protocol or mechanism mismatch:"
    " a peer without CURVE, or with the wrong server key)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake refused by authentication (key not allowed)",
}


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair in Z85 (40 ASCII bytes each). The secret never appears in a repr."""

    public: bytes
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        for name in ("public", "secret"):
            key = getattr(self, name)
            if not isinstance(key, bytes) or len(key) != _Z85_KEY_LEN:
                raise ValueError(f"KeyPair.{name} must be a {_Z85_KEY_LEN}-byte Z85 key")
        if zmq.curve_public(self.secret) != self.public:
            raise ValueError("KeyPair.public does not belong to KeyPair.secret")


def generate_keypair() -> KeyPair:
    """A fresh key pair from libsodium (pyzmq's bundled copy)."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    public, secret = zmq.curve_keypair()
    return KeyPair(public, secret)


def _check_private(path: Path) -> None:
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path}: a secret key file must belong to uid {os.getuid()}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(
            f"{path}: a secret key file must not be readable by others"
            f" (mode {stat.S_IMODE(st.st_mode):04o}); run chmod 600 {path}")


def _certificate(kind: str, public: bytes, secret: bytes | None) -> bytes:
    lines = [
        "#   ****  Generated by enginewire  ****",
        f"#   ZeroMQ CURVE {kind} Certificate",
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode("ascii")}"',
    ]
    if secret is not None:
        lines.insert(2, "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.")
        lines.append(f'    secret-key = "{secret.decode("ascii")}"')
    return ("\n".join(lines) + "\n").encode("ascii")


def load_or_create_keypair(secret_file: str | os.PathLike[str], *, create: bool = True) -> KeyPair:
    """Load ``secret_file`` (a ZeroMQ secret certificate, mode 0600), or create it and its
    public twin (same name without ``_secret``, or with ``.key``) when it does not exist."""
    path = Path(secret_file).expanduser()
    if path.is_symlink() and not path.exists():
        raise ValueError(f"{path}: a symbolic link to nothing; point it at a key file or"
                         " remove it")
    if path.exists():
        if not path.is_file():  # a FIFO would block the read for good, a directory fails late
            raise ValueError(f"{path}: not a regular file; a key file is expected here")
        _check_private(path)
        public, secret = zmq.auth.load_certificate(path)
        if secret is None:
            raise ValueError(f"{path}: no secret-key in this certificate (a public key file?)")
        return KeyPair(public, secret)
    if not create:
        raise FileNotFoundError(f"{path}: no such key file")
    pub = public_key_file(path)
    if pub.is_symlink() or (pub.exists() and not pub.is_file()):
        # Checked first: a half-made pair (a secret without its public twin) must not remain.
        raise ValueError(f"{pub}: the public key's place holds a link or a non-file; remove"
                         " it, then create the key pair again")
    # A fresh home has no ~/.config/enginewire yet: made private, like the key.
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    pair = generate_keypair()
    # O_EXCL with mode 0600: never widen or follow an existing file; fchmod undoes umask.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(_certificate("**Secret**", pair.public, pair.secret))
    except BaseException:
        # An empty or partial secret would be loaded next time and fail there, or worse.
        path.unlink(missing_ok=True)
        raise
    opened = False
    try:
        # 0644 whatever the umask: a world-writable public key could be swapped before a
        # peer copies it; never follow a link planted in its place.
        fd = os.open(pub, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        opened = True
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(_certificate("Public", pair.public, None))
    except BaseException:
        path.unlink(missing_ok=True)  # no secret without its public twin
        if opened:  # nor an empty or partial public key file a peer could copy
            pub.unlink(missing_ok=True)
        raise
    logger.info("generated a CURVE key pair in %s (public key %s)", path,
                pair.public.decode("ascii"))
    return pair


def public_key_file(secret_path: Path) -> Path:
    """Where the public twin of a secret key file is written."""
    name = secret_path.name
    if name.endswith(".key_secret"):
        return secret_path.with_name(name.removesuffix("_secret"))
    return secret_path.with_name(name + ".key")


def _one_public_key(src: str | bytes | os.PathLike[str]) -> list[bytes]:
    if isinstance(src, bytes | str) and len(src) == _Z85_KEY_LEN and not Path(
            os.fsdecode(src)).exists():
        key = src.encode("ascii") if isinstance(src, str) else src
        _check_z85(key)
        return [key]
    path = Path(os.fsdecode(src)).expanduser()
    if path.is_dir():
        found = [k for f in sorted(path.glob("*.key")) for k in _one_public_key(f)]
        if not found:
            raise ValueError(f"{path}: no *.key public certificates in this directory")
        return found
    public, _secret = zmq.auth.load_certificate(path)
    _check_z85(public)
    return [public]


def _check_z85(key: bytes) -> None:
    try:
        decoded = zmq.utils.z85.decode(key)
    except Exception:
        decoded = b""
    if len(decoded) != 32:
        raise ValueError(f"not a Z85 CURVE public key: {key[:48]!r}")


def load_public_keys(sources: Iterable[str | bytes | os.PathLike[str]]) -> frozenset[bytes]:
    """An allow-list from Z85 keys, certificate files and directories of ``*.key`` files."""
    keys: set[bytes] = set()
    for src in sources:
        keys.update(_one_public_key(src))
    return frozenset(keys)


@dataclass(frozen=True)
class CurveConfig:
    """One side's CURVE settings: its key pair and the peer public keys it accepts.

    A binding side admits exactly ``peer_keys``. A connecting side authenticates the listener
    by ``server_key``, which defaults to the only key of ``peer_keys``.
    """

    keypair: KeyPair
    peer_keys: frozenset[bytes]
    server_key: bytes | None = None

    def __post_init__(self) -> None:
        if not self.peer_keys:
            raise ValueError("CurveConfig.peer_keys is empty: no peer could ever connect")
        for key in self.peer_keys:
            _check_z85(key)
        if self.server_key is not None and self.server_key not in self.peer_keys:
            raise ValueError("CurveConfig.server_key must be one of CurveConfig.peer_keys")

    @classmethod
    def from_files(
        cls,
        secret_file: str | os.PathLike[str],
        peer_keys: Iterable[str | bytes | os.PathLike[str]],
        *,
        server_key: str | bytes | os.PathLike[str] | None = None,
        create: bool = True,
    ) -> CurveConfig:
        """Own key pair from ``secret_file`` (created on first use); peers from keys/files."""
        server = None if server_key is None else _one_public_key(server_key)[0]
        peers = load_public_keys(peer_keys)
        if server is not None:
            peers = peers | {server}
        return cls(load_or_create_keypair(secret_file, create=create), peers, server)

    def remote_server_key(self) -> bytes:
        if self.server_key is not None:
            return self.server_key
        if len(self.peer_keys) != 1:
            raise ValueError(
                "CurveConfig: a connecting side with several peer keys must name server_key")
        return next(iter(self.peer_keys))

    def with_peer(self, key: bytes) -> CurveConfig:
        return CurveConfig(self.keypair, self.peer_keys | {key}, self.server_key)


def curve_from_options(
    key_file: str | os.PathLike[str] | None, peer_keys: Iterable[str | os.PathLike[str]] = (),
    server_key: str | bytes | os.PathLike[str] | None = None,
) -> CurveConfig | None:
    """For command lines: ``--curve-key FILE`` with ``--curve-peer KEY|FILE|DIR`` (repeatable)
    and, for a connecting side with several peers, ``--curve-server-key``; None when none is
    given."""
    peers = list(peer_keys)
    if key_file is None and not peers and server_key is None:
        return None
    if key_file is None or not peers:
        raise ValueError("CURVE needs both this side's key file and at least one peer key")
    return CurveConfig.from_files(key_file, peers, server_key=server_key)


def local_engine_pair(client: CurveConfig | None = None) -> tuple[CurveConfig, CurveConfig]:
    """``(client, engine)`` configs for an engine the client launches itself: the engine gets
    a fresh key pair (handed over the spawn pipe, never written) that the client admits."""
    engine_pair = generate_keypair()
    if client is None:
        client = CurveConfig(generate_keypair(), frozenset({engine_pair.public}))
    else:
        client = client.with_peer(engine_pair.public)
    engine = CurveConfig(engine_pair, frozenset({client.keypair.public}))
    return client, engine


def _is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def check_transport(
    addresses: Iterable[str], curve: CurveConfig | None, allow_insecure_tcp: bool
) -> None:
    """Refuse plain tcp unless explicitly allowed (then warn). ipc needs no CURVE: its
    directory is private (see ``ipc``)."""
    tcp = [a for a in addresses if _is_tcp(a)]
    if not tcp or curve is not None:
        return
    if not allow_insecure_tcp:
        raise ValueError(
            f"refusing plain tcp at {', '.join(tcp)}: anyone who can reach it can submit work"
            " and read outputs. Pass curve=CurveConfig(...) (see docs/security.md), or"
            " allow_insecure_tcp=True on a network you trust")
    logger.warning("INSECURE: plain tcp without authentication or encryption at %s"
                   " (allow_insecure_tcp=True)", ", ".join(tcp))


def restrict_ipc_socket(address: str) -> None:
    """chmod 0600 a bound ``ipc://`` socket file (defence in depth: its directory is 0700)."""
    if address.startswith("ipc://") and not address.startswith("ipc://@"):
        with contextlib.suppress(OSError):
            os.chmod(address.removeprefix("ipc://"), 0o600)


def _detail(event: int, value: int) -> str:
    """The value of a handshake-failed event, named: a ZMTP protocol-error code, a ZAP
    status code or an errno depending on the event."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return _PROTOCOL_ERRORS.get(int(value), f"protocol error {value:#x}")
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"ZAP status {value}"
    return os.strerror(int(value))


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler, noting each request's peer address for the callback: pyzmq hands
    a CURVE callback only the domain and the key, and a refusal nobody can trace to a host
    is little use. Requests are handled one at a time on the handler's thread."""

    peer_address = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self.peer_address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)


class _AllowList:
    """ZAP callback: admit listed keys; log every refusal (pyzmq logs them at DEBUG only)."""

    def __init__(self, keys: frozenset[bytes], guard: TransportGuard,
                 auth: _Authenticator | None = None) -> None:
        self.keys = keys
        self.guard = guard
        self.auth = auth

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        peer = self.auth.peer_address if self.auth is not None else ""
        # One log key for every unknown key: a scanner with fresh keys must not get a warning
        # (and a remembered entry) per key.
        self.guard._refused(f"CURVE public key {key.decode('ascii', 'replace')}"
                            f"{f' from {peer}' if peer else ''} is not on the allow-list",
                            log_key="allow-list")
        return False


class TransportGuard:
    """Per-context security for one side: CURVE options, the ZAP handler, socket monitors.

    ``close()`` stops the monitors and the authenticator; call it after the guarded sockets
    are closed and before ``ctx.term()``. ``refusals`` records what was turned away.
    """

    def __init__(self, ctx: zmq.Context[Any], curve: CurveConfig | None, *, side: str) -> None:
        self.ctx = ctx
        self.curve = curve
        self.side = side
        self.refusals: deque[str] = deque(maxlen=_MAX_REFUSALS_KEPT)
        self.refusal_count = 0
        self.disconnects = 0
        self._last_logged: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._monitors: list[threading.Thread] = []
        self._auth: ThreadAuthenticator | None = None

    def _refused(self, why: str, log_key: str | None = None) -> None:
        with self._lock:
            self.refusals.append(why)
            self.refusal_count += 1
        self._warn_once(log_key or why, "%s: refused a peer: %s", self.side, why)

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        # Repeats within the window go to DEBUG: a peer retrying every reconnect interval
        # must not flood the log.
        now = time.monotonic()
        with self._lock:
            last = self._last_logged
            loud = now - last.get(key, -_LOG_WINDOW_S) >= _LOG_WINDOW_S
            if loud:
                if len(last) >= _MAX_REFUSALS_KEPT:  # bounded: forget expired windows
                    for k in [k for k, t in last.items() if now - t >= _LOG_WINDOW_S]:
                        del last[k]
                    if len(last) >= _MAX_REFUSALS_KEPT:
                        last.clear()
                last[key] = now
        logger.log(logging.WARNING if loud else logging.DEBUG, msg, *args)

    def serve(self, sock: zmq.Socket[Any], name: str) -> None:
        """Make a socket that will bind a CURVE server (if configured) and watch it."""
        if self.curve is not None:
            if self._auth is None:
                auth = _Authenticator(self.ctx, log=logging.getLogger(__name__ + ".zap"))
                auth.start()
                auth.configure_curve_callback(
                    ZAP_DOMAIN, _AllowList(self.curve.peer_keys, self, auth))
                self._auth = auth
            sock.curve_secretkey = self.curve.keypair.secret
            sock.curve_publickey = self.curve.keypair.public
            sock.curve_server = True
            sock.zap_domain = ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_DEADLINE_MS)
        if self.curve is not None:
            self.watch(sock, name, accepts=True)

    def connect_as_client(self, sock: zmq.Socket[Any], name: str, *,
                          on_drop: Callable[[], None] | None = None,
                          on_connect: Callable[[], None] | None = None,
                          on_retry: Callable[[], None] | None = None) -> None:
        """Make a socket that will connect a CURVE client (if configured) and watch it.

        ``on_drop`` is called when a connection drops or a handshake fails: after a protocol
        error (a refused handshake, a frame over MAXMSGSIZE) libzmq never reconnects, so the
        socket's owner must connect again. ``on_retry`` is called when libzmq schedules a
        reconnect itself (after a peer left, or while none listens): then the owner must not.
        ``on_connect`` is called each time a connection completes its handshake (a peer,
        maybe a new one, is there to talk to).
        """
        if self.curve is not None:
            sock.curve_secretkey = self.curve.keypair.secret
            sock.curve_publickey = self.curve.keypair.public
            sock.curve_serverkey = self.curve.remote_server_key()
            # Queue only on authenticated connections: a message queued on a connection
            # whose handshake then fails (an impostor listener) would be lost silently.
            sock.immediate = True
        if (self.curve is not None or on_drop is not None or on_connect is not None
                or on_retry is not None):
            self.watch(sock, name, on_drop=on_drop, on_connect=on_connect, on_retry=on_retry)

    def watch(self, sock: zmq.Socket[Any], name: str, *,
              on_drop: Callable[[], None] | None = None, accepts: bool = False,
              on_connect: Callable[[], None] | None = None,
              on_retry: Callable[[], None] | None = None) -> None:
        """Log refused handshakes (and, with ``on_drop``, report them and dropped connections)
        of ``sock``; with ``accepts``, failed accepts of a bound socket too (out of file
        descriptors: libzmq retries in a loop and says nothing). Call from the thread that
        owns ``sock``, before it binds or connects."""
        events = zmq.EVENT_MONITOR_STOPPED
        for ev in _REFUSAL_EVENTS:
            events |= ev
        if on_drop is not None:
            events |= zmq.EVENT_DISCONNECTED
        if accepts:
            events |= zmq.EVENT_ACCEPT_FAILED
        if on_connect is not None:
            events |= zmq.EVENT_HANDSHAKE_SUCCEEDED
        if on_retry is not None:
            events |= zmq.EVENT_CONNECT_RETRIED
        # A plain PAIR even for an asyncio socket (whose get_monitor_socket would return an
        # asyncio socket, unusable from this thread).
        address = f"inproc://enginewire-monitor-{id(self):x}-{next(_monitor_ids)}"
        sock.monitor(address, events)
        mon: zmq.Socket[bytes] = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        mon.connect(address)
        t = threading.Thread(target=self._monitor,
                             args=(mon, name, on_drop, on_connect, on_retry),
                             name=f"EngineWireMonitor-{name}", daemon=True)
        t.start()
        with self._lock:
            self._monitors.append(t)

    def _monitor(self, mon: zmq.Socket[Any], name: str, on_drop: Callable[[], None] | None,
                 on_connect: Callable[[], None] | None = None,
                 on_retry: Callable[[], None] | None = None) -> None:
        try:
            while not self._stop.is_set():
                if not mon.poll(_MONITOR_POLL_MS):
                    continue
                msg = recv_monitor_message(mon)
                event = msg["event"]
                endpoint = msg["endpoint"].decode("utf-8", "replace")
                if event == zmq.EVENT_MONITOR_STOPPED:
                    return
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    if on_connect is not None:
                        on_connect()
                    continue
                if event == zmq.EVENT_CONNECT_RETRIED:
                    if on_retry is not None:
                        on_retry()
                    continue
                if event == zmq.EVENT_DISCONNECTED:
                    with self._lock:
                        self.disconnects += 1
                    self._warn_once(
                        f"dropped {name} {endpoint}",
                        "%s %s: connection to %s dropped (peer gone, refused, or a frame over"
                        " the MAXMSGSIZE limit refused before allocation); reconnecting",
                        self.side, name, endpoint)
                    if on_drop is not None:
                        on_drop()
                    continue
                if event == zmq.EVENT_ACCEPT_FAILED:
                    err = int(msg["value"])
                    self._warn_once(
                        f"accept {name}", "%s %s: accepting a connection at %s failed (%s):"
                        " too many open connections? Each holds a file descriptor until its"
                        " handshake completes or times out (%d s)", self.side, name, endpoint,
                        os.strerror(err), HANDSHAKE_DEADLINE_MS // 1000)
                    continue
                why = _REFUSAL_EVENTS.get(event, f"event {event}")
                self._refused(f"{name} at {endpoint}: {why} ({_detail(event, msg['value'])})")
                if on_drop is not None:
                    on_drop()
        except zmq.ZMQError:
            return  # context terminated under us
        finally:
            mon.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            monitors, self._monitors = self._monitors, []
        for t in monitors:
            if t is not threading.current_thread():
                t.join(2.0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
