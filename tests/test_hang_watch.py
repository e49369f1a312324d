"""HangWatch: a step's deadline is the hang timeout plus a margin on the time its work is expected to take, with
prefill tokens priced at prefill speed and decode rows at decode speed, as measured on the steps the server ran."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.engine_core.hang_watch import NS, HangWatch, StepWork
from metrale.ipc.plan import StepKind

A, B, C = 0.003, 0.00002, 0.0001  # seconds per forward, per prefill token, per decode row (a model's own speeds)


def true_s(work: StepWork) -> float:
    return A * work.forwards + B * work.prefill_tokens + C * work.decode_positions


def decode(rows: int) -> StepWork:
    return StepWork(decode_positions=rows)


def mixed(prefill: int, rows: int) -> StepWork:
    return StepWork(prefill_tokens=prefill, decode_positions=rows)


def run(watch: HangWatch, works, noise: float = 0.0, seed: int = 0) -> None:
    """Record each step at the model's true time (times 1 + up to `noise`)."""
    rng = np.random.default_rng(seed)
    for work in works:
        watch.record(int(true_s(work) * (1 + noise * rng.random()) * NS), work)


def test_first_steps_get_the_warm_up_allowance_and_a_restarted_worker_warms_up_again():
    watch = HangWatch(floor_s=2.0, first_steps_s=300.0, warmup=2)
    assert watch.limit_ns(decode(1)) == 300 * NS  # a new worker: compilation, a long first prefill
    watch.record(250 * NS, mixed(4096, 0))  # the warm-up steps say nothing about steady steps
    watch.record(5 * NS, decode(1))
    assert watch.limit_ns(decode(1)) == 300 * NS
    run(watch, [decode(32)] * 4)
    assert watch.limit_ns(decode(32)) < 2.1 * NS, "after warm-up the deadline is the floor plus a short step"
    watch.reset()
    assert watch.limit_ns(decode(32)) == 300 * NS, "a restarted worker warms up again"


def test_a_big_prefill_after_decode_steps_gets_the_timeout_plus_its_expected_time():
    """Decode steps of varying batch and a few small mixed steps price a 4,096-token prefill at prefill speed:
    its deadline is the timeout plus a margin on its expected time, not 20 x the slowest per-token rate x 4,096."""
    watch = HangWatch(floor_s=10.0, margin=2.0, warmup=0, refit_every=1)
    steps = [decode(r) for r in (1, 4, 16, 64, 256)] * 6 + [mixed(p, r) for p, r in ((40, 8), (120, 30), (300, 2))]
    run(watch, steps, noise=0.05)
    big = mixed(4096, 0)
    expected = watch.expected_s(big)
    assert expected == pytest.approx(true_s(big), rel=0.15)
    assert watch.limit_ns(big) == int((10.0 + 2.0 * expected) * NS)
    slowest_per_token = (A + C) / 1  # the one-row decode step
    assert watch.limit_ns(big) < 0.2 * 20 * slowest_per_token * 4096 * NS, "far below the old 20 x slowest rule"
    assert watch.expected_s(decode(1024)) == pytest.approx(true_s(decode(1024)), rel=0.15)


def test_prefill_work_never_measured_is_priced_at_the_slowest_recent_rate():
    """With only decode steps seen, the prefill speed is unknown: the slowest per-token time stands in (once, not
    twenty times), and the first prefill steps measured replace it."""
    watch = HangWatch(floor_s=1.0, margin=2.0, warmup=0, refit_every=1)
    run(watch, [decode(r) for r in (1, 8, 64)] * 4)
    slowest = A + C  # seconds per token of the one-row decode
    assert watch.expected_s(mixed(1000, 0)) == pytest.approx(A + 1000 * slowest, rel=0.01)
    run(watch, [mixed(200, 4), mixed(500, 16)])
    assert watch.expected_s(mixed(1000, 0)) == pytest.approx(true_s(mixed(1000, 0)), rel=0.01)


