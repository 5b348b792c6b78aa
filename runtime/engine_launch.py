"""Starting a local engine core as its own program, not through multiprocessing.

Why
---
multiprocessing's spawn re-imports the launching program's main module in the child. A
script without an ``if __name__ == "__main__":`` guard then built a second client inside its
own engine, which failed with a page of multiprocessing text; a guarded one still paid for
its imports (torch, a web framework) once more per engine. Here the child is
``python -c <bootstrap>``: it takes the front end's import path (``sys.path``, relative
entries made absolute, so a script run from elsewhere or one that extended its path finds
the same ``enginewire``), imports our entry point and nothing of the user's, and reads its
configuration as one message in our own codec (msgspec; no pickle crosses the pipe).

Pipes (made here; the child's ends passed by number, ``pass_fds``)
-----------------------------------------------------------------
* **boot**: the parent writes one length-prefixed ``EngineBoot`` and keeps its end open for
  the engine's life; the child reads the message, then watches its end as a lifeline (EOF:
  the parent is gone; runtime/engine_proc.py's parent watch).
* **life**: the child holds the write end and never writes; the parent's read end is the
  handle's ``sentinel``, readable once the child exited (as multiprocessing's).
* **report**: why the engine failed to start, if it did, as UTF-8 (``StartupReport``).

``EngineSubprocess`` answers the ``EngineProcess`` protocol (runtime/mp_client.py) with
``multiprocessing.Process``'s semantics: negative exit codes for signals, ``close`` refused
while the process runs, a closed handle raising ``ValueError``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import select
import subprocess
import sys
import threading
from typing import Any

import msgspec

from ..protocol.codec import Limits
from .faults import FaultPlan
from .security import CurveConfig, KeyPair

__all__ = [
    "BOOT_MAX_BYTES",
    "EngineBoot",
    "EngineSubprocess",
    "StartupReport",
    "launch_engine_process",
]

# The boot message is a config and a few options: anything near this is not one, and the
# child refuses it before allocating (the length prefix is read first).
BOOT_MAX_BYTES = 64 * 1024 * 1024
# A start-up failure's reason: one line, bounded on both sides.
REPORT_MAX_BYTES = 64 * 1024
_LEN = 8  # bytes of the boot message's length prefix (big-endian)

# Run as ``python -c``: the front end's import path first, then only our entry point. Kept
# to the standard library until the path is set: nothing here may import enginewire early.
_BOOTSTRAP = (
    "import json, sys\n"
    "sys.path[:] = json.loads(sys.argv[1])\n"
    "from enginewire.runtime.engine_launch import child_main\n"
    "child_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))\n"
)


class _Curve(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    public: bytes
    secret: bytes
    peer_keys: list[bytes]
    server_key: bytes | None = None

    @classmethod
    def of(cls, curve: CurveConfig) -> _Curve:
        return cls(curve.keypair.public, curve.keypair.secret, sorted(curve.peer_keys),
                   curve.server_key)

    def config(self) -> CurveConfig:
        return CurveConfig(KeyPair(self.public, self.secret), frozenset(self.peer_keys),
                           self.server_key)


class EngineBoot(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a launched engine is told, as ``run_engine_core`` takes it."""

    config_type: str  # "module:qualname" of the config's msgspec Struct
    config: bytes  # msgpack of the config
    name: str
    input_address: str
    output_address: str
    engine_index: int = 0
    parent_pid: int | None = None
    heartbeat_interval_s: float | None = None
    startup_delay_s: float = 0.0
    fault: FaultPlan | None = None
    integrity: bool = False
    curve: _Curve | None = None
    allow_insecure_tcp: bool = False
    limits: Limits | None = None

    @classmethod
    def build(cls, config_type: type, config: bytes, kwargs: dict[str, Any], name: str
              ) -> EngineBoot:
        """From a launcher's arguments; an option the boot message cannot carry is a
        TypeError here, in the front end, not a mystery in the engine."""
        kwargs = dict(kwargs)
        kwargs.pop("startup_report", None)  # a pipe of this module's own
        unknown = set(kwargs) - set(cls.__struct_fields__)
        if unknown:
            raise TypeError(f"the engine launcher cannot pass {sorted(unknown)}")
        module, qualname = config_type.__module__, config_type.__qualname__
        if module == "__main__" or "<locals>" in qualname:
            # The engine imports it by name and must not import the user's main module.
            raise TypeError(f"the engine config type {qualname} must be importable by name:"
                            " define it in a module, not in __main__ or a function")
        curve = kwargs.pop("curve", None)
        return cls(config_type=f"{module}:{qualname}", config=config, name=name,
                   curve=None if curve is None else _Curve.of(curve), **kwargs)

    def run_kwargs(self) -> dict[str, Any]:
        """``run_engine_core``'s keyword arguments (the config apart)."""
        out: dict[str, Any] = {f: getattr(self, f) for f in self.__struct_fields__
                               if f not in ("config_type", "config", "name", "curve", "limits")}
        out["curve"] = None if self.curve is None else self.curve.config()
        if self.limits is not None:
            out["limits"] = self.limits
        return out

    def decode_config(self) -> Any:
        module, _, qualname = self.config_type.partition(":")
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if not isinstance(obj, type):
            raise TypeError(f"engine config type {self.config_type!r} is not a class")
        return msgspec.msgpack.decode(self.config, type=obj)


