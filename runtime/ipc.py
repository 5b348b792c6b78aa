"""Where a client's ipc:// sockets live, and how stale ones are reclaimed.

Each multi-process client binds its sockets inside a private directory (mode 0700, so no
other local user can connect to the engine) under ``$XDG_RUNTIME_DIR`` or the system temp
dir. The directory name carries the owner's pid and process start time; a directory whose
owner is gone (SIGKILL leaves no chance to clean up) is removed by the next client that
starts, so crashed clients do not accumulate socket files.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import psutil

__all__ = ["IpcDir", "cleanup_stale_dirs", "runtime_root"]

logger = logging.getLogger(__name__)

_PREFIX = "enginewire-"
# sun_path is 108 bytes on Linux including the NUL; keep a margin for the socket name.
_MAX_SOCKET_PATH = 100


def runtime_root() -> Path:
    """``$XDG_RUNTIME_DIR`` when it is usable, else the system temp directory."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        return Path(xdg)
    return Path(tempfile.gettempdir())


def _start_stamp(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).create_time() * 1000)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _owner_alive(name: str) -> bool:
    # name: enginewire-<pid>-<start ms>-<token>
    parts = name[len(_PREFIX):].split("-")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return True  # not ours to judge
    pid, stamp = int(parts[0]), int(parts[1])
    # A recycled pid has a different start time, so it does not keep a stale dir alive.
    return _start_stamp(pid) == stamp


def cleanup_stale_dirs(root: Path | None = None) -> list[Path]:
    """Remove the ipc directories of clients that no longer run; return what was removed."""
    root = root or runtime_root()
    removed: list[Path] = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(_PREFIX):
            continue
        try:
            st = entry.lstat()
        except OSError:
            continue
        if st.st_uid != uid or not entry.is_dir() or entry.is_symlink():
            continue
        if _owner_alive(entry.name):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
        logger.debug("removed stale ipc directory %s", entry)
    return removed


class IpcDir:
    """A private 0700 directory for one client's sockets; ``remove()`` is idempotent."""

    def __init__(self, root: Path | None = None) -> None:
        root = root or runtime_root()
        cleanup_stale_dirs(root)
        pid = os.getpid()
        name = f"{_PREFIX}{pid}-{_start_stamp(pid) or 0}-{secrets.token_hex(4)}"
        path = root / name
        if len(str(path)) + 16 > _MAX_SOCKET_PATH:
            # A deep $XDG_RUNTIME_DIR would overflow sun_path; /tmp always fits. Stale
            # directories land there too, so reclaim them there as well.
            cleanup_stale_dirs(Path(tempfile.gettempdir()))
            path = Path(tempfile.gettempdir()) / name
        os.mkdir(path, 0o700)  # mkdir's mode is masked by umask; chmod makes it exact
        os.chmod(path, 0o700)
        self.path = path

    def address(self, name: str) -> str:
        """``ipc://`` address of socket ``name`` inside the directory."""
        return f"ipc://{self.path / name}"

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __repr__(self) -> str:
        return f"IpcDir({str(self.path)!r})"
