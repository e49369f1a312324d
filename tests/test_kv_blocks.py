"""The KV block pool: allocation, release, reference counts and prefix caching keep free + used + cached == total."""

from __future__ import annotations

from metrale.engine_core.kv_blocks import KvBlockPool
from metrale.engine_core.sequence import Sequence
from metrale.ipc.sampling import SamplingParams
from metrale.testing.invariants import check_pool


def seq(tokens: list[int], rid: str = "r", cache_salt: str | None = None) -> Sequence:
    return Sequence.of(rid, SamplingParams(), 0, list(tokens), len(tokens), 0, cache_salt=cache_salt)


def test_allocate_covers_tokens_and_free_returns_every_block():
    pool = KvBlockPool(8, 4)
    s = seq(range(10))
    assert pool.allocate(s, 10) and len(pool.blocks(s)) == 3
    assert pool.allocate(s, 12) and len(pool.blocks(s)) == 3
    assert pool.allocate(s, 13) and len(pool.blocks(s)) == 4
    check_pool(pool)
    pool.free(s)
    assert pool.num_free == 8 and not pool.blocks(s)
    check_pool(pool)


def test_dry_pool_takes_nothing():
    pool = KvBlockPool(2, 4)
    s = seq(range(12))
    assert not pool.allocate(s, 12)
    assert pool.blocks(s) == [] and pool.num_free == 2


def test_trim_gives_back_only_blocks_beyond_the_kept_tokens():
    pool = KvBlockPool(4, 4)
    s = seq(range(8))
    pool.allocate(s, 9)
    pool.trim(s, 8)
    assert len(pool.blocks(s)) == 2 and pool.num_free == 2
    check_pool(pool)


def test_prefix_cache_reuses_settled_full_blocks_and_counts_hits():
    pool = KvBlockPool(16, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    pool.allocate(a, 9)
    a.num_computed = 9
    pool.cache_full_blocks(a)
    pool.free(a)
    assert pool.num_cached == 2 and pool.num_used == 0
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43], "b")
    assert pool.match_prefix(b) == 8
    assert len(pool.blocks(b)) == 2 and pool.num_cached == 0 and pool.num_used == 2
    check_pool(pool)
    assert pool.stats.hit_tokens == 8


def test_prefix_cache_always_leaves_one_token_to_compute():
    pool = KvBlockPool(16, 4)
    a = seq(range(8), "a")
    pool.allocate(a, 8)
    a.num_computed = 8
    pool.cache_full_blocks(a)
    pool.free(a)
    b = seq(range(8), "b")
    assert pool.match_prefix(b) == 4


def test_shared_blocks_are_reference_counted():
    pool = KvBlockPool(16, 4)
    a = seq(range(9), "a")
    pool.allocate(a, 9)
    a.num_computed = 9
    pool.cache_full_blocks(a)
    b = seq(list(range(8)) + [99], "b")
    assert pool.match_prefix(b) == 8
    assert pool.refcount[pool.blocks(a)[0]] == 2
    pool.free(a)
    assert pool.num_used == 2  # b still holds the shared head
    pool.free(b)
    check_pool(pool)
    assert pool.num_used == 0


def test_cached_blocks_are_evicted_lru_when_free_memory_is_needed():
    pool = KvBlockPool(3, 4)
    a = seq(range(9), "a")
    pool.allocate(a, 9)
    a.num_computed = 9
    pool.cache_full_blocks(a)
    pool.free(a)
    big = seq(range(100, 112), "big")
    assert pool.allocate(big, 12)
    assert pool.num_cached == 0
    check_pool(pool)
    c = seq(range(9), "c")
    pool.free(big)
    assert pool.match_prefix(c) == 0


def test_prefix_caching_off_never_matches():
    pool = KvBlockPool(8, 4, enable_prefix_caching=False)
    a = seq(range(9), "a")
    pool.allocate(a, 9)
    a.num_computed = 9
    pool.cache_full_blocks(a)
    pool.free(a)
    assert pool.num_cached == 0 and pool.match_prefix(seq(range(9), "b")) == 0


def _cache(pool: KvBlockPool, s: Sequence) -> None:
    """Allocate, 'compute' and cache every full block of s, then free it (its blocks stay cached)."""
    pool.allocate(s, s.num_tokens)
    s.num_computed = s.num_tokens
    pool.cache_full_blocks(s)
    pool.free(s)


def test_a_digest_collision_never_shares_a_block(monkeypatch):
    """Every block digest forced equal: a different prompt still gets no cached block of another (its tokens
    are compared on a hit), while the same prompt still reuses its own."""
    import metrale.engine_core.kv_blocks as kv

    monkeypatch.setattr(kv, "block_hash", lambda parent, tokens: b"same digest for every block")
    pool = KvBlockPool(16, 4)
    _cache(pool, seq(range(9), "a"))
    other = seq([100 + t for t in range(9)], "b")
    assert pool.match_prefix(other) == 0 and pool.blocks(other) == []
    again = seq(range(9), "a2")
    assert pool.match_prefix(again) == 4  # the first block only: the second collides with the first's digest
    pool.free(again)
    check_pool(pool)


def test_requests_with_different_cache_salts_never_share_blocks():
    pool = KvBlockPool(16, 4)
    tenant_a = seq(range(13), "a", "tenant-a")
    _cache(pool, tenant_a)
    for salt, reused in ((None, 0), ("tenant-b", 0), ("tenant-a", 12)):
        s = seq(range(13), f"probe-{salt}", salt)
        assert pool.match_prefix(s) == reused, salt
        pool.free(s)
    check_pool(pool)
