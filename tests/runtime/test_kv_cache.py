"""Block accounting: allocation all-or-nothing, freeing, prefix caching, sizing refusals."""

from __future__ import annotations

import pytest

from enginewire.runtime.kv_cache import KVCacheManager, check_fits


class Req:
    def __init__(self, tokens: list[int]) -> None:
        self.all_token_ids = tokens
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.num_computed_tokens = 0


def test_allocate_grows_by_blocks_and_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=False)
    a, b = Req([1] * 9), Req([2] * 12)
    assert kv.allocate(a, 9) and len(a.block_ids) == 3
    assert kv.allocate(a, 12) and len(a.block_ids) == 3  # still fits in block 3
    assert not kv.allocate(b, 12)  # needs 3, only 2 free
    assert b.block_ids == [] and kv.num_free_blocks == 2
    assert kv.allocate(b, 8) and kv.num_free_blocks == 0
    assert kv.usage() == 1.0
    kv.free(a)
    assert a.block_ids == [] and kv.num_free_blocks == 3
    assert len(set(b.block_ids)) == 2


def test_prefix_cache_reuses_full_blocks_after_the_owner_finished() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10))
    a = Req(list(prompt))
    assert kv.claim_cached_prefix(a) == 0
    assert kv.allocate(a, 10)
    a.num_computed_tokens = 10
    kv.register_full_blocks(a)  # blocks 0 and 1 are full
    first_two = a.block_ids[:2]
    kv.free(a)
    b = Req([*list(prompt), 99])
    assert kv.claim_cached_prefix(b) == 8
    assert b.block_ids == first_two
    assert kv.prefix_hits == 2
    # A different prefix shares nothing.
    c = Req([7, *prompt[1:]])
    assert kv.claim_cached_prefix(c) == 0
    # A prompt that is exactly the cached blocks still leaves its last token to compute.
    d = Req(list(prompt[:8]))
    assert kv.claim_cached_prefix(d) == 4


def test_prompts_whose_python_hashes_collide_share_no_block() -> None:
    """Python's hash() of a token tuple collides by construction (an int hashes to itself
    modulo 2**61 - 1), so a peer could craft a prompt served another prompt's KV blocks. The
    chained BLAKE2b digest tells them apart."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    victim = [11, 12, 13, 14, 15]
    forged = [11 + (2**61 - 1), 12, 13, 14, 15]
    assert hash(tuple(victim[:4])) == hash(tuple(forged[:4]))  # the collision is real
    a = Req(victim)
    kv.allocate(a, 5)
    a.num_computed_tokens = 5
    kv.register_full_blocks(a)
    b = Req(forged)
    assert kv.claim_cached_prefix(b) == 0 and b.block_ids == []


def test_evicted_blocks_are_forgotten() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    a = Req([1, 2, 3])
    kv.allocate(a, 3)
    a.num_computed_tokens = 3
    kv.register_full_blocks(a)
    kv.free(a)
    other = Req([9, 9, 9, 9])
    assert kv.allocate(other, 4)  # takes both blocks, evicting the cached one
    kv.free(other)
    assert kv.claim_cached_prefix(Req([1, 2, 3])) == 0


def test_reset_prefix_cache_refused_while_blocks_in_use() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = Req([1, 2, 3])
    kv.allocate(a, 3)
    a.num_computed_tokens = 3
    kv.register_full_blocks(a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.claim_cached_prefix(Req([1, 2, 3])) == 0


def test_check_fits_names_the_numbers() -> None:
    check_fits(4, 16, 64, 100, 400, "budget")
    with pytest.raises(ValueError, match=r"max_model_len=65 needs 5 blocks.*gives 4 blocks"):
        check_fits(4, 16, 65, 100, 400, "budget")


def _order(kv: KVCacheManager) -> list[int]:
    """The pool's hand-out order: every free block taken, then given back as it was."""
    return list(kv._pool)


def _sequential_twin(caching: bool, build: list[tuple[list[int], int]]) -> tuple[
        KVCacheManager, KVCacheManager, list[Req], list[Req]]:
    """Two managers with the same history: requests allocated (and registered) alike."""
    pair = []
    for _ in range(2):
        kv = KVCacheManager(num_blocks=24, block_size=2, enable_prefix_caching=caching)
        reqs = []
        for tokens, n in build:
            r = Req(list(tokens))
            kv.claim_cached_prefix(r)
            assert kv.allocate(r, n)
            r.num_computed_tokens = n
            kv.register_full_blocks(r)
            reqs.append(r)
        pair.append((kv, reqs))
    (a, ra), (b, rb) = pair
    return a, b, ra, rb


@pytest.mark.parametrize("caching", [False, True])
def test_free_many_is_one_free_after_another(caching: bool) -> None:
    # With caching, the second and third requests share the first one's prefix blocks, and
    # two sharers end in the same batch: a shared block returns once, from its last holder.
    build = [([1, 2, 3, 4, 5], 5), ([1, 2, 3, 4, 9, 9], 6), ([1, 2, 3, 4, 7], 5),
             ([8, 8, 8], 3)]
    one, bulk, one_reqs, bulk_reqs = _sequential_twin(caching, build)
    if caching:
        assert one_reqs[1].block_ids[:2] == one_reqs[0].block_ids[:2]  # really shared
    for batch in ([0], [1, 2], [3]):  # [1, 2]: both sharers of the prefix end together
        for i in batch:
            one.free(one_reqs[i])
        bulk.free_many([bulk_reqs[i] for i in batch])
        assert _order(one) == _order(bulk)
        assert one.audit() == bulk.audit()
    audit = bulk.audit()
    assert audit.num_free_blocks == 24 and audit.total_refs == 0
    assert audit.unaccounted == audit.negative_refs == audit.free_and_referenced == 0
    assert all(r.block_ids == [] and r.num_registered_blocks == 0 for r in bulk_reqs)


def test_fifo_pool_hands_out_the_oldest_freed_and_refuses_a_claim() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=1, enable_prefix_caching=False)
    a, b = Req([1, 2]), Req([3, 4])
    kv.allocate(a, 2)
    kv.allocate(b, 2)
    kv.free_many([a, b])  # tail first within each request
    assert _order(kv)[-4:] == [1, 0, 3, 2]
    c = Req([5] * 6)
    assert kv.allocate(c, 6) and c.block_ids == [4, 5, 1, 0, 3, 2]
    with pytest.raises(RuntimeError, match="FIFO pool"):
        kv._pool.remove(0)


def test_a_double_free_shows_in_the_audit() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = Req([1, 2, 3])
    kv.allocate(a, 3)
    held = list(a.block_ids)
    kv.free_many([a])
    a.block_ids = held  # a bug hands the same blocks back again
    kv.free_many([a])
    audit = kv.audit()
    assert audit.negative_refs == 2 and kv.num_free_blocks == 4
