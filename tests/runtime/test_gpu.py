"""CUDA paths of the engine: profiling-based KV sizing, memory that really drops on sleep, and
the paged model on the GPU against the CPU dense reference. Skipped without CUDA; run them all
with ``scripts/gpu_check.sh``."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine import EngineCore
from enginewire.runtime.model import TinyRandomSource, dense_greedy, kv_bytes_per_block

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cfg(**kw: object) -> EngineConfig:
    base: dict[str, object] = {"model": "tiny", "device": "cuda", "gpu_memory_utilization": 0.05,
                               "max_num_gpu_blocks": 1 << 15}
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def greedy_run(eng: EngineCore, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        eng.add_request(EngineCoreRequest(rid, p, SamplingParams(max_tokens=n, ignore_eos=True)))
    toks: dict[str, list[int]] = defaultdict(list)
    for _ in range(1000):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step().outputs:
            toks[o.request_id] += o.new_token_ids
    return dict(toks)


def test_block_count_comes_from_profiling_free_memory() -> None:
    small = EngineCore(cfg(gpu_memory_utilization=0.02, max_num_gpu_blocks=1 << 30,
                           max_num_batched_tokens=256))
    stats = small.get_stats()
    per = kv_bytes_per_block(small.arch, 16, torch.float32)
    total = torch.cuda.get_device_properties(0).total_memory
    # The pool fits inside the utilization share and is a real fraction of it.
    assert 0 < stats.num_gpu_blocks * per <= 0.02 * total
    assert stats.profiled_num_blocks == stats.num_gpu_blocks
    small.shutdown()
    capped = EngineCore(cfg(gpu_memory_utilization=0.04, max_num_gpu_blocks=1000))
    assert capped.ready_info()["num_gpu_blocks"] == 1000
    assert capped.get_stats().profiled_num_blocks > stats.num_gpu_blocks
    capped.shutdown()


def test_sleep_releases_cuda_memory_and_wake_restores_it() -> None:
    eng = EngineCore(cfg())
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    kv = sum(t.untyped_storage().nbytes() for t in eng.executor.driver.kv_caches)  # type: ignore[union-attr]
    eng.sleep(1)
    torch.cuda.synchronize()
    asleep = torch.cuda.memory_allocated()
    assert awake - asleep >= kv
    assert eng.get_stats().cuda_memory_allocated == asleep
    eng.wake_up()
    assert torch.cuda.memory_allocated() >= awake - 1024
    eng.sleep(2)
    assert torch.cuda.memory_allocated() <= asleep
    assert eng.wake_up()
    arch, params = TinyRandomSource(seed=0).load()
    toks = greedy_run(eng, {"a": [5, 6, 7]}, 6)
    assert toks["a"] == dense_greedy(arch, params, [5, 6, 7], 6)
    eng.shutdown()


def test_paged_model_on_cuda_matches_cpu_dense_reference() -> None:
    eng = EngineCore(cfg(block_size=4, max_num_batched_tokens=16))
    arch, params = TinyRandomSource(seed=0).load()
    prompts = {f"p{i}": [(13 * i + j) % 500 + 3 for j in range(3 + 5 * i)] for i in range(4)}
    toks = greedy_run(eng, prompts, 8)
    for rid, p in prompts.items():
        assert toks[rid] == dense_greedy(arch, params, p, 8), rid
    eng.shutdown()


def test_profile_on_cuda(tmp_path: object) -> None:
    eng = EngineCore(cfg())
    eng.profile("start", str(tmp_path))
    greedy_run(eng, {"x": [1, 2, 3]}, 3)
    assert eng.profile("stop").endswith(".json")  # type: ignore[union-attr]
    eng.shutdown()


def test_two_engines_on_cuda_serve_and_survive_one_loss() -> None:
    """Data parallel on the device: two engine cores share the GPU, requests spread over
    both, and the kill of one ends only its request."""
    import os
    import signal

    from enginewire.protocol.messages import FinishReason
    from enginewire.runtime import make_client

    config = cfg(data_parallel_size=2)
    with make_client(config, multiprocess=True, asyncio=False) as client:
        for i in range(4):
            client.add_request(EngineCoreRequest(f"g{i}", [1, 2, 3],
                                                 SamplingParams(max_tokens=8)))
        client.add_request(EngineCoreRequest("long", [1, 2], SamplingParams(max_tokens=200),
                                             data_parallel_rank=1))
        done: dict[str, FinishReason | None] = {}
        os.kill(client.engine_client(1).engine_pid, signal.SIGKILL)
        while len(done) < 5:
            batch = client.get_output(timeout=60.0)
            for o in batch.outputs:
                if o.finished:
                    done[o.request_id] = o.finish_reason
        assert done["long"] is FinishReason.ERROR
        assert client.dead_engines == [1]
        client.add_request(EngineCoreRequest("after", [1], SamplingParams(max_tokens=4)))
        while "after" not in done:
            for o in client.get_output(timeout=60.0).outputs:
                if o.finished:
                    done[o.request_id] = o.finish_reason
        assert done["after"] is FinishReason.LENGTH


def test_engines_join_and_leave_a_serving_client_on_cuda() -> None:
    """Elastic data parallel on the device (issue 46): a joiner starts on CUDA and serves; a
    drained leaver's requests finish before its process goes, and its device memory with it."""
    import os

    from enginewire.protocol.messages import FinishReason
    from enginewire.runtime import make_client
    from enginewire.spec import MembershipState

    def serve(client: object, rid: str, rank: int | None, n: int = 8) -> FinishReason | None:
        client.add_request(EngineCoreRequest(  # type: ignore[attr-defined]
            rid, [1, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True),
            data_parallel_rank=rank))
        while True:
            for o in client.get_output(timeout=60.0).outputs:  # type: ignore[attr-defined]
                if o.request_id == rid and o.finished:
                    return o.finish_reason

    with make_client(cfg(data_parallel_size=2), multiprocess=True, asyncio=False) as client:
        client.scale(3)
        assert client.engines == dict.fromkeys(range(3), MembershipState.SERVING)
        assert serve(client, "on2", 2) is FinishReason.LENGTH
        pid = client.engine_pids[2]
        assert pid is not None
        client.add_request(EngineCoreRequest("drained", [1, 2], SamplingParams(
            max_tokens=32, ignore_eos=True), data_parallel_rank=2))
        client.scale(2, drain=True, drain_timeout_s=60.0)
        assert client.data_parallel_size == 2
        ended = False
        while not ended:  # the leaver's request finished normally before it went
            for o in client.get_output(timeout=5.0).outputs:
                if o.request_id == "drained" and o.finished:
                    assert o.finish_reason is FinishReason.LENGTH
                    ended = True
        try:
            os.kill(pid, 0)
            raise AssertionError("the leaver's engine outlived scale()")
        except ProcessLookupError:
            pass
        assert serve(client, "after", None) is FinishReason.LENGTH
