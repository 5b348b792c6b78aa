"""Throwaway directories of runs killed outright (the campaign's standalone engine, the bench's
floor peers) are removed by the next run to start, and nothing a live run uses ever is."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from enginewire.runtime.ipc import OWNER_FILE, owned_tempdir, sweep_owned_dirs

PREFIX = "ewtest-"


def _owned(root: Path, name: str, owner: str) -> Path:
    d = root / name
    d.mkdir(mode=0o700)
    (d / OWNER_FILE).write_text(owner)
    (d / "in").touch()
    return d


def _exited_owner() -> str:
    """The "<pid> <start ms>" a process that has exited recorded (as owned_tempdir writes)."""
    code = ("import os; from enginewire.runtime.ipc import _start_stamp;"
            "print(os.getpid(), _start_stamp(os.getpid()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout.strip()


def test_the_sweep_removes_only_directories_whose_owner_is_gone(tmp_path: Path) -> None:
    from enginewire.runtime.ipc import _start_stamp

    pid = os.getpid()
    live = owned_tempdir(PREFIX, tmp_path)
    stale = _owned(tmp_path, PREFIX + "stale", _exited_owner())
    # Our pid with another start time: the pid was recycled, the owner is gone.
    recycled = _owned(tmp_path, PREFIX + "recycled", f"{pid} {(_start_stamp(pid) or 0) + 1}")
    unknown_start = _owned(tmp_path, PREFIX + "nostamp", f"{pid} 0")  # judged by pid alone
    no_owner = tmp_path / (PREFIX + "noowner")
    no_owner.mkdir()
    garbled = _owned(tmp_path, PREFIX + "garbled", "not a pid\n")
    other_prefix = _owned(tmp_path, "other-stale", _exited_owner())
    # A symlink to a stale-looking directory is neither followed nor removed.
    target = _owned(tmp_path, "target", _exited_owner())
    link = tmp_path / (PREFIX + "link")
    link.symlink_to(target)
    # An owner file that is a symlink is not read.
    linked_owner = tmp_path / (PREFIX + "linkedowner")
    linked_owner.mkdir()
    (linked_owner / OWNER_FILE).symlink_to(target / OWNER_FILE)

    assert sweep_owned_dirs(tmp_path, PREFIX) == [recycled, stale]
    assert not stale.exists() and not recycled.exists()
    for kept in (live, unknown_start, no_owner, garbled, other_prefix, target, linked_owner):
        assert kept.is_dir(), kept
    assert link.is_symlink()
    assert (live / OWNER_FILE).read_text().split()[0] == str(pid)
    assert sweep_owned_dirs(tmp_path, PREFIX) == []


def test_owned_tempdir_is_private_and_sweeps_first(tmp_path: Path) -> None:
    stale = _owned(tmp_path, PREFIX + "stale", _exited_owner())
    d = owned_tempdir(PREFIX, tmp_path)
    assert not stale.exists()
    assert d.name.startswith(PREFIX) and d.stat().st_mode & 0o777 == 0o700
    assert os.listdir(d) == [OWNER_FILE]


def test_a_killed_bench_leaves_a_floor_dir_the_next_floor_peer_removes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from enginewire.benchmarks.floor import FLOOR_DIR_PREFIX, FloorPeer
    from enginewire.testing.conformance import check_exits_with_parent

    check_exits_with_parent(
        "import sys\n"
        "from enginewire.benchmarks.floor import FloorPeer\n"
        "peer = FloorPeer('raw_echo')\n"
        "print(peer.proc.pid, flush=True)\n"
        "sys.stdin.read()\n",
        "the raw_echo floor peer", env={**os.environ, "TMPDIR": str(tmp_path)})
    left = [p for p in tmp_path.iterdir() if p.name.startswith(FLOOR_DIR_PREFIX)]
    assert len(left) == 1  # SIGKILL left it
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with FloorPeer("raw_echo") as peer:
        assert peer.echo(b"x") == b"x"
        now = [p for p in tmp_path.iterdir() if p.name.startswith(FLOOR_DIR_PREFIX)]
        assert now == [Path(peer._dir)]  # the stale one went, the live one stays
    assert not any(p.name.startswith(FLOOR_DIR_PREFIX) for p in tmp_path.iterdir())


def test_a_standalone_engine_removes_the_dir_a_killed_campaign_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from enginewire.runtime.config import EngineConfig
    from enginewire.testing.stateful import STANDALONE_DIR_PREFIX, StandaloneEngine

    # As a campaign killed outright leaves it: its owner gone, the socket files still there.
    stale = _owned(tmp_path, STANDALONE_DIR_PREFIX + "killed", _exited_owner())
    live = _owned(tmp_path, STANDALONE_DIR_PREFIX + "live", f"{os.getpid()} 0")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    engine = StandaloneEngine(EngineConfig(model="null"), faults=False)
    try:
        assert not stale.exists() and live.exists()
        assert Path(engine.dir).parent == tmp_path
        engine.attach("sync").shutdown()  # a front end binds its sockets beside the owner file
    except BaseException:
        engine.close(check=False)
        raise
    engine.close()  # judges what it leaves: its owner file is not a leftover socket
    assert not Path(engine.dir).exists()
