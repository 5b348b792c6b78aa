"""The named fault points and actions: vocabulary shared by the engine core and the harness.

Pure enums, no I/O and no threads: the engine core names its points with these members
(``fault_hook(FaultPoint.STEP)``), so a typo is an AttributeError at import, not a
``ValueError`` inside ``step()`` once some fault is armed. ``runtime/faults.py`` builds plans
and the injector on top.
"""

from __future__ import annotations

import enum

__all__ = ["FaultAction", "FaultPoint"]


class FaultPoint(enum.StrEnum):
    """Where in the engine process a fault can fire."""

    BEFORE_READY = "before_ready"  # engine built, ready handshake not yet sent
    AFTER_READY = "after_ready"  # handshake done: a front end's ATTACH arrived (the Nth)
    STEP = "step"  # start of EngineCore.step()
    FORWARD = "forward"  # inside the step, just before the model forward
    UTILITY = "utility"  # before a utility runs (``method`` narrows it to one name)
    INPUT_DECODED = "input_decoded"  # input thread, a frame decoded, not yet queued
    OUTPUT_SEND = "output_send"  # output thread, a message encoded, not yet sent
    SLEEP = "sleep"  # inside the sleep utility
    WAKE_UP = "wake_up"  # inside the wake_up utility
    SHUTDOWN = "shutdown"  # the engine process begins its shutdown

    @property
    def in_io_thread(self) -> bool:
        return self in (FaultPoint.INPUT_DECODED, FaultPoint.OUTPUT_SEND)


class FaultAction(enum.StrEnum):
    """What a fault does when it fires."""

    RAISE = "raise"  # an exception at the point: the engine's fatal-error path
    EXIT = "exit"  # os._exit(17): gone without the dead sentinel
    SIGKILL = "sigkill"
    SIGSTOP = "sigstop"  # alive, silent; the harness resumes it with SIGCONT or kills it
    DELAY = "delay"  # sleep ``arg`` seconds (default 1), then carry on
    OOM = "oom"  # simulated out-of-memory (CUDA OOM on a GPU, KV exhaustion on CPU)
