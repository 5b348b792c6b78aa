"""enginewire.runtime: the engine core, its process wrapper and the clients that drive it."""

from __future__ import annotations

from ._background import BackgroundResources
from .async_mp_client import AsyncMPClient
from .client import EngineCoreClient, InprocClient
from .engine_proc import EngineCoreProc, run_engine_core
from .factory import make_client, make_client_async
from .ipc import IpcDir, cleanup_stale_dirs
from .mp_client import MPClient
from .options import READY_TIMEOUT_ENV, ClientOptions, DataParallelOptions
from .sync_mp_client import SyncMPClient

__all__ = [
    "READY_TIMEOUT_ENV",
    "AsyncMPClient",
    "BackgroundResources",
    "ClientOptions",
    "DataParallelOptions",
    "EngineCoreClient",
    "EngineCoreProc",
    "InprocClient",
    "IpcDir",
    "MPClient",
    "SyncMPClient",
    "cleanup_stale_dirs",
    "make_client",
    "make_client_async",
    "run_engine_core",
]
