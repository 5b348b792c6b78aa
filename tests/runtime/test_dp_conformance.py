"""The conformance suite (enginewire.testing.conformance) on the data-parallel clients.

The scenarios a healthy engine serves run unchanged on a client over two engine cores of
the tiny torch model: a data-parallel client keeps every promise of the one-engine surface.
The scenarios about the death of *the* engine do not apply (one engine's loss is not the
client's; tests/runtime/test_dp_client.py covers it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from enginewire.runtime.config import EngineConfig
from enginewire.testing import conformance as cf

torch.set_num_threads(1)
os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")  # spawned engines inherit it

CONFIG = EngineConfig(model="tiny", max_num_seqs=8, max_model_len=256, data_parallel_size=2)
KINDS = ("sync", "async")


@pytest.fixture(scope="module", params=KINDS)
def warm(request: pytest.FixtureRequest) -> Iterator[cf.ClientUnderTest]:
    cut = cf.open_client(request.param, CONFIG)
    try:
        yield cut
    finally:
        cut.shutdown()
        cf.check_trace(cut)


def test_generate(warm: cf.ClientUnderTest) -> None:
    cf.check_generate(warm)


def test_abort_half(warm: cf.ClientUnderTest) -> None:
    cf.check_abort_half(warm)


def test_utilities(warm: cf.ClientUnderTest) -> None:
    cf.check_utilities(warm)


def test_bad_arguments(warm: cf.ClientUnderTest) -> None:
    cf.check_bad_arguments(warm)


def test_duplicate_request_id(warm: cf.ClientUnderTest) -> None:
    cf.check_duplicate_request_id(warm)


@pytest.mark.parametrize(("level", "mode"), [(0, "abort"), (1, "wait"), (2, "keep")])
def test_sleep_wake(warm: cf.ClientUnderTest, level: int, mode: str) -> None:
    cf.check_sleep_wake(warm, level, mode)


def test_rejected_add_spares_live_request(warm: cf.ClientUnderTest) -> None:
    cf.check_rejected_add_spares_live_request(warm)


@pytest.mark.parametrize("kind", KINDS)
def test_shutdown_semantics(kind: str) -> None:
    cf.check_shutdown_semantics(cf.open_client(kind, CONFIG))
