"""The profiler writes its traces only where no other local user can read or replace them.

Without a path the engine wrote to ``<temp dir>/enginewire-profile``, one name for every user:
whoever made that directory first (or made it writable to all) decided who could read and
replace everyone's traces. The default is now ``<temp dir>/enginewire-profile-<uid>``, made
0700, and a trace directory another user owns or can write, or one that is a symlink, is
refused, not used: the caller gets a ``UtilityError`` naming the directory and the remedy,
the profiler is not started and nothing is created. An explicit path is judged the same
way, and so is its parent, where another user could swap the directory for their own.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from enginewire.runtime import make_client
from enginewire.runtime.client import InprocClient
from enginewire.runtime.config import EngineConfig
from enginewire.spec import UtilityError

NULL = EngineConfig(model="null")
OTHER_UID = 65534  # "nobody": any uid but ours
BOUND_S = 30.0
needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="only root can make a directory another uid owns")


def _make_root(tmp_path: Path) -> Path:
    root = tmp_path / "tmp"
    root.mkdir()
    os.chmod(root, 0o1777)  # as /tmp is: sticky, writable by all
    return root


@pytest.fixture
def tmp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temp directory an in-process engine sees: this test's own, so the default lands
    here."""
    root = _make_root(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


@pytest.fixture
def client() -> Iterator[InprocClient]:
    c = InprocClient(NULL)
    try:
        yield c
    finally:
        c.shutdown()


def _default(root: Path) -> Path:
    return root / f"enginewire-profile-{os.geteuid()}"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _assert_refused(client: object, path: Path | None, named: Path, why: str) -> None:
    """``profile(True, path)`` is refused naming ``named`` and the remedy, and nothing was
    started (a stop finds no profiler)."""
    with pytest.raises(UtilityError) as info:
        client.profile(True, None if path is None else str(path))  # type: ignore[attr-defined]
    err = info.value
    assert err.method == "profile"
    assert err.remote_message.startswith("PermissionError: "), err.remote_message
    assert repr(str(named)) in err.remote_message and why in err.remote_message, err
    assert "docs/security.md" in err.remote_message, err  # where the remedy is spelled out
    with pytest.raises(UtilityError, match="not running"):
        client.profile(False)  # type: ignore[attr-defined]


def test_the_default_directory_is_this_users_own_and_made_0700(
        client: InprocClient, tmp_root: Path) -> None:
    old = os.umask(0)  # the mode must not depend on the umask
    try:
        assert client.profile(True) is None
        out = client.profile(False)
    finally:
        os.umask(old)
    assert out is not None and Path(out).parent == _default(tmp_root) and Path(out).is_file()
    st = os.lstat(_default(tmp_root))
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    # Reused on the next run, as it is now this user's own.
    client.profile(True)
    assert Path(client.profile(False) or "").parent == _default(tmp_root)


def test_an_explicit_path_is_made_0700_level_by_level(
        client: InprocClient, tmp_root: Path) -> None:
    path = tmp_root / "mine" / "traces"  # tmp_root is sticky and writable by all, as /tmp
    client.profile(True, str(path))
    out = client.profile(False)
    assert out is not None and Path(out).parent == path
    assert _mode(path) == 0o700 and _mode(path.parent) == 0o700


@needs_root
def test_a_default_directory_another_user_made_is_refused(
        client: InprocClient, tmp_root: Path) -> None:
    squat = _default(tmp_root)
    squat.mkdir(mode=0o700)
    os.chown(squat, OTHER_UID, OTHER_UID)
    _assert_refused(client, None, squat, f"owned by uid {OTHER_UID}")
    assert os.lstat(squat).st_uid == OTHER_UID and not any(squat.iterdir())  # left as it was


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_default_directory_others_can_write_is_refused(
        client: InprocClient, tmp_root: Path, mode: int) -> None:
    shared = _default(tmp_root)
    shared.mkdir()
    os.chmod(shared, mode)
    _assert_refused(client, None, shared, "writable by its group or others")
    assert _mode(shared) == mode and not any(shared.iterdir())


@pytest.mark.parametrize("explicit", [False, True])
def test_a_directory_that_is_a_symlink_is_refused(
        client: InprocClient, tmp_root: Path, tmp_path: Path, explicit: bool) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)  # even one of ours: whoever made the link chose where
    link = tmp_root / "link" if explicit else _default(tmp_root)
    link.symlink_to(elsewhere)
    _assert_refused(client, link if explicit else None, link, "is a symlink")
    assert link.is_symlink() and not any(elsewhere.iterdir())


@needs_root
def test_an_explicit_path_whose_parent_another_user_owns_is_refused(
        client: InprocClient, tmp_root: Path) -> None:
    theirs = tmp_root / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    path = theirs / "traces"
    _assert_refused(client, path, theirs, f"owned by uid {OTHER_UID}")
    assert not path.exists()  # nothing was made in it


@pytest.mark.parametrize("missing", [1, 2])
def test_an_explicit_path_whose_parent_others_can_write_is_refused(
        client: InprocClient, tmp_root: Path, missing: int) -> None:
    shared = tmp_root / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # not sticky: anyone may rename what is in it
    path = shared / "a" / "b" if missing == 2 else shared / "traces"
    _assert_refused(client, path, shared, "writable by its group or others")
    assert not any(shared.iterdir())


@pytest.mark.parametrize("mode", [0o700, 0o777])
def test_a_directory_made_between_the_check_and_the_mkdir_is_judged_as_found(
        client: InprocClient, tmp_root: Path, monkeypatch: pytest.MonkeyPatch,
        mode: int) -> None:
    """Engines of a data-parallel group start their profilers at once: a sibling's directory
    (0700) is used; one made writable by all in that window is refused."""
    made = _default(tmp_root)
    real_mkdir = os.mkdir

    def raced(path: str, *args: object, **kwargs: object) -> None:
        real_mkdir(path)
        os.chmod(path, mode)
        raise FileExistsError(path)

    with monkeypatch.context() as m:
        m.setattr(os, "mkdir", raced)
        if mode == 0o777:
            _assert_refused(client, None, made, "writable by its group or others")
            return
        client.profile(True)
    out = client.profile(False)
    assert out is not None and Path(out).parent == made and _mode(made) == 0o700


@needs_root
def test_a_directory_that_changed_hands_since_the_start_is_refused_at_the_stop(
        client: InprocClient, tmp_root: Path) -> None:
    path = tmp_root / "traces"
    client.profile(True, str(path))
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(UtilityError, match=f"owned by uid {OTHER_UID}"):
        client.profile(False)
    assert not any(path.iterdir())
    os.chown(path, os.geteuid(), os.getegid())
    out = client.profile(False)  # the refused stop left the session running
    assert out is not None and Path(out).parent == path


def test_an_engine_process_refuses_it_and_keeps_serving(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _make_root(tmp_path)
    # The engine's temp directory only: the client's sockets stay where they were (this
    # deep a path would overflow sun_path).
    monkeypatch.setattr(tempfile, "tempdir", tempfile.gettempdir())
    monkeypatch.setenv("TMPDIR", str(root))
    shared = _default(root)
    shared.mkdir()
    os.chmod(shared, 0o777)
    with make_client(NULL, multiprocess=True, asyncio=False) as client:
        _assert_refused(client, None, shared, "writable by its group or others")
        assert client.echo("alive", timeout=BOUND_S) == "alive"
    assert not any(shared.iterdir())
