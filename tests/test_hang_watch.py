"""HangWatch: a step's deadline follows the model's recent step times per unit of work, never below the floor."""

from __future__ import annotations

from metrale.engine_core.hang_watch import NS, HangWatch


def test_first_steps_get_the_warm_up_allowance_then_the_deadline_follows_the_steps():
    watch = HangWatch(floor_s=2.0, factor=20.0, first_steps_s=300.0, warmup=2)
    assert watch.limit_ns(1) == 300 * NS  # a new worker: compilation, a long first prefill
    watch.record(250 * NS, 4096)  # the warm-up steps say nothing about steady steps
    watch.record(5 * NS, 1)
    assert watch.limit_ns(1) == 300 * NS
    for _ in range(5):
        watch.record(NS // 100, 32)  # 10 ms decode steps of 32 rows
    assert watch.limit_ns(32) == 2 * NS, "the floor holds for short steps"
    per_token = (NS // 100) / 32
    assert watch.limit_ns(2048) == int(20 * per_token * 2048), "a long prefill gets its share of the work"
    watch.reset()
    assert watch.limit_ns(1) == 300 * NS, "a restarted worker warms up again"


def test_the_slowest_recent_rate_counts_and_old_steps_age_out():
    watch = HangWatch(floor_s=0.0, factor=10.0, warmup=0, history=4)
    watch.record(NS, 1)  # one slow step
    for _ in range(3):
        watch.record(NS // 10, 1)
    assert watch.limit_ns(1) == 10 * NS
    watch.record(NS // 10, 1)  # the slow one leaves the window
    assert watch.limit_ns(1) == NS