class StartupReport:
    """The front end's end of the report pipe: at most one reason, read after the exit."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        if self._fd < 0:
            raise ValueError("the start-up report is closed")
        return self._fd

    def poll(self, timeout: float = 0.0) -> bool:
        ready, _, _ = select.select([self.fileno()], [], [], timeout)
        return bool(ready)

    def recv(self, timeout: float = 0.5) -> str:
        """The reason, once the writer closed its end (it writes, then exits); EOFError when
        it wrote nothing."""
        chunks: list[bytes] = []
        size = 0
        while size < REPORT_MAX_BYTES and self.poll(timeout):
            chunk = os.read(self._fd, REPORT_MAX_BYTES - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if not chunks:
            raise EOFError("no start-up report")
        return b"".join(chunks).decode("utf-8", "replace")

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def write_report(fd: int, reason: str) -> None:
    """The engine's side: one reason, bounded, then the pipe is closed."""
    data = reason.encode("utf-8", "replace")[:REPORT_MAX_BYTES]
    try:
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


class EngineSubprocess:
    """A started engine program: ``multiprocessing.Process``'s subset the client uses."""

    local = True

    def __init__(self, popen: subprocess.Popen[bytes], boot_w: int, life_r: int,
                 name: str) -> None:
        self._popen = popen
        self._boot_w = boot_w  # open for the engine's life: its lifeline
        self._life_r = life_r
        self.name = name
        self._closed = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        code = self._popen.returncode
        state = "alive" if code is None else f"exitcode={code}"
        return f"<EngineSubprocess {self.name} pid={self._popen.pid} {state}>"

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("process object is closed")

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        self._check_open()
        return self._popen.poll()

    @property
    def sentinel(self) -> int:
        self._check_open()
        return self._life_r

    def is_alive(self) -> bool:
        self._check_open()
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        self._check_open()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def _signal(self, kill: bool) -> None:
        self._check_open()
        if self._popen.poll() is not None:
            return  # reaped: its pid may be someone else's by now
        with contextlib.suppress(ProcessLookupError):
            if kill:
                self._popen.kill()
            else:
                self._popen.terminate()

    def terminate(self) -> None:
        self._signal(kill=False)

    def kill(self) -> None:
        self._signal(kill=True)

    def close(self) -> None:
        """Release the pipes; like ``multiprocessing.Process.close``, refused (ValueError)
        while the engine runs, since its lifeline would go with them."""
        with self._lock:
            if self._closed:
                return
            if self._popen.poll() is None:
                raise ValueError("Cannot close a process while it is still running. You"
                                 " should first call join() or terminate().")
            self._closed = True
            for fd in (self._boot_w, self._life_r):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def forget(self) -> None:
        """In a forked child of the front end: drop this copy's fds, signal nothing. No
        lock: one another thread held at the fork stays held in the child for good."""
        if not self._closed:
            self._closed = True
            for fd in (self._boot_w, self._life_r):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def __del__(self) -> None:  # a handle dropped without close: its fds go with it
        if not getattr(self, "_closed", True):
            for fd in (self._boot_w, self._life_r):
                with contextlib.suppress(OSError):
                    os.close(fd)


