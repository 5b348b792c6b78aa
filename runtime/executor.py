"""Model execution: workers that own weights and KV tensors, and the executor that fans out.

One worker today (``UniProcExecutor``); ``collective_rpc`` already calls a method on every
worker and returns their results in rank order, so a multi-worker executor changes nothing
above it. Only names in a worker's ``RPC_METHODS`` can be called that way: the method name
arrives over the wire, and ``getattr`` on an arbitrary name would let a peer call anything.

Memory states. A worker holds two tags, ``weights`` and ``kv_cache``, each resident or
released. ``sleep(1)`` moves weights to host memory and drops the KV tensors; ``sleep(2)``
drops both, and ``wake_up`` of the weights then reloads them from the ``WeightSource``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .config import EngineConfig
from .kv_cache import blocks_from_budget, check_fits
from .model import (
    NULL_FIRST_TOKEN,
    NULL_INDEX_MUL,
    NULL_SEED_MUL,
    TINY_ARCH,
    LlamaArch,
    LlamaModel,
    WeightSource,
    build_attention_metadata,
    kv_bytes_per_block,
    resolve_weight_source,
)
from .sampling import sample
from .scheduler import DecodeBatch, Request

# torch is imported where tensors are made: a null-model engine (NullWorker) never loads it,
# which keeps its start, and every restart in a campaign, well under a second.
if TYPE_CHECKING:
    import torch

__all__ = ["MEMORY_TAGS", "CudaMemory", "NullWorker", "TorchWorker", "UniProcExecutor", "Worker",
           "make_worker"]

MEMORY_TAGS = ("weights", "kv_cache")

def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name)  # EngineConfig.DTYPES are torch attribute names
    assert isinstance(dtype, torch.dtype)
    return dtype


class CudaMemory:
    """The allocator readings the CUDA paths take (KV sizing, memory reports, sleep), behind
    one seam: a CPU test substitutes a fake with the same methods to drive those paths."""

    def __init__(self, device: str) -> None:
        import torch

        self.device = device
        self._cuda = torch.cuda

    def synchronize(self) -> None:
        self._cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        self._cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return int(self._cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(self._cuda.max_memory_allocated(self.device))

    def release_cached(self) -> None:
        """Hand the allocator's cached blocks back to the driver, so the device's free memory
        (what ``mem_get_info`` and other processes see) actually grows."""
        self._cuda.empty_cache()

    def free_and_total(self) -> tuple[int, int]:
        free, total = self._cuda.mem_get_info(self.device)
        return int(free), int(total)


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


class Worker:
    """What every worker provides; ``RPC_METHODS`` is what ``collective_rpc`` may call."""

    RPC_METHODS = frozenset({"ping", "report_memory", "describe"})
    # Whether a forward lets other threads run (torch kernels, device waits release the GIL):
    # only then does encoding outputs on another thread overlap the next step.
    forward_releases_gil = True
    # Whether ``execute_decode`` can run a steady decode step from a ``DecodeBatch``.
    supports_decode_batch = False

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = config.resolved_device()
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError(
                    f"EngineConfig.device={config.device!r}: no CUDA device is visible")
        # Set on a worker that places tensors on a CUDA device; None sizes the pool from
        # kv_cache_memory_bytes (the CPU, and the null model, which places none).
        self.memory: CudaMemory | None = None
        self.arch: LlamaArch = TINY_ARCH
        self.num_blocks = 0
        self.profiled_num_blocks: int | None = None
        self.sleeping: set[str] = set()
        self.sleep_level = 0

    # Subclasses fill these in.
    def load_model(self) -> None: ...
    def init_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
    def execute_model(self, reqs: list[Request], nums: list[int]) -> list[int]:
        raise NotImplementedError
    def execute_decode(self, batch: DecodeBatch) -> Any:
        """One token for every row of ``batch`` (an int64 array): each row's input is its
        last token, at position ``ntok - 1``."""
        raise NotImplementedError
    def device_tensors(self) -> list[torch.Tensor]:
        return []
    def host_tensors(self) -> list[torch.Tensor]:
        return []
    def sleep(self, level: int) -> None: ...
    def wake_up(self, tags: Sequence[str]) -> None: ...
    def named_weights(self) -> dict[str, torch.Tensor]:
        return {}
    def shutdown(self) -> None: ...

    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.arch, self.config.block_size, self.config.dtype)

    def determine_num_blocks(self) -> int:
        """Size the block pool from the budget; refuse a pool that cannot hold one sequence."""
        cfg, per = self.config, self.bytes_per_block()
        if cfg.num_gpu_blocks_override is not None:
            n = cfg.num_gpu_blocks_override
            check_fits(n, cfg.block_size, cfg.max_model_len, per, n * per,
                       "num_gpu_blocks_override*bytes_per_block")
            return n
        if self.memory is not None:
            budget, detail = self.profile_free_bytes()
            n = blocks_from_budget(budget, per)
            self.profiled_num_blocks = n
            check_fits(n, cfg.block_size, cfg.max_model_len, per, budget,
                       f"the profiled KV budget ({detail})", knob="gpu_memory_utilization")
            return min(n, cfg.max_num_gpu_blocks)
        n = blocks_from_budget(cfg.kv_cache_memory_bytes, per)
        check_fits(n, cfg.block_size, cfg.max_model_len, per, cfg.kv_cache_memory_bytes,
                   "kv_cache_memory_bytes")
        return n

    def profile_free_bytes(self) -> tuple[float, str]:
        """CUDA: bytes the KV cache may take after weights and a peak-sized forward pass, and
        the readings it came from, for the refusal message."""
        raise NotImplementedError(f"{type(self).__name__} does not profile device memory")

    # -- RPC-callable --------------------------------------------------------------------------

    def ping(self) -> str:
        return f"pong from rank {self.rank}"

    def report_memory(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "device_tensor_bytes": _storage_bytes(self.device_tensors()),
            "host_offload_bytes": _storage_bytes(self.host_tensors()),
            "sleeping": sorted(self.sleeping),
        }
        if self.memory is not None:
            out["cuda_memory_allocated"] = self.memory.allocated()
        return out

    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "device": self.device, "dtype": self.config.dtype,
                "model": self.config.model, "num_blocks": self.num_blocks,
                "vocab_size": self.arch.vocab_size}


class TorchWorker(Worker):
    """Runs a ``LlamaModel`` over paged KV tensors."""

    def __init__(self, config: EngineConfig, source: WeightSource, rank: int = 0) -> None:
        super().__init__(config, rank)
        self.dtype = _torch_dtype(config.dtype)
        self.source = source
        self.model: LlamaModel | None = None
        self.kv_caches: list[torch.Tensor] = []
        self._host_weights: dict[str, torch.Tensor] = {}
        if self.device.startswith("cuda"):
            self.memory = CudaMemory(self.device)

    def _materialize(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(device=self.device, dtype=self.dtype) for k, v in params.items()}

    def load_model(self) -> None:
        arch, params = self.source.load()
        self.arch = arch
        self.model = LlamaModel(arch, self._materialize(params), self.device)

    def _alloc_kv(self, num_blocks: int) -> list[torch.Tensor]:
        import torch

        a, slots = self.arch, num_blocks * self.config.block_size
        return [torch.zeros(2, slots, a.num_kv_heads, a.head_dim, dtype=self.dtype,
                            device=self.device) for _ in range(a.num_layers)]

    def init_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.kv_caches = self._alloc_kv(num_blocks)

    def profile_free_bytes(self) -> tuple[float, str]:
        import torch

        assert self.model is not None and self.memory is not None
        cfg, dev, mem = self.config, self.device, self.memory
        mem.synchronize()
        mem.reset_peak()
        before = mem.allocated()
        # A dummy forward at the full token budget, in chunks a sequence can hold, measures
        # the activation peak the KV cache must leave room for.
        t = min(cfg.max_num_batched_tokens, self.arch.max_position)
        nblk = -(-t // cfg.block_size)
        caches = self._alloc_kv(nblk)
        meta = build_attention_metadata([range(t)], [list(range(nblk))], cfg.block_size, dev)
        ids = torch.zeros(t, dtype=torch.long, device=dev)
        with torch.inference_mode():
            self.model.compute_logits(self.model.forward(ids, meta, caches, cfg.block_size))
        mem.synchronize()
        peak_extra = mem.peak() - before
        del caches, meta, ids
        mem.release_cached()
        free, total = mem.free_and_total()
        used = total - free  # weights, the CUDA context, and other processes on the device
        budget = total * cfg.gpu_memory_utilization - used - peak_extra
        detail = (f"gpu_memory_utilization={cfg.gpu_memory_utilization} of {total} bytes, "
                  f"minus {used} in use, minus a {peak_extra}-byte activation peak at "
                  f"{t} tokens")
        return budget, detail

    def execute_model(self, reqs: list[Request], nums: list[int]) -> list[int]:
        ids: list[int] = []
        ranges: list[range] = []
        tables: list[list[int]] = []
        last: list[int] = []  # flat index of the last token of each sequence that samples
        samplers: list[int] = []
        for k, (req, n) in enumerate(zip(reqs, nums, strict=False)):
            start = req.num_computed_tokens
            ids.extend(req.all_token_ids[start:start + n])
            ranges.append(range(start, start + n))
            tables.append(req.block_ids)
            if start + n == len(req.all_token_ids):
                last.append(len(ids) - 1)
                samplers.append(k)
        return self._run(reqs, ids, ranges, tables, last, samplers)

    supports_decode_batch = True

    def execute_decode(self, batch: DecodeBatch) -> Any:
        # Each row computes its last token at position ntok - 1 and samples the next.
        n = len(batch)
        every = list(range(n))
        tokens = self._run(batch.reqs, batch.last.tolist(),
                           [range(t - 1, t) for t in batch.ntok.tolist()],
                           [r.block_ids for r in batch.reqs], every, every)
        return batch.np.array(tokens, dtype=batch.np.int64)

    def _run(self, reqs: list[Request], ids: list[int], ranges: list[range],
             tables: list[list[int]], last: list[int], samplers: list[int]) -> list[int]:
        import torch

        assert self.model is not None and self.kv_caches, "execute_model while asleep"
        bs = self.config.block_size
        meta = build_attention_metadata(ranges, tables, bs, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        tokens = [-1] * len(reqs)
        with torch.inference_mode():
            hidden = self.model.forward(input_ids, meta, self.kv_caches, bs)
            if samplers:
                logits = self.model.compute_logits(hidden[torch.tensor(last, device=self.device)])
                picked = sample(logits, [reqs[k] for k in samplers])
                for k, tok in zip(samplers, picked, strict=True):
                    tokens[k] = tok
        return tokens

    def device_tensors(self) -> list[torch.Tensor]:
        ts = list(self.kv_caches)
        if self.model is not None:
            ts.extend(self.model.params.values())
        return ts

    def host_tensors(self) -> list[torch.Tensor]:
        return list(self._host_weights.values())

    def named_weights(self) -> dict[str, torch.Tensor]:
        if self.model is not None:
            return self.model.params
        if self._host_weights:
            return self._host_weights
        raise RuntimeError("weights are released (sleep level 2); wake_up first")

    def sleep(self, level: int) -> None:
        self.kv_caches = []  # the only reference: the storage is freed here
        self.sleeping.add("kv_cache")
        if self.model is not None:
            if level >= 2:
                self.model = None
            else:
                self._host_weights = {k: v.to("cpu") for k, v in self.model.params.items()}
                self.model = None
            self.sleeping.add("weights")
        elif level >= 2:
            self._host_weights = {}  # deeper sleep: drop the host copy too
        self.sleep_level = max(self.sleep_level, level)
        if self.memory is not None:
            self.memory.release_cached()

    def wake_up(self, tags: Sequence[str]) -> None:
        if "weights" in tags and "weights" in self.sleeping:
            if self._host_weights:
                params = self._materialize(self._host_weights)
            else:  # level 2: reload from the source
                arch, raw = self.source.load()
                self.arch = arch
                params = self._materialize(raw)
            self.model = LlamaModel(self.arch, params, self.device)
            self._host_weights = {}
            self.sleeping.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.sleeping:
            self.kv_caches = self._alloc_kv(self.num_blocks)
            self.sleeping.discard("kv_cache")
        if not self.sleeping:
            self.sleep_level = 0

    def shutdown(self) -> None:
        self.kv_caches = []
        self.model = None
        self._host_weights = {}
        if self.memory is not None:
            self.memory.release_cached()
        # A source may hold the weights file open for reloads (a GGUF reader maps it): a
        # shut-down engine reloads nothing, and its caller may live on (an in-process client).
        close = getattr(self.source, "close", None)
        if callable(close):
            close()


class NullWorker(Worker):
    """No tensors, no matmuls: tokens are ``null_token(seed, index)`` inlined for speed."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        super().__init__(config, rank)
        self.delay = config.null_step_delay_s
        self.forward_releases_gil = self.delay > 0  # the sleep is its only GIL-free time

    def execute_model(self, reqs: list[Request], nums: list[int]) -> list[int]:
        if self.delay:
            time.sleep(self.delay)  # stands in for device compute time, releasing the GIL
        first, smul, imul = NULL_FIRST_TOKEN, NULL_SEED_MUL, NULL_INDEX_MUL
        span = self.arch.vocab_size - first  # model.null_token, inlined: tested equal
        # A comprehension: this runs once per request per step, and it is the whole "model".
        return [
            first + (req.seed * smul + index * imul) % span
            if (index := req.num_computed_tokens + n) == req.num_tokens else -1
            for req, n in zip(reqs, nums, strict=False)
        ]

    supports_decode_batch = True

    def execute_decode(self, batch: DecodeBatch) -> Any:
        if self.delay:
            time.sleep(self.delay)
        span = self.arch.vocab_size - NULL_FIRST_TOKEN
        base = batch.cols.get("null_base")
        if base is None:  # once per batch: the seed's share of the formula, mod span (a seed
            # may not fit in int64; the remainder does)
            base = batch.cols["null_base"] = batch.np.fromiter(
                ((r.seed * NULL_SEED_MUL) % span for r in batch.reqs), batch.np.int64,
                len(batch))
        # The row's index is ntok: model.null_token, column-wise.
        return NULL_FIRST_TOKEN + (base + batch.ntok * NULL_INDEX_MUL) % span

    def sleep(self, level: int) -> None:
        self.sleeping.update(MEMORY_TAGS)
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self, tags: Sequence[str]) -> None:
        self.sleeping.difference_update(tags)
        if not self.sleeping:
            self.sleep_level = 0


