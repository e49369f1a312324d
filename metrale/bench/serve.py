"""`metrale bench serve`: send a dataset's requests to an OpenAI-compatible server at a given rate, and report.

Works against any server that streams `/v1/completions` or `/v1/chat/completions` with usage (metrale's own,
vLLM's, SGLang's). The flags, the figures and the saved JSON are vLLM's bench's (see result.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp

from metrale.frontend.tokenizer import Tokenizer

from . import datasets, metrics, result
from .arrivals import arrival_offsets
from .driver import CHAT, RequestResult, Target, send


@dataclass(slots=True)
class ServeBenchArgs:
    """Everything `metrale bench serve` is told (the CLI's flags, under their vLLM names)."""

    base_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    endpoint: str = "/v1/completions"
    backend: str | None = None  # openai | openai-chat (default: from the endpoint)
    model: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 1000
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    sharegpt_output_len: int | None = None
    disable_shuffle: bool = False
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    num_warmups: int = 0
    disable_tqdm: bool = False
    percentile_metrics: str = "ttft,tpot,itl,e2el"
    metric_percentiles: str = "99"
    goodput: list[str] = field(default_factory=list)
    extra_body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    label: str | None = None
    metadata: dict = field(default_factory=dict)
    save_result: bool = False
    save_detailed: bool = False
    result_dir: str | None = None
    result_filename: str | None = None


@dataclass(slots=True)
class ServeBenchOutcome:
    """What a run produced: its figures, the result JSON, and where it was saved (None: not saved)."""

    metrics: metrics.BenchMetrics
    result: dict
    table: str
    path: str | None


def run(args: ServeBenchArgs, echo=print) -> ServeBenchOutcome:
    """Run the benchmark as configured; ValueError for a configuration that cannot run (nothing is sent)."""
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be at least 1")
    if args.num_prompts <= 0:
        raise ValueError("--num-prompts must be at least 1")
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    chosen = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    unknown = set(chosen) - set(metrics.PERCENTILE_METRICS) - {"client_queue_time", "e2el_including_client_queue"}
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(sorted(unknown))}")
    slos = metrics.parse_goodput(args.goodput)
    model = args.model or first_model(base_url, args.headers)
    tokenizer_id = args.tokenizer or model
    tokenizer = load_tokenizer(tokenizer_id)
    requests = sample(args, tokenizer)
    ignore_eos = args.ignore_eos or args.dataset_name == "random"  # vLLM's bench does the same for random prompts
    backend = args.backend or ("openai-chat" if args.endpoint.rstrip("/").endswith(CHAT) else "openai")
    headers = dict(args.headers)
    if os.environ.get("OPENAI_API_KEY") and "Authorization" not in headers:
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    target = Target.make(base_url, args.endpoint, args.served_model_name or model, args.extra_body, headers)
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    echo(f"Traffic request rate: {rate}; burstiness {args.burstiness} "
         f"({'Poisson process' if args.burstiness == 1.0 else 'gamma distribution'}); "
         f"maximum request concurrency: {args.max_concurrency}")
    results, duration = asyncio.run(drive(target, requests, args, ignore_eos))
    m = metrics.compute(results, duration, lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
                        percentiles, slos)
    info = result.RunInfo(backend=backend, label=args.label, model_id=model, tokenizer_id=tokenizer_id,
                          num_prompts=args.num_prompts, request_rate=args.request_rate, burstiness=args.burstiness,
                          max_concurrency=args.max_concurrency, percentile_metrics=chosen,
                          percentiles=tuple(percentiles), goodput=bool(slos),
                          metadata=tuple(args.metadata.items()))
    out = result.result_json(info, m, results, detailed=args.save_detailed)
    summary = result.table(info, m, results)
    echo(summary)
    path = None
    if args.save_result:
        path = result.result_path(info, out["date"], args.result_dir, args.result_filename)
        result.save(out, path)
        echo(f"result saved to {path}")
    return ServeBenchOutcome(m, out, summary, path)


def sample(args: ServeBenchArgs, tokenizer: Tokenizer) -> list[datasets.SampleRequest]:
    """The run's requests from the chosen dataset."""
    if args.dataset_name == "random":
        if args.dataset_path is not None:
            raise ValueError("--dataset-name random takes no --dataset-path (use --dataset-name sharegpt)")
        return datasets.random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                        args.random_range_ratio, args.random_prefix_len, args.seed)
    if args.dataset_name == "sharegpt":
        if args.dataset_path is None:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT JSON file)")
        return datasets.sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.sharegpt_output_len,
                                          args.seed, shuffle=not args.disable_shuffle)
    raise ValueError(f"--dataset-name {args.dataset_name}: use random or sharegpt")


async def drive(target: Target, requests: list[datasets.SampleRequest], args: ServeBenchArgs,
                ignore_eos: bool) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time (at most max_concurrency at once); (results in order, seconds)."""
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=6 * 3600)) as session:
        for _ in range(args.num_warmups):
            await send(session, target, requests[0], ignore_eos)
        bar = _progress(len(requests), args.disable_tqdm)

        async def one(req: datasets.SampleRequest, arrived: float) -> RequestResult:
            async with limit:
                out = await send(session, target, req, ignore_eos)
            out.queue_time = out.start_time - arrived
            if bar is not None:
                bar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for req, offset in zip(requests, offsets):
            wait = start + offset - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(req, time.perf_counter())))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    return list(results), duration


def first_model(base_url: str, headers: dict) -> str:
    """The first model id the server lists at /v1/models (when --model is not given)."""
    req = urllib.request.Request(base_url + "/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            models = json.loads(resp.read())["data"]
    except Exception as exc:  # noqa: BLE001 - any failure here means: say which model
        raise ValueError(f"no --model given and {base_url}/v1/models did not answer with one: {exc}") from None
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; give --model")
    return models[0]["id"]


def load_tokenizer(tokenizer_id: str) -> Tokenizer:
    """The tokenizer of a model folder or GGUF file (counting tokens and making random prompts need one)."""
    try:
        return Tokenizer.from_dir(tokenizer_id)
    except (FileNotFoundError, OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {tokenizer_id!r} ({exc}); give --tokenizer with a model "
                         "folder (tokenizer.json) or a GGUF file") from None


def _progress(total: int, disabled: bool):
    """A tqdm progress bar over the requests, or None."""
    if disabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req")
