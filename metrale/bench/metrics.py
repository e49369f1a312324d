"""A serving benchmark's figures from its requests' results, defined as vLLM's bench defines them.

TTFT, ITL and E2EL are as measured per request (driver.py); TPOT is a request's (latency − TTFT) ÷ (output
tokens − 1), for requests of more than one token. Means, medians, standard deviations and percentiles (numpy's
linear interpolation) are over the successful requests, in milliseconds; an empty set gives 0. Goodput counts
the successful requests that meet every given SLO (a one-token request's TPOT counts as 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .driver import RequestResult

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class Distribution:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]  # (p, value)

    @classmethod
    def of(cls, seconds: list[float], percentiles: list[float]) -> Distribution:
        """The summary of these samples (seconds in, milliseconds out)."""
        a = np.asarray(seconds or [0.0], dtype=np.float64) * 1000.0
        return cls(float(a.mean()), float(np.median(a)), float(a.std()),
                   [(p, float(np.percentile(a, p))) for p in percentiles])


@dataclass(slots=True)
class BenchMetrics:
    """The figures of one run."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    duration_s: float
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    output_lens: list[int]  # per request, 0 for a failed one
    latencies: dict[str, Distribution] = field(default_factory=dict)  # ttft, tpot, itl, e2el


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """{"ttft": ms, ...} from "ttft:MS" strings; ValueError naming what is wrong."""
    slos = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep:
            raise ValueError(f"--goodput {pair!r}: use NAME:MILLISECONDS, NAME one of {', '.join(GOODPUT_METRICS)}")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {pair!r}: {name!r} is not one of {', '.join(GOODPUT_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {pair!r}: the SLO must not be negative")
    return slos


def compute(results: list[RequestResult], duration_s: float, count_tokens: Callable[[str], int] | None,
            percentiles: list[float], goodput: dict[str, float] | None = None) -> BenchMetrics:
    """The run's figures; count_tokens counts a text's tokens for a server that reports no usage (None: 1 each)."""
    output_lens, ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], [], []
    total_input = completed = 0
    for r in results:
        if not r.success:
            output_lens.append(0)
            continue
        n = r.output_tokens
        if not n:
            n = count_tokens(r.generated_text) if count_tokens is not None else 1
        output_lens.append(n)
        total_input += r.prompt_len
        tpot = (r.latency - r.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        ttfts.append(r.ttft)
        itls += r.itl
        e2els.append(r.latency)
        completed += 1
    good = _good_requests(goodput or {}, ttfts, all_tpots, e2els)
    total_output = sum(output_lens)
    peak_tokens, peak_requests = _peaks([r for r in results if r.success])
    return BenchMetrics(
        completed=completed, failed=len(results) - completed, total_input=total_input, total_output=total_output,
        duration_s=duration_s, request_throughput=completed / duration_s, request_goodput=good / duration_s,
        output_throughput=total_output / duration_s, total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=peak_tokens, max_concurrent_requests=peak_requests, output_lens=output_lens,
        latencies={name: Distribution.of(values, percentiles)
                   for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els))},
    )


def _good_requests(slos: dict[str, float], ttfts: list[float], tpots: list[float], e2els: list[float]) -> int:
    """How many successful requests meet every SLO (milliseconds)."""
    if not slos:
        return 0
    columns = [(values, slos[name] / 1000.0) for name, values in (("ttft", ttfts), ("tpot", tpots), ("e2el", e2els))
               if name in slos]
    return sum(all(values[i] <= limit for values, limit in columns) for i in range(len(ttfts)))


def _peaks(results: list[RequestResult]) -> tuple[float, int]:
    """The most tokens that arrived within one second of the run, and the most requests live in one second."""
    if not results:
        return 0.0, 0
    t0 = min(r.start_time for r in results)
    seconds = int(math.ceil(max(r.start_time + r.latency for r in results) - t0)) + 1
    tokens, live = np.zeros(seconds), np.zeros(seconds)
    for r in results:
        at = r.start_time + r.ttft + np.concatenate(([0.0], np.cumsum(r.itl)))
        np.add.at(tokens, np.clip((at - t0).astype(np.int64), 0, seconds - 1), 1)
        live[int(r.start_time - t0): int(r.start_time + r.latency - t0) + 1] += 1
    return float(tokens.max()), int(live.max())