def make_worker(config: EngineConfig, rank: int = 0) -> Worker:
    if config.model == "null":
        return NullWorker(config, rank)
    return TorchWorker(config, resolve_weight_source(config.model, config.seed), rank)


class UniProcExecutor:
    """One worker in this process."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.workers: list[Worker] = [make_worker(config)]
        self.driver = self.workers[0]

    def initialize(self) -> int:
        """Load weights, size and allocate the KV cache; return the block count."""
        for w in self.workers:
            w.load_model()
        num_blocks = min(w.determine_num_blocks() for w in self.workers)
        for w in self.workers:
            w.init_kv_cache(num_blocks)
        return num_blocks

    @property
    def arch(self) -> LlamaArch:
        return self.driver.arch

    @property
    def forward_releases_gil(self) -> bool:
        return all(w.forward_releases_gil for w in self.workers)

    def execute_model(self, reqs: list[Request], nums: list[int]) -> list[int]:
        return self.driver.execute_model(reqs, nums)

    @property
    def supports_decode_batch(self) -> bool:
        return all(w.supports_decode_batch for w in self.workers)

    def execute_decode(self, batch: DecodeBatch) -> Any:
        return self.driver.execute_decode(batch)

    def collective_rpc(self, method: str, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        if not isinstance(method, str) or method not in Worker.RPC_METHODS:
            raise ValueError(
                f"collective_rpc: {method!r} is not a worker RPC method; "
                f"allowed: {sorted(Worker.RPC_METHODS)}"
            )
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    def sleep(self, level: int) -> None:
        for w in self.workers:
            w.sleep(level)

    def wake_up(self, tags: Sequence[str]) -> None:
        for w in self.workers:
            w.wake_up(tags)

    @property
    def sleeping(self) -> set[str]:
        return self.driver.sleeping

    def save_sharded_state(self, path: str) -> list[str]:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        files = []
        for w in self.workers:
            weights = {k: v.detach().contiguous().cpu() for k, v in w.named_weights().items()}
            f = os.path.join(path, f"model-rank-{w.rank}-part-0.safetensors")
            save_file(weights, f, metadata={"model": self.config.model, "rank": str(w.rank)})
            files.append(f)
        return files

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
