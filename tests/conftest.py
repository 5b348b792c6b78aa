"""What a test may assume of its process is made true here, not inherited from the shell.

The suite is started from a terminal, a batch job (``nohup ... &`` starts it with SIGINT
ignored, so Python installs no KeyboardInterrupt handler), a CI runner or a container
entrypoint, from any working directory. A test that needs a signal disposition asks for it
with a fixture that sets it for the test's duration and restores what was there; paths are
built from ``__file__`` or ``tmp_path``, never from the working directory.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

# Variables that change what a client, an engine or the Ray backend does. One exported by the
# shell that started pytest (a ready timeout, a preload, a mutant or fault list left set by
# hand, a Ray cluster's address) would change what the tests test; a test that wants one sets
# it itself. ENGINEWIRE_ENGINE_THREADS (a speed knob) and ENGINEWIRE_VLLM_PYTHON (where the
# vLLM tests find vLLM) are inputs the suite reads, so they stay.
BEHAVIOUR_ENV = (
    "ENGINEWIRE_ENGINE_LOG_FILE",
    "ENGINEWIRE_ENGINE_LOG_LEVEL",
    "ENGINEWIRE_ENGINE_PRELOAD",
    "ENGINEWIRE_ENGINE_READY_TIMEOUT_S",
    "ENGINEWIRE_ENGINE_TRACE",
    "ENGINEWIRE_INJECTED_FAULTS",
    "ENGINEWIRE_TESTING_MUTANT",
    "ENGINEWIRE_WEIGHT_SOURCES",
    "RAY_ADDRESS",
    "_ENGINEWIRE_CAMPAIGN_REPORT",
)


def pytest_configure(config: pytest.Config) -> None:
    # Before collection: test modules read the environment at import, and the engines they
    # spawn inherit it.
    for name in BEHAVIOUR_ENV:
        os.environ.pop(name, None)


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt (Python's ``default_int_handler``) for the test's
    duration, whatever the process inherited; the previous handler is put back after."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set on the main thread only")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
