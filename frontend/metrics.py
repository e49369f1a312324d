"""Metrics: the frontend's Prometheus counters and histograms, and the engine's and supervisor's gauges.

The frontend sees every request from admission to its last token, so request counts, token counts and
latencies are measured here, for ZMQ and HTTP clients alike. What only the engine core knows (queue lengths, KV
blocks, prefix-cache hits, preemptions, steps) comes from its StatsResponse, asked for when /metrics is scraped,
and what only the supervisor knows (restarts) from the health source. Both are kept as the last snapshot and
turned into metric families by a collector when the registry is rendered. Under data parallel the engine
families are the sums over the replicas and `metrale_replica_*` families give each replica's own (label
`replica`); process families carry `replica` and `rank` labels when there are several of either.

With several frontends (--api-server-count) the frontend a scrape reaches sums every frontend's own counters and
histograms (api_servers.py gathers them) and adds `metrale_api_server_requests{api_server}`: each frontend's finished
requests, so the split between them shows. A frontend that is down while a scrape runs is missing from the sums, and
a restarted one starts from zero (Prometheus reads the drop as a counter reset).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from metrale.ipc.messages import EngineStats, Health

from .latency_window import LatencyWindow

CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort", "error")

# Latency buckets in seconds: from a fast decode step to a long queue wait.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class Metrics:
    """One frontend's metrics, in a registry of its own (so two servers in one process do not collide), and
    its recent latencies (`window`, for the `stats` answer)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, api_server: int = 0) -> None:
        """api_server: this frontend's index among several (--api-server-count), the label of its own requests."""
        self.window = LatencyWindow(clock)
        self.api_server = str(api_server)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("metrale_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)  # present (at 0) before the first request
        self.prompt_tokens = Counter("metrale_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("metrale_generation_tokens", "Tokens generated for finished requests.",
                                         registry=r)
        self.ttft = Histogram("metrale_time_to_first_token_seconds",
                              "From admission to a request's first token.", buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("metrale_inter_token_latency_seconds",
                             "Gap between a request's consecutive outputs, per token.", buckets=_ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("metrale_e2e_request_latency_seconds", "From admission to a request's end.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.engine = EngineCollector()
        r.register(self.engine)
        self._own = (self.requests, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e)

    def first_token(self, seconds: float) -> None:
        """A request's first tokens came `seconds` after it was admitted."""
        self.ttft.observe(seconds)
        self.window.first_token(seconds)

    def next_tokens(self, seconds_per_token: float) -> None:
        """Later tokens of a request came, `seconds_per_token` apart on average."""
        self.itl.observe(seconds_per_token)
        self.window.next_tokens(seconds_per_token)

    def tokens_came(self, first: list[float], gaps: list[float]) -> None:
        """One engine message's latency samples at once: first_token(s) for each of `first`, next_tokens(s) for each
        of `gaps` (a bucket count per bucket hit instead of a locked increment per sample)."""
        ttfts, itls = np.asarray(first, dtype=np.float64), np.asarray(gaps, dtype=np.float64)
        if len(ttfts):
            _observe_all(self.ttft, ttfts)
        if len(itls):
            _observe_all(self.itl, itls)
        self.window.tokens_came(ttfts, itls)

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int, seconds: float) -> None:
        """A request ended (stop, length, abort or error)."""
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(seconds)

    def render(self, others: list[list[Metric]] | None = None) -> bytes:
        """The Prometheus text exposition of every metric; others: the other frontends' own families (several
        frontends), summed with this one's."""
        if others is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        registry.register(_Families(_summed([self.own_families(), *others])))
        registry.register(self.engine)
        return generate_latest(registry)

    def own_families(self) -> list[Metric]:
        """This process's own counters and histograms (what several frontends sum), api_server_requests included."""
        families = [family for metric in self._own for family in metric.collect()]
        finished = sum(s.value for f in families if f.name == "metrale_requests" for s in f.samples
                       if s.name == "metrale_requests_total")
        per_process = CounterMetricFamily("metrale_api_server_requests", "Finished requests of each frontend process "
                                          "(--api-server-count).", labels=["api_server"])
        per_process.add_metric([self.api_server], finished)
        return [*families, per_process]


def _observe_all(histogram: Histogram, values: np.ndarray) -> None:
    """histogram.observe(v) for every v: a sample counts in the first bucket whose upper bound is >= it (the last
    bound is +Inf), as observe counts it. prometheus_client has no batched observe, so this adds to the histogram's
    own bucket and sum values (tests/test_metrics_batch.py checks it against observe, so a change of those
    internals fails there)."""
    bounds = histogram._upper_bounds
    counts = np.bincount(np.searchsorted(bounds, values), minlength=len(bounds))
    for i in np.flatnonzero(counts):
        histogram._buckets[i].inc(int(counts[i]))
    histogram._sum.inc(float(values.sum()))


class _Families:
    """A collector of fixed families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def _summed(processes: list[list[Metric]]) -> list[Metric]:
    """Families of the same name summed sample by sample (same name and labels), over the processes; a `_created`
    sample (a timestamp) takes the earliest instead."""
    families: dict[str, Metric] = {}
    values: dict[tuple[str, str, tuple], float] = {}
    for process in processes:
        for family in process:
            families.setdefault(family.name, family)
            for sample in family.samples:
                key = (family.name, sample.name, tuple(sorted(sample.labels.items())))
                if key not in values:
                    values[key] = sample.value
                elif sample.name.endswith("_created"):
                    values[key] = min(values[key], sample.value)
                else:
                    values[key] += sample.value
    out = {name: Metric(name, f.documentation, f.type, f.unit) for name, f in families.items()}
    for (name, sample_name, labels), value in values.items():
        out[name].samples.append(Sample(sample_name, dict(labels), value))
    return list(out.values())


class EngineCollector:
    """Metric families from the last engine-core stats and health snapshot."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None
        self.health: Health | None = None

    def update(self, stats: EngineStats | None = None, health: Health | None = None) -> None:
        """Keep the newest snapshots (None keeps the one before)."""
        if stats is not None:
            self.stats = stats
        if health is not None:
            self.health = health

    def describe(self) -> list[Metric]:
        """Nothing up front: the families depend on what the snapshots hold (prometheus_client calls this)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Gauges and counters of the snapshots."""
        if self.stats is not None:
            yield from _engine_families(self.stats)
        if self.health is not None:
            yield from _health_families(self.health)


def _engine_families(s: EngineStats) -> Iterator[Metric]:
    """The engine core's counters as metric families."""
    yield _gauge("metrale_num_requests_running", "Requests in the running batch.", s.running)
    yield _gauge("metrale_num_requests_waiting", "Requests waiting to be scheduled.", s.waiting)
    yield _gauge("metrale_num_requests_swapped", "Requests swapped out to host memory.", s.swapped)
    usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
    yield _gauge("metrale_kv_cache_usage_ratio", "Fraction of KV blocks in use by live requests.", usage)
    blocks = GaugeMetricFamily("metrale_kv_cache_blocks", "KV blocks by state.", labels=["state"])
    for state, value in (("used", s.kv_blocks_used), ("cached", s.kv_blocks_cached), ("free", s.kv_blocks_free)):
        blocks.add_metric([state], value)
    yield blocks
    yield _gauge("metrale_prefix_cache_hit_rate", "Fraction of looked-up prompt blocks found in the prefix cache.",
                 s.prefix_cache_hit_rate)
    yield CounterMetricFamily("metrale_preemptions", "Preemptions since the engine core started.",
                              value=s.preemptions)
    yield CounterMetricFamily("metrale_engine_steps", "Steps since the engine core started.", value=s.steps)
    yield CounterMetricFamily("metrale_repicks", "Tokens picked again under a stale mask (RepickOnly repairs).",
                              value=getattr(s, "repicks", 0))
    yield CounterMetricFamily("metrale_engine_generated_tokens", "Tokens the engine core generated since it started.",
                              value=s.generated_tokens)
    # The worker's busy and idle time, when the engine core reports them (getattr: older engine cores do not).
    busy, idle = getattr(s, "worker_busy_s", None), getattr(s, "worker_idle_s", None)
    if busy is not None and idle is not None:
        yield _gauge("metrale_worker_idle_ratio", "Fraction of time the worker waited for a step.",
                     idle / (busy + idle) if busy + idle > 0 else 0.0)
        yield _gauge("metrale_step_time_seconds", "Mean worker time per step.", busy / s.steps if s.steps else 0.0)
    if s.kernels:
        kernels = GaugeMetricFamily("metrale_kernels_info", "The worker's kernels (a CPU's instruction-set class).",
                                    labels=["kernels"])
        kernels.add_metric([s.kernels], 1)
        yield kernels
    if s.replicas:
        yield from _replica_families(s.replicas)


def _replica_families(replicas: list[EngineStats]) -> Iterator[Metric]:
    """Each data-parallel replica's own counters, labelled by its index."""
    specs = (
        ("metrale_replica_requests_running", "Requests in a replica's running batch.", lambda r: r.running),
        ("metrale_replica_requests_waiting", "Requests waiting in a replica.", lambda r: r.waiting),
        ("metrale_replica_kv_cache_usage_ratio", "Fraction of a replica's KV blocks in use.",
         lambda r: r.kv_blocks_used / r.kv_blocks_total if r.kv_blocks_total else 0.0),
        ("metrale_replica_prefix_cache_hit_rate", "A replica's prefix-cache hit rate.", lambda r: r.prefix_cache_hit_rate),
        ("metrale_replica_generated_tokens", "Tokens a replica's engine core generated since it started.",
         lambda r: r.generated_tokens),
    )
    for name, doc, value in specs:
        family = GaugeMetricFamily(name, doc, labels=["replica"])
        for k, r in enumerate(replicas):
            family.add_metric([str(k)], value(r))
        yield family


def _health_families(h: Health) -> Iterator[Metric]:
    """Each process's liveness and restart count."""
    labels = ["process"]
    if any(p.replica for p in h.processes):
        labels.append("replica")
    if any(p.rank for p in h.processes):
        labels.append("rank")
    up = GaugeMetricFamily("metrale_process_up", "1 when the process is alive.", labels=labels)
    restarts = CounterMetricFamily("metrale_process_restarts", "Restarts of each process by the supervisor.",
                                   labels=labels)
    for p in h.processes:
        values = [p.name, str(p.replica), str(p.rank)][: len(labels)] if "replica" in labels else \
            [p.name, str(p.rank)][: len(labels)]
        up.add_metric(values, 1.0 if p.alive else 0.0)
        restarts.add_metric(values, p.restarts)
    yield up
    yield restarts
    yield _gauge("metrale_healthy", "1 when every process is alive and no fault is pending.", 1.0 if h.healthy else 0.0)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    """A single-valued gauge family."""
    return GaugeMetricFamily(name, documentation, value=value)
