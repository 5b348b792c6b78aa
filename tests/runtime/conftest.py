"""Shared fixtures of the runtime tests."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from enginewire import make_client
from enginewire.runtime.engine_proc import Control, EngineCoreProc

BOUND_S = 30.0
Attach = Callable[..., contextlib.AbstractContextManager[Any]]


@pytest.fixture
def attach_client(tmp_path: Path) -> Attach:
    """``with attach_client(config, install, asyncio=False) as client``: a subprocess-style
    client attached to an engine whose busy loop runs on a thread here, so a test can give
    the engine utilities of its own (``install(engine)`` runs before the loop starts)."""

    @contextlib.contextmanager
    def attach(config: Any, install: Callable[[Any], None], *,
               asyncio: bool = False) -> Iterator[Any]:
        inp, out = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
        holder: dict[str, Any] = {}

        def serve() -> None:
            proc = EngineCoreProc(config, input_address=inp, output_address=out)
            install(proc.engine)
            holder["proc"] = proc
            try:
                proc.run_busy_loop()
            finally:
                proc.close()

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        client = make_client(config, multiprocess=True, asyncio=asyncio, launch_engine=False,
                             input_address=inp, output_address=out, ready_timeout_s=BOUND_S)
        try:
            yield client
        finally:
            client.shutdown()
            if "proc" in holder:
                holder["proc"].input_queue.put((Control.SHUTDOWN, None))
            server.join(BOUND_S)
            assert not server.is_alive()

    return attach
