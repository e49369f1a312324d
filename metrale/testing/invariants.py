"""What every engine test checks at the end: no KV block and no state slot leaks (the engine itself asserts
nothing of the kind on its hot path)."""

from __future__ import annotations

from metrale.engine_core.kv_blocks import KvBlockPool
from metrale.engine_core.sequence import Sequence
from metrale.engine_core.state_slots import StateSlots


def check_pool(pool: KvBlockPool) -> None:
    """Raise AssertionError unless free + used + cached == total and refcounts agree."""
    assert pool.num_free + pool.num_cached + pool.num_used == pool.num_blocks
    assert sum(1 for r in pool.refcount if r > 0) == pool.num_used, "refcounts disagree with the free lists"
    assert all(pool.refcount[b] == 0 for b in pool._free)
    assert all(pool.refcount[b] == 0 for b in pool._cached)


def check_state_slots(slots: StateSlots, running: list[Sequence]) -> None:
    """Every slot is free or held by exactly one running sequence."""
    if not slots.num_slots:
        return
    held = [s.state_slot for s in running]
    assert -1 not in held, "a running sequence holds no state slot"
    assert len(set(held)) == len(held), "two running sequences share a state slot"
    assert sorted(held + slots._free) == list(range(slots.num_slots)), "a state slot leaked"
