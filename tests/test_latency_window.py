"""The frontend's recent-latency window (what `stats` reports for `metrale top`): percentiles over the last
minute only, the ring's span when it overflows, and the prompt tokens admitted."""

from __future__ import annotations

import pytest

from metrale.frontend.latency_window import LatencyWindow


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_percentiles_cover_the_window_only():
    clock = Clock()
    w = LatencyWindow(clock, window_s=60.0)
    w.first_token(9.0)  # old: falls out of the window
    w.next_tokens(9.0)
    clock.now += 61.0
    for ms in range(1, 101):
        w.first_token(ms / 1000)
        w.next_tokens(ms / 10000)
    s = w.snapshot()
    assert (s.ttft_samples, s.itl_samples) == (100, 100)
    assert s.ttft_p50_s == pytest.approx(0.0505) and s.ttft_p99_s == pytest.approx(0.09901)
    assert s.itl_p99_s == pytest.approx(0.009901)
    assert s.window_s == 60.0


def test_an_empty_window_reports_zeros():
    clock = Clock()
    w = LatencyWindow(clock)
    clock.now += 5.0
    s = w.snapshot()
    assert (s.ttft_samples, s.ttft_p50_s, s.itl_p99_s) == (0, 0.0, 0.0)
    assert s.window_s == 5.0  # the frontend has been up 5 s


def test_a_full_ring_says_it_covers_less_than_the_window():
    clock = Clock()
    w = LatencyWindow(clock, window_s=60.0, capacity=10)
    clock.now += 100.0
    for i in range(25):
        clock.now += 1.0
        w.first_token(float(i))
    s = w.snapshot()
    assert s.ttft_samples == 10  # the newest 10
    assert s.ttft_p50_s == pytest.approx(19.5)
    assert s.window_s == pytest.approx(9.0)


def test_admitted_prompt_tokens_add_up():
    w = LatencyWindow(Clock())
    w.admitted(7)
    w.admitted(5)
    assert w.snapshot().prompt_tokens == 12
