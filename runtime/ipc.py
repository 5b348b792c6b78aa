"""Where a client's ipc:// sockets live, and how stale ones are reclaimed.

Each multi-process client binds its sockets inside a private directory (mode 0700, so no
other local user can connect to the engine) under ``$XDG_RUNTIME_DIR`` or the system temp
dir. The directory name carries the owner's pid and process start time; a directory whose
owner is gone (SIGKILL leaves no chance to clean up) is removed by the next client that
starts, so crashed clients do not accumulate socket files.

``owned_tempdir`` gives other throwaway directories (the campaign's standalone engine, the
bench's floor peers) the same reclaim-at-next-start. Their owner is recorded in a file inside
rather than in the name: those paths already sit close to sun_path's limit under a deep
``$TMPDIR`` (pytest's tmp_path), and pid and start time would add ~20 bytes.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

import psutil

__all__ = ["IpcDir", "cleanup_stale_dirs", "owned_tempdir", "runtime_root", "sweep_owned_dirs"]

logger = logging.getLogger(__name__)

_PREFIX = "enginewire-"
# sun_path is 108 bytes on Linux including the NUL; keep a margin for the socket name.
_MAX_SOCKET_PATH = 100
# Inside an owned_tempdir: "<pid> <start ms>" of the process that made it.
OWNER_FILE = ".owner"


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


def _alive(pid: int, stamp: int) -> bool:
    if stamp == 0:  # the owner could not read its own start time: the pid alone must do
        return bool(psutil.pid_exists(pid))
    # A recycled pid has a different start time, so it does not keep a stale dir alive.
    return _start_stamp(pid) == stamp


def _owner_alive(name: str) -> bool:
    # name: enginewire-<pid>-<start ms>-<token>
    parts = name[len(_PREFIX):].split("-")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return True  # not ours to judge
    return _alive(int(parts[0]), int(parts[1]))


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


def _read_owner(entry: Path) -> tuple[int, int] | None:
    """The (pid, start ms) recorded in ``entry``, or None when ``entry`` is not a directory
    of this uid holding a well-formed owner file. Nothing is followed: the directory and the
    file are opened with O_NOFOLLOW, and judged by fstat of what was opened."""
    try:
        dfd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.getuid() or not stat.S_ISDIR(st.st_mode):
            return None
        # O_NONBLOCK: a FIFO planted under that name must not block the sweep.
        ffd = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        try:
            if not stat.S_ISREG(os.fstat(ffd).st_mode):
                return None
            text = os.read(ffd, 64).decode("ascii")
        finally:
            os.close(ffd)
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(dfd)
    parts = text.split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def sweep_owned_dirs(root: Path, prefix: str) -> list[Path]:
    """Remove the ``owned_tempdir`` directories named ``prefix...`` under ``root`` whose
    owner no longer runs; return what was removed.

    Only this uid's real directories with a readable owner file are judged; anything else
    (a symlink, a file, another user's directory, one without an owner file) is left alone."""
    removed: list[Path] = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        owner = _read_owner(entry)
        if owner is None or _alive(*owner):
            continue
        shutil.rmtree(entry, ignore_errors=True)  # rmtree never follows a symlink
        removed.append(entry)
        logger.debug("removed stale directory %s", entry)
    return removed


def owned_tempdir(prefix: str, root: Path | None = None) -> Path:
    """A new private (0700) directory ``<prefix><random>`` under ``root`` (default: the
    system temp dir), owned by this process; first removes the ``prefix`` directories whose
    owner is gone, since a run killed outright (SIGKILL, OOM) cannot remove its own.

    The caller removes the directory when done. It holds ``OWNER_FILE`` besides what the
    caller puts there."""
    root = root or Path(tempfile.gettempdir())
    sweep_owned_dirs(root, prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))  # 0700
    pid = os.getpid()
    # A kill between mkdtemp and this write leaves a directory no sweep judges: a window of
    # one small write, against never removing what a live run uses.
    with open(path / OWNER_FILE, "x", encoding="ascii") as f:
        f.write(f"{pid} {_start_stamp(pid) or 0}\n")
    return path


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
