"""The frontend's data-parallel router: prefix affinity bounded by load, ties spread, salts and full caches."""

from __future__ import annotations

from metrale.frontend.router import IMBALANCE_ABS, Router


def _router(n: int = 2) -> Router:
    r = Router(n, block_size=4)
    r.routable = [True] * n
    r.reachable = [True] * n
    return r


def _prompt(prefix: int, suffix: int, n: int = 12) -> list[int]:
    return [prefix] * 8 + [suffix] * (n - 8)


def test_a_shared_prefix_follows_the_replica_that_has_it():
    r = _router()
    first = r.choose(_prompt(1, 2))
    r.live[first] += 1
    # An idle other replica would win on load alone; the prefix keeps the request where its blocks are.
    assert r.choose(_prompt(1, 3)) == first
    assert r.affinity_hits == 1


def test_distinct_prefixes_spread_over_idle_replicas():
    r = _router(3)
    assert [r.choose(_prompt(p, 0)) for p in range(6)] == [0, 1, 2, 0, 1, 2]


def test_affinity_yields_when_its_replica_is_far_busier():
    r = _router()
    home = r.choose(_prompt(1, 2))
    r.live[home] = IMBALANCE_ABS + 1
    assert r.choose(_prompt(1, 3)) == 1 - home, "too busy: the least loaded takes it"
    r.live = [0, 0]
    assert r.choose(_prompt(1, 4)) == 1 - home, "and the prefix now lives there"


def test_a_nearly_full_cache_is_avoided():
    r = _router()
    home = r.choose(_prompt(1, 2))
    r.kv_use[home] = 0.95
    assert r.choose(_prompt(1, 3)) == 1 - home
    assert r.choose(_prompt(9, 3)) == 1 - home


def test_salts_and_short_prompts_have_no_affinity():
    r = _router()
    home = r.choose(_prompt(1, 2), salt="a")
    r.live[home] += 5
    assert r.choose(_prompt(1, 2), salt="b") == 1 - home, "another tenant's cache is not shared"
    assert r.prefix_keys([1, 2, 3], None) == [], "shorter than a block: nothing to follow"


def test_exclude_and_paused_replicas():
    r = _router()
    assert r.choose(_prompt(1, 2), exclude=0) == 1
    r.routable = [False, False]
    assert r.choose(_prompt(1, 2)) in (0, 1), "all waiting for workers: one of them queues it"
    r.reachable = [False, False]
    assert r.choose(_prompt(1, 2)) is None
