"""What the data-parallel fault cells share (fault_matrix_dp.py, fault_matrix_scale.py): the
client's options under the matrix's bounds, and an interposer on one engine's channel."""

from __future__ import annotations

import tempfile
from typing import Any

from . import _cells as cells

__all__ = ["cell_options", "interpose"]


def cell_options() -> dict[str, Any]:
    """The options of a data-parallel cell's client: the matrix's heartbeat and bounds."""
    return dict(engine_heartbeat_timeout_s=cells.HEARTBEAT_TIMEOUT_S,
                engine_heartbeat_interval_s=cells.HEARTBEAT_INTERVAL_S,
                shutdown_timeout_s=cells.SHUTDOWN_TIMEOUT_S, ready_timeout_s=60.0)


def interpose(rule: Any, victim: int, engines: int, workdir: str, options: dict[str, Any]
              ) -> Any:
    """An interposer applying ``rule`` on engine ``victim``'s channel, started; ``options``
    gains the per-engine addresses that put it there (and frame integrity)."""
    from .interposer import Interposer

    proxy = Interposer([rule], engine_index=victim).start()
    base = tempfile.mkdtemp(prefix="enginewire-ipc-", dir=workdir)
    inp = [f"ipc://{base}/in{i}" for i in range(engines)]
    out = [f"ipc://{base}/out{i}" for i in range(engines)]
    proxy.attach(inp[victim], out[victim])
    connect: list[Any] = [None] * engines
    connect[victim] = proxy.engine_addresses
    options.update(input_address=inp, output_address=out, engine_connect=connect,
                   frame_integrity=True)
    return proxy
