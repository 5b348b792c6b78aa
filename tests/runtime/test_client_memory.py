"""What a long-lived front end must not keep: an unread backlog after shutdown, the arrays of
a request once it was sent. And how it sees a backlog build up (``queued_outputs``)."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import numpy as np
import pytest
import torch

from enginewire import EngineConfig, EngineCoreRequest, SamplingParams
from enginewire.runtime import make_client

NULL = EngineConfig(model="null", max_num_seqs=64)


def _long(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))


def test_an_unread_backlog_is_counted_and_let_go_at_shutdown_sync() -> None:
    client = make_client(NULL, multiprocess=True, asyncio=False)
    try:
        for i in range(16):
            client.add_request(_long(f"r{i}"))
        deadline = time.monotonic() + 30
        while client.queued_outputs() < 20:  # nobody reads: batches pile up
            assert time.monotonic() < deadline, client.queued_outputs()
            time.sleep(0.01)
    finally:
        client.shutdown()
    assert client.queued_outputs() == 0
    assert client._outputs.qsize() == 1  # only the marker that wakes readers


def test_an_unread_backlog_is_let_go_at_shutdown_async() -> None:
    async def main() -> tuple[int, int]:
        client = make_client(NULL, multiprocess=True, asyncio=True)
        for i in range(16):
            await client.add_request_async(_long(f"r{i}"))  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while client.queued_outputs() < 20:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await client.shutdown_async()  # type: ignore[attr-defined]
        await asyncio.sleep(0)  # the loop applies the close
        return client.queued_outputs(), client._outputs.qsize()  # type: ignore[attr-defined]

    assert asyncio.run(main()) == (0, 1)


def test_a_sent_requests_array_is_not_pinned_until_the_next_big_send() -> None:
    with make_client(NULL, multiprocess=True, asyncio=False) as client:
        big = torch.ones(1 << 20)  # 4 MiB: an aux frame, sent zero-copy
        gone = weakref.ref(big)
        client.add_request(EngineCoreRequest(
            "t", [1], SamplingParams(max_tokens=1), tensors={"prompt_embeds": big}))
        del big
        deadline = time.monotonic() + 30
        finished = False
        while not (finished and gone() is None):
            assert time.monotonic() < deadline, "the array stayed pinned"
            finished |= any(o.finished for o in client.get_output(timeout=0.05).outputs)
            gc.collect()


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc", "sync"])
def test_queued_outputs_is_zero_when_read(multiprocess: bool) -> None:
    with make_client(NULL, multiprocess=multiprocess, asyncio=False) as client:
        client.add_request(EngineCoreRequest("a", [1], SamplingParams(max_tokens=2)))
        while not any(o.finished for o in client.get_output(timeout=5).outputs):
            pass
        assert client.queued_outputs() == 0


def test_the_front_end_bounds_what_an_engine_sends() -> None:
    """A peer holding an engine key used to be able to send the front end frames of any
    size: libzmq now refuses them from their header, before allocating."""
    import zmq

    from enginewire.protocol.codec import DEFAULT_LIMITS

    with make_client(NULL, multiprocess=True, asyncio=False) as client:
        res = client.resources
        assert res.input_socket is not None and res.sync_reader is not None
        assert res.input_socket.getsockopt(zmq.MAXMSGSIZE) == 1 << 20  # the handshake only
        out = res.sync_reader._out  # type: ignore[attr-defined]
        assert out.getsockopt(zmq.MAXMSGSIZE) == DEFAULT_LIMITS.max_frame_bytes
        big = np.ones(1 << 20)  # an 8 MiB reply: legitimate outputs still pass
        assert np.array_equal(client.call_utility("echo", big), big)


def test_an_abort_of_more_ids_than_a_message_holds_still_ends_the_live_request() -> None:
    """r1 among 70,000 ids: the engine refused the whole list (at most Limits.max_batch ids
    a message), so r1 ran to its end and the client heard of no error."""
    from enginewire.protocol.codec import DEFAULT_LIMITS

    slow = EngineConfig(model="null", null_step_delay_s=0.01)  # r1 runs for 2 s
    with make_client(slow, multiprocess=True, asyncio=False) as client:
        client.add_request(_long("r1"))
        client.abort_requests(["r1", *(f"x{i}" for i in range(DEFAULT_LIMITS.max_batch + 4000))])
        deadline = time.monotonic() + 30
        ended = None
        while ended is None:
            assert time.monotonic() < deadline
            for o in client.get_output(timeout=0.1).outputs:
                if o.request_id == "r1" and o.finished:
                    ended = o.finish_reason
        assert ended.name == "ABORT"
