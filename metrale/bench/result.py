"""A serving benchmark's result: the table it prints and the JSON it saves, with the keys vLLM's bench writes
(`vllm bench serve --save-result`), so results of either tool read the same."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from datetime import datetime

from .driver import RequestResult
from .metrics import BenchMetrics, Distribution

# Per-request lists kept only with --save-detailed (vLLM drops the same ones).
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")
_HEADERS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
            "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency"),
            "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
            "e2el_including_client_queue": ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency")}


@dataclass(frozen=True, slots=True)
class RunInfo:
    """How the run was set up: what the result JSON records beside the figures."""

    backend: str  # "openai" (completions) or "openai-chat", vLLM's names
    label: str | None
    model_id: str
    tokenizer_id: str
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    percentile_metrics: tuple[str, ...]
    percentiles: tuple[float, ...]
    goodput: bool
    metadata: tuple[tuple[str, str], ...] = ()


def result_json(info: RunInfo, m: BenchMetrics, results: list[RequestResult], detailed: bool = False,
                now: datetime | None = None) -> dict:
    """The result as vLLM's bench saves it (per-request lists only when detailed)."""
    out: dict = {
        "date": (now or datetime.now()).strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": info.backend, "backend": info.backend, "label": info.label, "model_id": info.model_id,
        "tokenizer_id": info.tokenizer_id, "num_prompts": info.num_prompts, **dict(info.metadata),
        "request_rate": info.request_rate if not math.isinf(info.request_rate) else "inf",
        "burstiness": info.burstiness, "max_concurrency": info.max_concurrency,
        "duration": m.duration_s, "completed": m.completed, "failed": m.failed,
        "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput if info.goodput else None,
        "output_throughput": m.output_throughput, "total_token_throughput": m.total_token_throughput,
        "input_lens": [r.prompt_len for r in results], "output_lens": m.output_lens,
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results], "start_times": [r.start_time for r in results],
        "queue_times": [r.queue_time for r in results], "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "max_output_tokens_per_s": m.max_output_tokens_per_s, "max_concurrent_requests": m.max_concurrent_requests,
        "rtfx": 0.0,
    }
    for name, dist in selected_distributions(info, m, results):
        out[f"mean_{name}_ms"], out[f"median_{name}_ms"], out[f"std_{name}_ms"] = dist.mean, dist.median, dist.std
        for p, value in dist.percentiles:
            out[f"p{percentile_word(p)}_{name}_ms"] = value
    if not detailed:
        for key in DETAILED_KEYS:
            del out[key]
    return out


def selected_distributions(info: RunInfo, m: BenchMetrics, results: list[RequestResult]) -> list[tuple[str, Distribution]]:
    """The metrics whose percentiles are reported, in vLLM's order; the client-queue ones only under
    --max-concurrency (the queue-inclusive latency only at a finite rate)."""
    chosen = [(name, m.latencies[name]) for name in ("ttft", "tpot", "itl", "e2el") if name in info.percentile_metrics]
    if info.max_concurrency is not None:
        ok = [r for r in results if r.success]
        extra = [("client_queue_time", [r.queue_time for r in ok])]
        if not math.isinf(info.request_rate):
            extra.append(("e2el_including_client_queue", [r.latency + r.queue_time for r in ok]))
        chosen += [(name, Distribution.of(values, list(info.percentiles)))
                   for name, values in extra if name in info.percentile_metrics]
    return chosen


def percentile_word(p: float) -> str:
    """99 → "99", 99.9 → "99.9" (vLLM's key spelling)."""
    return str(int(p)) if int(p) == p else str(p)


def result_path(info: RunInfo, date: str, result_dir: str | None, result_filename: str | None) -> str:
    """Where --save-result writes: vLLM's default name unless --result-filename, inside --result-dir if given."""
    concurrency = f"-concurrency{info.max_concurrency}" if info.max_concurrency is not None else ""
    name = result_filename or (f"{info.label or info.backend}-{info.request_rate}qps{concurrency}-"
                               f"{info.model_id.rstrip('/').split('/')[-1]}-{date}.json")
    if result_dir:
        os.makedirs(result_dir, exist_ok=True)
        name = os.path.join(result_dir, name)
    return name


def save(result: dict, path: str) -> None:
    """Write the result JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f)


def table(info: RunInfo, m: BenchMetrics, results: list[RequestResult]) -> str:
    """The printed summary, laid out as vLLM's bench prints it."""
    rows = [f"{' Serving Benchmark Result ':=^50}", _row("Successful requests:", m.completed),
            _row("Failed requests:", m.failed)]
    if info.max_concurrency is not None:
        rows.append(_row("Maximum request concurrency:", info.max_concurrency))
    if not math.isinf(info.request_rate):
        rows.append(_row("Request rate configured (RPS):", info.request_rate))
    rows += [_row("Benchmark duration (s):", m.duration_s), _row("Total input tokens:", m.total_input),
             _row("Total generated tokens:", m.total_output), _row("Request throughput (req/s):", m.request_throughput)]
    if info.goodput:
        rows.append(_row("Request goodput (req/s):", m.request_goodput))
    rows += [_row("Output token throughput (tok/s):", m.output_throughput),
             _row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s),
             _row("Peak concurrent requests:", m.max_concurrent_requests),
             _row("Total token throughput (tok/s):", m.total_token_throughput)]
    for name, dist in selected_distributions(info, m, results):
        short, header = _HEADERS[name]
        rows += [f"{header:-^50}", _row(f"Mean {short} (ms):", dist.mean), _row(f"Median {short} (ms):", dist.median)]
        rows += [_row(f"P{percentile_word(p)} {short} (ms):", v) for p, v in dist.percentiles]
    rows.append("=" * 50)
    errors = [r.error for r in results if not r.success]
    if errors:
        rows.append(f"{len(errors)} request(s) failed; the first: {errors[0].strip().splitlines()[-1][:300]}")
    return "\n".join(rows)


def _row(label: str, value: float | int) -> str:
    """One 'label    value' line."""
    return f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}"