def test_one_prefill_step_prices_a_long_prompt_at_its_own_speed_at_once():
    """A restarted worker after one-row decode bursts (a recomputed request): one prefill step seen is too few for
    the fit, and the guess is that step's time per token, taken as soon as it is recorded (not `refit_every`
    records later), not the one-row burst's, whose time per token is the step overhead (bench_faults' second
    prefill hang: a 4,000-token prefill was allowed 432 s)."""
    watch = HangWatch(floor_s=10.0, margin=2.0, warmup=0)  # the default refit_every
    run(watch, [StepWork(forwards=8, decode_positions=8)] * 3)  # bursts of one row: A + C a token
    run(watch, [mixed(512, 0)])
    expected = watch.expected_s(mixed(4000, 0))
    assert expected == pytest.approx(4000 * true_s(mixed(512, 0)) / 512, rel=0.05)  # plus a step overhead
    assert expected < 0.05 * 4000 * (A + C), "not priced at the one-row decode's time per token"


def test_prefill_samples_outlive_a_long_run_of_decode_steps():
    watch = HangWatch(floor_s=1.0, warmup=0, history=16, prefill_history=4, refit_every=1)
    run(watch, [mixed(256, 1), mixed(1024, 4), mixed(64, 32)])
    run(watch, [decode(r) for r in (8, 64, 512)] * 50)  # the decode window turns over many times
    assert watch.expected_s(mixed(2048, 0)) == pytest.approx(true_s(mixed(2048, 0)), rel=0.01)


def test_a_bursts_forwards_each_cost_the_step_overhead():
    watch = HangWatch(floor_s=1.0, warmup=0, refit_every=1)
    run(watch, [decode(r) for r in (1, 8, 64, 256)] * 3 + [StepWork(forwards=8, decode_positions=8 * 64)] * 2)
    assert watch.expected_s(StepWork(forwards=8, decode_positions=8 * 128)) == pytest.approx(8 * A + 8 * 128 * C,
                                                                                           rel=0.01)


def test_the_fit_follows_a_device_that_slows_down():
    watch = HangWatch(floor_s=1.0, warmup=0, history=16, refit_every=1)
    run(watch, [decode(r) for r in (1, 16, 128, 512)] * 4)
    before = watch.expected_s(decode(512))
    for r in (1, 16, 128, 512) * 4:
        watch.record(int(3 * true_s(decode(r)) * NS), decode(r))  # the device runs three times slower now
    assert watch.expected_s(decode(512)) == pytest.approx(3 * before, rel=0.01)


def test_a_plans_work_splits_prefill_chunks_from_decode_rows_and_drafts():
    from test_worker_device import decode_plan

    plan = decode_plan([1, 2, 3])
    plan.query_start = np.array([0, 1, 101, 104], dtype=np.int32)  # a decode, a 100-token chunk, a 3-token row...
    plan.num_drafts = np.array([0, 0, 2], dtype=np.int32)  # ... that is a verify of its last token and 2 drafts
    assert StepWork.of_plan(plan) == StepWork(forwards=1, prefill_tokens=100, decode_positions=4)
    burst = decode_plan([1, 2, 3, 4])
    assert StepWork.of_plan(burst, StepKind.BURST, 8) == StepWork(forwards=8, prefill_tokens=0, decode_positions=32)


def test_a_ticket_without_tokens_is_no_step():
    """A LoRA load or a logits read neither ends a worker's warm-up nor feeds the fit (a slow adapter load would
    otherwise raise every step's expected overhead)."""
    watch = HangWatch(floor_s=1.0, warmup=2, refit_every=1)
    watch.record(5 * NS, StepWork(forwards=1))
    watch.record(5 * NS, StepWork(forwards=1))
    assert watch.limit_ns(decode(8)) == 300 * NS, "still warming up"
    run(watch, [decode(1), decode(8)] + [decode(r) for r in (1, 8, 64)] * 2)
    watch.record(5 * NS, StepWork(forwards=1))
    assert watch.expected_s(decode(64)) == pytest.approx(true_s(decode(64)), rel=0.01)
