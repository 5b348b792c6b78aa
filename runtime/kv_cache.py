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
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

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


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Ordered free set: pop the oldest freed, O(1) removal of a cached block a new request
        # claims. An OrderedDict, not a dict: popping a plain dict's first key rescans the
        # deleted slots in front of it, which made allocation O(pool size) (seen at 256 seqs).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt blocks looked up
        self.prefix_hits = 0  # of which were found

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, req: _HasBlocks, num_total_tokens: int) -> bool:
        """Grow ``req``'s blocks to cover ``num_total_tokens``; False (nothing taken) if short."""
        need = -(-num_total_tokens // self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        free = self._free
        if need > len(free):
            return False
        ids = req.block_ids
        for _ in range(need):
            block = free.popitem(last=False)[0]
            h = self._hash_of[block]
            if h is not None:  # evict: its content is about to be overwritten
                self._hash_of[block] = None
                if self._cached.get(h) == block:
                    del self._cached[h]
            self._ref[block] = 1
            ids.append(block)
        return True

    def free(self, req: _HasBlocks) -> None:
        # Tail blocks go back first so they are reused first: the shared prefix lives longest.
        for block in reversed(req.block_ids):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
        req.block_ids = []
        req.num_registered_blocks = 0

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
                del self._free[block]
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
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._hash_of = [None] * self.num_blocks
        return True

    def reset(self) -> None:
        """Everything free, nothing cached: the KV tensors were released or replaced."""
        self._free = OrderedDict.fromkeys(range(self.num_blocks))
        self._ref = [0] * self.num_blocks
        self._hash_of = [None] * self.num_blocks
        self._cached.clear()

    def blocks_in_use(self) -> Sequence[int]:
        return [b for b in range(self.num_blocks) if self._ref[b] > 0]

    def audit(self) -> dict[str, int]:
        """The accounting recounted from the block table, not from running counters, so a
        leak or a double free shows (the campaign's quiescence check, model_tests/oracle.py).
        A free block may still hold a cached prefix: caching evicts lazily, on reuse."""
        ref, free = self._ref, self._free
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": len(free),
            "referenced": sum(1 for r in ref if r > 0),
            "total_refs": sum(r for r in ref if r > 0),
            "negative_refs": sum(1 for r in ref if r < 0),
            "free_and_referenced": sum(1 for b in free if ref[b] != 0),
            "unaccounted": sum(1 for b, r in enumerate(ref) if r == 0 and b not in free),
            "cached": len(self._cached),
            "cache_mismatch": sum(1 for h, b in self._cached.items() if self._hash_of[b] != h),
        }


def blocks_from_budget(budget_bytes: int | float, bytes_per_block: int) -> int:
    return max(0, math.floor(budget_bytes / bytes_per_block))
