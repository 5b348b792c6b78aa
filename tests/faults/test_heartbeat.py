"""The client's heartbeat deadline (runtime/mp_client.py ``monitor_engine``): a silent engine is
declared dead once nothing arrived for the deadline, measured from its last message, and an
engine that keeps talking never is."""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any

from enginewire.runtime._background import monitor_engine

DEADLINE_S = 0.3
BOUND_S = 5.0


class FakeClient:
    """Stands in for the MPClient: records when and why the monitor declared death."""

    def __init__(self) -> None:
        self.dead = threading.Event()
        self.cause: BaseException | None = None
        self.at = 0.0

    def _on_engine_dead(self, cause: BaseException) -> None:
        self.at = time.monotonic()
        self.cause = cause
        self.dead.set()


def start_monitor(client: FakeClient, last_seen: list[float]) -> tuple[threading.Thread, int]:
    stop_r, stop_w = os.pipe()
    ref: Any = weakref.ref(client)

    def run() -> None:
        try:
            monitor_engine(ref, None, stop_r, DEADLINE_S, last_seen)
        finally:
            os.close(stop_r)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, stop_w


def test_an_engine_that_keeps_talking_is_never_declared_dead() -> None:
    client, last_seen = FakeClient(), [time.monotonic()]
    t, stop_w = start_monitor(client, last_seen)
    try:
        # Messages every third of the deadline for four deadlines: each one moves it.
        for _ in range(12):
            assert not client.dead.wait(DEADLINE_S / 3)
            last_seen[0] = time.monotonic()
    finally:
        os.write(stop_w, b"x")
        t.join(BOUND_S)
        os.close(stop_w)
    assert not t.is_alive() and not client.dead.is_set()


def test_silence_is_death_one_deadline_after_the_last_message() -> None:
    client, last_seen = FakeClient(), [time.monotonic()]
    t, stop_w = start_monitor(client, last_seen)
    last = 0.0
    for _ in range(3):
        assert not client.dead.wait(DEADLINE_S / 2)
        last = last_seen[0] = time.monotonic()
    assert client.dead.wait(BOUND_S)
    t.join(BOUND_S)  # never asked to stop: it ended by declaring death
    os.close(stop_w)
    assert not t.is_alive()
    # Never early; how late is scheduling (the fault matrix measures it end to end).
    assert client.at - last >= DEADLINE_S
    assert "engine_heartbeat_timeout_s" in str(client.cause)
