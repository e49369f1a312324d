"""The frontend's recent latencies: TTFT and inter-token samples of the last minute, for `metrale top`.

The Prometheus histograms (metrics.py) hold every sample since the start, in fixed buckets; a live view wants
percentiles over a recent window instead. Each kind keeps its newest samples in a preallocated ring (so the
per-output path allocates nothing); a query takes those younger than the window. At more samples per window
than the ring holds, the window is the ring's span, and `FrontendStats.window_s` says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from metrale.ipc.messages import FrontendStats

WINDOW_S = 60.0
CAPACITY = 8192  # samples kept per kind


class SampleRing:
    """The newest CAPACITY (time, value) samples of one kind."""

    __slots__ = ("times", "values", "next", "count")

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.times = np.zeros(capacity)
        self.values = np.zeros(capacity)
        self.next = 0
        self.count = 0

    def add(self, at: float, value: float) -> None:
        """Keep one sample (the oldest goes once the ring is full)."""
        i = self.next
        self.times[i] = at
        self.values[i] = value
        self.next = (i + 1) % len(self.times)
        if self.count < len(self.times):
            self.count += 1

    def add_all(self, at: float, values: np.ndarray) -> None:
        """Keep samples all taken at `at` (the oldest go once the ring is full), in one or two slice writes."""
        cap = len(self.times)
        i = (self.next + max(0, len(values) - cap)) % cap  # where the newest cap of them go, as add would put them
        values = values[-cap:]
        n = len(values)
        first = min(n, cap - i)
        self.times[i : i + first] = at
        self.values[i : i + first] = values[:first]
        self.times[: n - first] = at
        self.values[: n - first] = values[first:]
        self.next = (i + n) % cap
        self.count = min(cap, self.count + n)

    def since(self, t0: float) -> tuple[np.ndarray, float]:
        """(values of the samples taken at t0 or later, the time of the oldest sample kept)."""
        times, values = self.times[: self.count], self.values[: self.count]
        oldest = float(times.min()) if self.count else t0
        return values[times >= t0], oldest


class LatencyWindow:
    """TTFT and ITL samples, and the prompt tokens admitted: what `stats` reports beside the engine's counters."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S,
                 capacity: int = CAPACITY) -> None:
        self.clock = clock
        self.window_s = window_s
        self.ttft = SampleRing(capacity)
        self.itl = SampleRing(capacity)
        self.prompt_tokens = 0
        self.started = clock()

    def first_token(self, seconds: float) -> None:
        """A request's first tokens came `seconds` after it was admitted."""
        self.ttft.add(self.clock(), seconds)

    def next_tokens(self, seconds_per_token: float) -> None:
        """Later tokens of a request came, `seconds_per_token` apart."""
        self.itl.add(self.clock(), seconds_per_token)

    def tokens_came(self, first: np.ndarray, gaps: np.ndarray) -> None:
        """One engine message's samples: first_token and next_tokens for each."""
        now = self.clock()
        if len(first):
            self.ttft.add_all(now, first)
        if len(gaps):
            self.itl.add_all(now, gaps)

    def admitted(self, prompt_tokens: int) -> None:
        """A request's prompt went to the engine core."""
        self.prompt_tokens += prompt_tokens

    def snapshot(self) -> FrontendStats:
        """Percentiles over the window (0 where it holds no sample), and the counters."""
        now = self.clock()
        t0 = now - self.window_s
        ttft, oldest_ttft = self.ttft.since(t0)
        itl, oldest_itl = self.itl.since(t0)
        # The span the samples cover: the window, or less when a full ring's oldest sample is younger.
        full = [o for ring, o in ((self.ttft, oldest_ttft), (self.itl, oldest_itl)) if ring.count == len(ring.times)]
        covered = min([self.window_s, now - self.started] + [now - o for o in full])
        p = lambda a, q: float(np.percentile(a, q)) if len(a) else 0.0  # noqa: E731
        return FrontendStats(window_s=covered, ttft_samples=len(ttft), itl_samples=len(itl),
                             ttft_p50_s=p(ttft, 50), ttft_p99_s=p(ttft, 99), itl_p50_s=p(itl, 50),
                             itl_p99_s=p(itl, 99), prompt_tokens=self.prompt_tokens)
