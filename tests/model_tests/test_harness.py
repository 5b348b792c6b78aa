"""model_tests/_harness.py: the one bounded wait and the one definition of a leftover; and the
conformance suite's optional injector (absent: the scenarios that need it are skipped)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from enginewire.testing import conformance as cf
from enginewire.testing._harness import (
    ResourceSnapshot,
    describe_leaks,
    left_behind,
    new_processes,
    wait_until,
)


def test_wait_until_says_what_it_waited_for() -> None:
    assert wait_until(lambda: True, 0.0)
    assert not wait_until(lambda: False, 0.02)
    with pytest.raises(AssertionError, match=r"^the flag not seen within 0.02 s$"):
        wait_until(lambda: False, 0.02, "the flag")


def test_left_behind_names_a_thread_an_fd_and_a_child(tmp_path: Path) -> None:
    before = ResourceSnapshot.take()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="left-running")
    thread.start()
    fd = os.open(tmp_path, os.O_RDONLY)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        leaks = left_behind(before, bound=0.05)
        assert leaks["threads"] == 1 and leaks["fds"] >= 1 and child.pid in leaks["processes"]
        text = "; ".join(describe_leaks(leaks, before))
        assert "left-running" in text and f"new: {tmp_path} x1" in text, text
        assert left_behind(before, bound=0.05, kinds=("threads",)).keys() == {"threads"}
    finally:
        stop.set()
        thread.join()
        os.close(fd)
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    # Exited and reaped, joined, closed: nothing is left, and a reaped child is no process.
    assert left_behind(before, bound=5.0, kinds=("processes", "threads")) == {}
    assert child.pid not in new_processes(before)


def test_an_unreaped_child_is_left_behind() -> None:
    before = ResourceSnapshot.take()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # Exited, never waited for: a zombie of ours is still ours to reap.
        assert wait_until(lambda: child.pid in new_processes(before), 10.0)
        assert child.pid in left_behind(before, bound=0.5, kinds=("processes",))["processes"]
    finally:
        child.wait()
    assert child.pid not in new_processes(before)


def test_a_client_without_an_injector_skips_the_scenarios_that_need_one() -> None:
    class NoInternals:
        multiprocess = True

        def live_requests(self) -> list[str]:
            return []

    cut = cf.ClientUnderTest(NoInternals(), "sync")
    for check in (cf.check_forbidden_output, cf.check_malformed_frames):
        with pytest.raises(cf.NotApplicable, match="needs an injector"):
            check(cut)