def _import_path() -> list[str]:
    """This process's ``sys.path`` with relative entries (``''`` is the working directory)
    made absolute: the child starts elsewhere in the tree but must import the same code."""
    entries = [p for p in sys.path if isinstance(p, str)]
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was removed: its relative entries find nothing
        return [p for p in entries if os.path.isabs(p)]
    return [p if os.path.isabs(p) else os.path.join(cwd, p) for p in entries]


def launch_engine_process(config_type: type, config: bytes, kwargs: dict[str, Any],
                          name: str) -> EngineSubprocess:
    """Start an engine program on this host; ``kwargs["startup_report"]`` is the engine's
    end (an fd) of the pipe a ``StartupReport`` reads, passed to it and closed here."""
    report_fd = kwargs.get("startup_report")
    boot = msgspec.msgpack.encode(EngineBoot.build(config_type, config, kwargs, name))
    boot_r, boot_w = os.pipe()
    life_r, life_w = os.pipe()
    theirs = [boot_r, life_w] + ([report_fd] if isinstance(report_fd, int) else [])
    try:
        popen = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, json.dumps(_import_path()), str(boot_r),
             str(life_w), str(report_fd if isinstance(report_fd, int) else -1)],
            pass_fds=theirs, stdin=subprocess.DEVNULL)
    except BaseException:
        for fd in (boot_w, life_r):
            os.close(fd)
        raise
    finally:
        for fd in (boot_r, life_w):
            os.close(fd)  # the child has its copies
    proc = EngineSubprocess(popen, boot_w, life_r, name)
    try:
        # Fits the pipe in one go for any real config (64 KiB); a larger one is read by the
        # child meanwhile, or the child died and the write fails: then its exit tells why.
        msg = len(boot).to_bytes(_LEN, "big") + boot
        view = memoryview(msg)
        while view:
            view = view[os.write(boot_w, view):]
    except BrokenPipeError:
        pass
    return proc


def _read_boot(fd: int) -> EngineBoot:
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise EOFError("the front end went away before sending the engine's boot")
            buf += chunk
        return bytes(buf)

    size = int.from_bytes(exactly(_LEN), "big")
    if size > BOOT_MAX_BYTES:
        raise ValueError(f"boot message of {size} bytes (bound {BOOT_MAX_BYTES})")
    return msgspec.msgpack.decode(exactly(size), type=EngineBoot)


def child_main(boot_fd: int, life_fd: int, report_fd: int) -> None:
    """The engine program's entry (see ``_BOOTSTRAP``); never returns."""
    # Held, never written: it closes with this process. Not handed on to programs the
    # engine may start (a compiler worker), or their life would count as the engine's.
    os.set_inheritable(life_fd, False)
    from .engine_proc import serve_launched

    try:
        boot = _read_boot(boot_fd)
        config = boot.decode_config()
    except BaseException as e:
        if report_fd >= 0:
            with contextlib.suppress(OSError):
                write_report(report_fd, f"{type(e).__name__}: bad engine boot message: {e}")
        os._exit(1)
    serve_launched(config, boot.run_kwargs(),
                   report=None if report_fd < 0 else functools.partial(write_report, report_fd),
                   lifeline=boot_fd)
