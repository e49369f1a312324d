"""A whole engine message's latency samples at once (Metrics.tokens_came): the same histograms and window as one
observe per sample."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.frontend.latency_window import SampleRing
from metrale.frontend.metrics import Metrics, _ITL_BUCKETS, _TTFT_BUCKETS


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def samples(rng: np.random.Generator, buckets: tuple[float, ...], n: int) -> list[float]:
    """n latencies: some exactly on bucket bounds (they count in that bucket), some past the last, zero."""
    on_bounds = rng.choice(buckets, size=n // 4).tolist()
    spread = rng.exponential(buckets[len(buckets) // 2], size=n - n // 4 - 2).tolist()
    return on_bounds + spread + [0.0, buckets[-1] * 10]


def histogram_samples(metrics: Metrics) -> list[tuple[str, dict, float]]:
    return sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                  for family in metrics.own_families() for s in family.samples
                  if ("latency" in s.name or "first_token" in s.name) and not s.name.endswith("_created"))


@pytest.mark.parametrize("seed", [0, 1])
def test_tokens_came_counts_as_one_observe_per_sample(seed):
    rng = np.random.default_rng(seed)
    one, batched = Metrics(Clock()), Metrics(Clock())
    for _ in range(3):  # several messages add up
        first, gaps = samples(rng, _TTFT_BUCKETS, 40), samples(rng, _ITL_BUCKETS, 300)
        for s in first:
            one.first_token(s)
        for s in gaps:
            one.next_tokens(s)
        batched.tokens_came(first, gaps)
    got, want = histogram_samples(batched), histogram_samples(one)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert [g[2] for g in got] == pytest.approx([w[2] for w in want])
    assert batched.window.snapshot() == one.window.snapshot()


def test_tokens_came_with_no_samples_changes_nothing():
    metrics, fresh = Metrics(Clock()), Metrics(Clock())
    metrics.tokens_came([], [])
    assert histogram_samples(metrics) == histogram_samples(fresh)


@pytest.mark.parametrize("batches", [[3, 4], [5, 5, 5], [2, 13], [7, 1, 8, 2]])
def test_a_ring_keeps_the_newest_samples_whatever_the_batches(batches):
    """add_all wraps around the ring (and keeps only the newest of a batch longer than it) as add one by one."""
    one, batched = SampleRing(capacity=8), SampleRing(capacity=8)
    value = 0.0
    for t, n in enumerate(batches):
        values = np.arange(value, value + n)
        value += n
        for v in values:
            one.add(float(t), float(v))
        batched.add_all(float(t), values)
    assert (batched.next, batched.count) == (one.next, one.count)
    assert batched.times.tolist() == one.times.tolist() and batched.values.tolist() == one.values.tolist()
