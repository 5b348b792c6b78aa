"""KV-cache block accounting: the pool, per-request block lists, optional prefix caching.

The manager owns block *ids* only; the tensors they index live in the worker. A request's
``block_ids`` cover its first ``len(block_ids) * block_size`` positions, in order.

Prefix caching (vLLM's design): a full block is named by a hash chained over the tokens of
every block before it, so equal hashes mean equal prefixes. The hash is BLAKE2b (128 bits),
not Python's ``hash()`` of a tuple: ints hash to themselves and the tuple mix does not resist
crafting, so a peer could compose a prompt whose block collides with another user's and be
served that user's KV (vLLM had a security advisory of this kind). A freed block keeps its
hash and stays findable until the pool hands it out again (least recently freed first), so a
repeated prompt reuses its blocks even after the first request finished.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np

from ..protocol.records import KVAudit

__all__ = ["KVCacheManager", "check_fits", "num_blocks_for"]


class _HasBlocks(Protocol):
    block_ids: list[int]
    block_hashes: list[bytes]
    num_registered_blocks: int
    all_token_ids: list[int]
    num_computed_tokens: int


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def check_fits(num_blocks: int, block_size: int, max_model_len: int, bytes_per_block: int,
               budget_bytes: int | float, budget_name: str, knob: str | None = None) -> None:
    """Refuse a pool that cannot hold even one sequence of ``max_model_len`` tokens. ``knob``
    is the setting to raise when the budget is derived (it defaults to ``budget_name``)."""
    need = num_blocks_for(max_model_len, block_size)
    if num_blocks < need:
        raise ValueError(
            f"KV cache too small: max_model_len={max_model_len} needs {need} blocks of "
            f"{block_size} tokens ({need * bytes_per_block} bytes at {bytes_per_block} "
            f"bytes/block), but {budget_name}={budget_bytes:.0f} bytes gives {num_blocks} blocks; "
            f"raise {knob or budget_name} or lower max_model_len to at most "
            f"{num_blocks * block_size}"
        )


class _FifoPool:
    """The free blocks without prefix caching: nothing takes a block back out of the pool,
    so a deque serves it, and a bulk ``give`` is one C-level extend (freeing a finished
    batch of 1024 requests returns 40k blocks; an OrderedDict insert each took 10 ms)."""

    __slots__ = ("_q",)

    def __init__(self, blocks: Iterable[int]) -> None:
        self._q = deque(blocks)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[int]:
        return iter(self._q)

    def take(self, n: int) -> list[int]:
        pop = self._q.popleft
        return [pop() for _ in range(n)]

    def give(self, blocks: list[int]) -> None:
        self._q.extend(blocks)

    def remove(self, block: int) -> None:
        # Only a cached prefix is claimed out of the pool, and this pool caches none.
        raise RuntimeError(f"block {block}: a FIFO pool gives no block back but the oldest")


class _LruPool(_FifoPool):
    """The free blocks with prefix caching: a cached block is claimed out of the middle of
    the pool when a new request shares its prefix, in O(1). An OrderedDict, not a dict:
    popping a plain dict's first key rescans the deleted slots in front of it, which made
    allocation O(pool size) (seen at 256 seqs)."""

    __slots__ = ("_od",)

    def __init__(self, blocks: Iterable[int]) -> None:
        self._od: OrderedDict[int, None] = OrderedDict.fromkeys(blocks)

    def __len__(self) -> int:
        return len(self._od)

    def __iter__(self) -> Iterator[int]:
        return iter(self._od)

    def take(self, n: int) -> list[int]:
        pop = self._od.popitem
        return [pop(last=False)[0] for _ in range(n)]

    def give(self, blocks: list[int]) -> None:
        od = self._od
        for block in blocks:
            od[block] = None

    def remove(self, block: int) -> None:
        del self._od[block]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks, the oldest freed handed out first.
        self._pool = self._new_pool()
        # References per block, an array: freeing a batch's blocks is a few vector ops.
        self._ref = np.zeros(num_blocks, np.int32)
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt blocks looked up
        self.prefix_hits = 0  # of which were found

    def _new_pool(self) -> _FifoPool:
        pool = _LruPool if self.enable_prefix_caching else _FifoPool
        return pool(range(self.num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._pool)

    def usage(self) -> float:
        return 1.0 - len(self._pool) / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._pool)

    def allocate(self, req: _HasBlocks, num_total_tokens: int) -> bool:
        """Grow ``req``'s blocks to cover ``num_total_tokens``; False (nothing taken) if short."""
        need = -(-num_total_tokens // self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        if need > len(self._pool):
            return False
        new = self._pool.take(need)
        if self._cached:  # evict: their content is about to be overwritten
            hash_of, cached = self._hash_of, self._cached
            for block in new:
                h = hash_of[block]
                if h is not None:
                    hash_of[block] = None
                    if cached.get(h) == block:
                        del cached[h]
        ref = self._ref
        for block in new:  # a scalar store each: a fancy index costs more at these sizes
            ref[block] = 1
        req.block_ids.extend(new)
        return True

    def free(self, req: _HasBlocks) -> None:
        self.free_many((req,))

    def free_many(self, reqs: Iterable[_HasBlocks]) -> None:
        """Drop each request's references, in order; a block whose last reference goes
        returns to the pool. A request's tail blocks go back first so they are reused first:
        the shared prefix lives longest."""
        blocks: list[int] = []
        add = blocks.extend
        for req in reqs:
            if req.block_ids:
                add(reversed(req.block_ids))
                req.block_ids = []
            req.num_registered_blocks = 0
        if not blocks:
            return
        ref = self._ref
        held = np.array(blocks, np.intp)
        shared = len(blocks) > 1 and int(ref[held].max()) > 1
        if shared:  # subtract.at counts a block held twice in ``held`` twice (5x slower)
            np.subtract.at(ref, held, 1)
        else:
            ref[held] -= 1
        gone = held[ref[held] == 0].tolist()
        if shared:
            # A shared block is free from its last holder on, as one free at a time has it.
            gone = list(dict.fromkeys(reversed(gone)))[::-1]
        self._pool.give(gone)

    # -- prefix caching ------------------------------------------------------------------------

    def _extend_hashes(self, req: _HasBlocks, num_full_blocks: int) -> None:
        hashes, toks, bs = req.block_hashes, req.all_token_ids, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            h = hashlib.blake2b(hashes[-1] if hashes else b"", digest_size=16)
            h.update(array("q", toks[i * bs:(i + 1) * bs]).tobytes())
            hashes.append(h.digest())

    def claim_cached_prefix(self, req: _HasBlocks) -> int:
        """Attach cached blocks for ``req``'s longest cached prefix; return the tokens covered.

        At least one token is always left to compute, since the step that computes it samples
        the next token.
        """
        if not self.enable_prefix_caching or req.block_ids:
            return 0
        max_blocks = (len(req.all_token_ids) - 1) // self.block_size
        self._extend_hashes(req, max_blocks)
        self.prefix_queries += max_blocks
        for h in req.block_hashes[:max_blocks]:
            block = self._cached.get(h)
            if block is None:
                break
            if self._ref[block] == 0:
                self._pool.remove(block)
            self._ref[block] += 1
            req.block_ids.append(block)
        n = len(req.block_ids)
        self.prefix_hits += n
        req.num_registered_blocks = n
        return n * self.block_size

    def register_full_blocks(self, req: _HasBlocks) -> None:
        """Publish ``req``'s newly computed full blocks under their prefix hashes."""
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_registered_blocks:
            return
        self._extend_hashes(req, full)
        for i in range(req.num_registered_blocks, full):
            h, block = req.block_hashes[i], req.block_ids[i]
            if h not in self._cached and self._hash_of[block] is None:
                self._cached[h] = block
                self._hash_of[block] = h
        req.num_registered_blocks = full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use, like vLLM."""
        if len(self._pool) != self.num_blocks:
            return False
        self._cached.clear()
        self._hash_of = [None] * self.num_blocks
        return True

    def reset(self) -> None:
        """Everything free, nothing cached: the KV tensors were released or replaced."""
        self._pool = self._new_pool()
        self._ref = np.zeros(self.num_blocks, np.int32)
        self._hash_of = [None] * self.num_blocks
        self._cached.clear()

    def blocks_in_use(self) -> Sequence[int]:
        return np.flatnonzero(self._ref > 0).tolist()

    def audit(self) -> KVAudit:
        """The accounting recounted from the block table, not from running counters, so a
        leak or a double free shows (the campaign's quiescence check, model_tests/oracle.py).
        A free block may still hold a cached prefix: caching evicts lazily, on reuse."""
        ref = self._ref
        free = np.fromiter(self._pool, np.intp, len(self._pool))
        in_pool = np.zeros(self.num_blocks, bool)
        in_pool[free] = True
        return KVAudit(
            num_blocks=self.num_blocks,
            num_free_blocks=len(free),
            referenced=int(np.count_nonzero(ref > 0)),
            total_refs=int(ref[ref > 0].sum()),
            negative_refs=int(np.count_nonzero(ref < 0)),
            free_and_referenced=int(np.count_nonzero(ref[free] != 0)),
            unaccounted=int(np.count_nonzero((ref == 0) & ~in_pool)),
            cached=len(self._cached),
            cache_mismatch=sum(1 for h, b in self._cached.items() if self._hash_of[b] != h),
        )


def blocks_from_budget(budget_bytes: int | float, bytes_per_block: int) -> int:
    return max(0, math.floor(budget_bytes / bytes_per_block))
