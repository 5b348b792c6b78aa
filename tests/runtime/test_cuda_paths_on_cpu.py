"""The CUDA paths' control flow and arithmetic, driven on the CPU through the ``CudaMemory``
seam: profiling-based KV sizing (and its refusal with the numbers), the memory report, and the
cache release on sleep and shutdown. The real allocator readings are covered by the ``gpu``
tests (tests/runtime/test_gpu.py); these run everywhere, so a broken sizing formula or a
missed release fails here first."""

from __future__ import annotations

import math

import pytest

from enginewire.runtime import executor as executor_mod
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.engine import EngineCore
from enginewire.runtime.executor import TorchWorker, Worker
from enginewire.runtime.model import TinyRandomSource, kv_bytes_per_block


class FakeMemory:
    """Readings a test chooses: ``base`` bytes allocated before the dummy forward, an
    activation ``peak`` above it, and the device's free/total. Every call is logged."""

    def __init__(self, *, total: int, free: int, base: int = 1000, peak: int = 0) -> None:
        self.total, self.free, self.base, self.extra = total, free, base, peak
        self.calls: list[str] = []

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def allocated(self) -> int:
        self.calls.append("allocated")
        return self.base

    def peak(self) -> int:
        self.calls.append("peak")
        return self.base + self.extra

    def release_cached(self) -> None:
        self.calls.append("release_cached")

    def free_and_total(self) -> tuple[int, int]:
        self.calls.append("free_and_total")
        return self.free, self.total


def cfg(**kw: object) -> EngineConfig:
    base: dict[str, object] = {"model": "tiny", "device": "cpu", "max_num_batched_tokens": 64,
                               "max_model_len": 128}
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def worker(config: EngineConfig, mem: FakeMemory) -> TorchWorker:
    w = TorchWorker(config, TinyRandomSource(seed=config.seed))
    w.load_model()
    w.memory = mem  # type: ignore[assignment]
    return w


PER = kv_bytes_per_block(TinyRandomSource(seed=0).load()[0], 16, "float32")


def test_blocks_come_from_utilization_minus_used_minus_the_activation_peak() -> None:
    total, free, peak = 10**9, 9 * 10**8, 5 * 10**6
    mem = FakeMemory(total=total, free=free, peak=peak)
    w = worker(cfg(gpu_memory_utilization=0.3), mem)
    seen: list[int] = []
    forward = w.model.forward  # type: ignore[union-attr]

    def spy(ids, *a, **k):  # type: ignore[no-untyped-def]
        mem.calls.append("forward")
        seen.append(int(ids.shape[0]))
        return forward(ids, *a, **k)

    w.model.forward = spy  # type: ignore[method-assign, union-attr]
    n = w.determine_num_blocks()
    expect = math.floor((total * 0.3 - (total - free) - peak) / PER)
    assert n == expect == w.profiled_num_blocks and n > 0
    # The peak is reset before the dummy forward, read after it, and free memory is read only
    # once the dummy's cache has been handed back.
    order = [c for c in mem.calls if c in ("reset_peak", "forward", "peak", "release_cached",
                                           "free_and_total")]
    assert order == ["reset_peak", "forward", "peak", "release_cached", "free_and_total"]
    assert seen == [64]  # the full batched-token budget, in one sequence


def test_the_dummy_forward_is_bounded_by_the_model_positions() -> None:
    mem = FakeMemory(total=10**9, free=10**9)
    w = worker(cfg(max_num_batched_tokens=1 << 20, max_model_len=128), mem)
    seen: list[int] = []
    forward = w.model.forward  # type: ignore[union-attr]
    w.model.forward = lambda ids, *a, **k: (seen.append(int(ids.shape[0])),  # type: ignore[method-assign, union-attr]
                                            forward(ids, *a, **k))[1]
    w.determine_num_blocks()
    assert seen == [w.arch.max_position]


def test_a_profiled_pool_is_capped_by_max_num_gpu_blocks_but_reports_what_it_measured() -> None:
    mem = FakeMemory(total=10**10, free=10**10)
    w = worker(cfg(gpu_memory_utilization=0.5, max_num_gpu_blocks=100), mem)
    assert w.determine_num_blocks() == 100
    assert w.profiled_num_blocks == math.floor((10**10 * 0.5 - mem.extra) / PER) > 100


def test_an_override_skips_profiling() -> None:
    mem = FakeMemory(total=10**9, free=10**9)
    w = worker(cfg(num_gpu_blocks_override=12), mem)
    assert w.determine_num_blocks() == 12
    assert "reset_peak" not in mem.calls and w.profiled_num_blocks is None


def test_a_budget_too_small_for_one_sequence_is_refused_with_the_numbers() -> None:
    total, peak = 10**9, 7_000_000
    free = total - (3 * 10**8 - peak - 10 * PER)  # leaves 10 blocks; 256 tokens need 16
    mem = FakeMemory(total=total, free=free, peak=peak)
    w = worker(cfg(gpu_memory_utilization=0.3, max_model_len=256), mem)
    with pytest.raises(ValueError) as err:
        w.determine_num_blocks()
    msg = str(err.value)
    for piece in ("max_model_len=256", "gpu_memory_utilization=0.3", f"of {total} bytes",
                  f"minus {total - free} in use", f"{peak}-byte activation peak",
                  "raise gpu_memory_utilization or lower max_model_len"):
        assert piece in msg, (piece, msg)


def test_memory_report_sleep_and_shutdown_go_through_the_probe() -> None:
    mem = FakeMemory(total=10**9, free=10**9, base=4242)
    w = worker(cfg(), mem)
    w.init_kv_cache(w.determine_num_blocks())
    assert w.report_memory()["cuda_memory_allocated"] == 4242
    mem.calls.clear()
    w.sleep(1)
    assert mem.calls == ["release_cached"]  # freed tensors reach the driver, not just the cache
    w.wake_up(["weights", "kv_cache"])
    mem.calls.clear()
    w.shutdown()
    assert mem.calls == ["release_cached"]


def test_a_cpu_worker_and_the_null_worker_size_from_the_cpu_budget() -> None:
    assert TorchWorker(cfg(), TinyRandomSource(seed=0)).memory is None
    null = executor_mod.make_worker(cfg(model="null"))
    assert null.memory is None and "cuda_memory_allocated" not in null.report_memory()
    with pytest.raises(NotImplementedError):
        Worker(cfg()).profile_free_bytes()


def test_an_engine_built_on_a_profiled_worker_reports_the_profiled_pool(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mem = FakeMemory(total=10**9, free=9 * 10**8, peak=10**6)
    config = cfg(gpu_memory_utilization=0.2, max_num_gpu_blocks=50_000)
    monkeypatch.setattr(executor_mod, "make_worker",
                        lambda c, rank=0: worker(c, mem))
    eng = EngineCore(config)
    try:
        expect = math.floor((10**9 * 0.2 - 10**8 - 10**6) / PER)
        assert eng.ready_info()["num_gpu_blocks"] == expect
        stats = eng.get_stats()
        assert stats.profiled_num_blocks == expect
        mem.calls.clear()
        eng.sleep(1)
        assert "release_cached" in mem.calls
        assert eng.wake_up()
    finally:
        eng.shutdown()
