"""Serving traffic through `metrale serve`: Poisson arrivals near capacity, mixed lengths, lane vs --no-pipeline.

Starts two servers on the same model, one as shipped (the pipelined lane) and one with `--no-pipeline`, and
alternates runs of the same workload between them (the order swapped every repetition; a fresh seed, so
fresh prompts, arrival times and lengths, per repetition). A run is `requests` streamed requests sent at
the times of a Poisson process of `rate` requests per second (the first at once), each with a prompt of
random token ids and a max_tokens drawn uniformly from the --prompt-len and --max-tokens ranges; greedy,
ignore_eos, so every request makes exactly its max_tokens. They are spread over `clients` AsyncClients,
all connected before the clock starts.

The default rate is meant to sit at or a little above what bench-tiny bf16 serves on this 2-core box, so
that requests queue: below capacity both modes deliver the offered load and throughput cannot tell them
apart (latency and the worker's idle share still can). offered_tok_s in the JSON is rate × the mean
max_tokens; a throughput well under it means the server was the limit. On a GPU raise --rate (and
--requests) until the pipelined server's throughput stops following it.

The worker's idle fraction over each run (1 − its busy time ÷ wall time, from the first send to the last
token) is read from the header of each server's ticket ring (TicketRing.worker_stats), as bench_pipeline.py
does; it writes nothing there.

    python scripts/bench_poisson.py [--model DIR] [--preset bench-tiny] [--dtype bfloat16] [--rate 8]
                                    [--requests 100] [--prompt-len 32,512] [--max-tokens 16,256]
                                    [--reps 3] [--clients 16] [--max-num-seqs 64] [--threads N]

Prints one JSON line on stdout (the table goes to stderr). Per mode (medians over repetitions): output
throughput (output tokens ÷ time from the first send to the last token), TTFT p50/p99 (from each request's
send), ITL p50/p99 (gaps between consecutive streamed deltas of a request, pooled over requests), time per
output token, the worker's idle fraction and steps, and send_lag_ms_max (how late the client sent a request
against its scheduled arrival: large means the client, not the server, shaped the load).
pipelined_vs_no_pipeline is the median over repetitions of the paired throughput ratio. Targets (issue 19):
the pipelined server's worker idle < 2 % and pipelined_vs_no_pipeline >= 1.05.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import (  # noqa: E402
    FIRST_PLAIN_TOKEN,
    LoadMeter,
    RingWatch,
    ServeProcess,
    WorkerRingReader,
    build_model,
    close_all,
    emit,
    git_commit,
    greedy_params,
    median_figures,
    note,
    paired_ratio,
    plain_vocab_end,
    run_clients,
    settle,
    table,
    thread_env,
)

TARGET_IDLE = 0.02
TARGET_GAIN = 1.05
WARMUP_SEED = 30_000  # the warm-up run's workload; repetitions use seeds 0, 1, 2, ...
WARMUP_REQUESTS = 16
MODES = ("pipelined", "no_pipeline")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: build the preset in a temp folder)")
    ap.add_argument("--preset", default="bench-tiny")
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--requests", type=int, default=100, help="requests per run")
    ap.add_argument("--prompt-len", default="32,512", help="MIN,MAX prompt tokens (uniform)")
    ap.add_argument("--max-tokens", default="16,256", help="MIN,MAX new tokens (uniform)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clients", type=int, default=16, help="AsyncClients the requests are spread over")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the servers (default: torch's own)")
    args = ap.parse_args(argv)
    args.prompt_range = _range(args.prompt_len, "--prompt-len")
    args.output_range = _range(args.max_tokens, "--max-tokens")
    return args


def _range(text: str, flag: str) -> tuple[int, int]:
    """MIN,MAX (or one number) as an inclusive range."""
    parts = [int(x) for x in text.split(",")]
    lo, hi = parts[0], parts[-1]
    if len(parts) > 2 or not 1 <= lo <= hi:
        raise SystemExit(f"{flag} takes MIN,MAX with 1 <= MIN <= MAX (got {text!r})")
    return lo, hi


def poisson_workload(seed: int, n: int, rate: float, prompt_range: tuple[int, int], output_range: tuple[int, int],
                     vocab_end: int) -> tuple[list[float], list[list[int]], list[int]]:
    """(send offsets in seconds, prompts, max_tokens) of n requests: exponential gaps of mean 1/rate, the first
    at 0; lengths uniform over the ranges; all fixed by the seed."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, size=n - 1))]).tolist()
    lens = rng.integers(prompt_range[0], prompt_range[1] + 1, size=n)
    outs = rng.integers(output_range[0], output_range[1] + 1, size=n)
    prompts = [rng.integers(FIRST_PLAIN_TOKEN, vocab_end, size=int(k)).tolist() for k in lens]
    return offsets, prompts, [int(o) for o in outs]


def run_poisson(port: int, offsets, prompts, max_tokens: list[int], num_clients: int, watch: RingWatch | None = None) -> dict:
    """One Poisson run against the server on port; its figures."""
    timeline = run_clients(port, prompts, [greedy_params(k) for k in max_tokens], num_clients, watch, offsets)
    figures = timeline.figures()
    del figures["decode_tok_s"]  # no window where every request decodes: arrivals are spread over the run
    figures["send_lag_ms_max"] = round(timeline.send_lag_s * 1e3, 3)
    if watch is not None:
        ring = watch.figures()
        figures["worker_idle_run"] = ring["worker_idle_run"]
        figures["worker_steps"] = ring["worker_steps"]
    expected = sum(max_tokens)
    if figures["output_tokens"] != expected:
        raise RuntimeError(f"{figures['output_tokens']} tokens streamed, {expected} asked for")
    return figures


def measure(args: argparse.Namespace, model_dir: Path, meter: LoadMeter) -> dict[str, list[dict]]:
    """Both servers up, one warm-up run each, then the repetitions alternated; every run's figures by mode."""
    flags = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)]
    vocab_end = plain_vocab_end(model_dir)
    servers: dict[str, ServeProcess] = {}
    readers: dict[str, WorkerRingReader | None] = {}
    try:
        servers["pipelined"] = ServeProcess(model_dir, *flags, env=thread_env(args.threads))
        servers["no_pipeline"] = ServeProcess(model_dir, *flags, "--no-pipeline", env=thread_env(args.threads))
        for mode, server in servers.items():
            ring = server.ring_name()
            readers[mode] = WorkerRingReader(ring) if ring else None
            if ring is None:
                note(f"{mode}: the worker's ring was not found; no idle figures")
        warm = poisson_workload(WARMUP_SEED, min(WARMUP_REQUESTS, args.requests), args.rate, args.prompt_range,
                                args.output_range, vocab_end)
        for mode in MODES:
            run_poisson(servers[mode].port, *warm, args.clients)
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for rep in range(args.reps):
            work = poisson_workload(rep, args.requests, args.rate, args.prompt_range, args.output_range, vocab_end)
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                settle(0.5, max_s=3.0)  # the other server's threads have gone quiet
                runs[mode].append(run_poisson(servers[mode].port, *work, args.clients, watch=RingWatch(readers[mode])))
            meter.sample()
            note(f"rep {rep}: " + ", ".join(
                f"{m} {runs[m][-1]['throughput_tok_s']:.0f} tok/s, TTFT p50 {runs[m][-1]['ttft_ms_p50']:.0f} ms, "
                f"idle {runs[m][-1].get('worker_idle_run')}" for m in MODES))
        return runs
    finally:
        close_all(readers, servers)


def main(argv: list[str] | None = None) -> int:
    """Run, print the table (stderr) and the JSON line (stdout)."""
    args = parse_args(argv)
    meter = LoadMeter()
    commit = git_commit()
    with tempfile.TemporaryDirectory(prefix="metrale-bench-") as tmp:
        model_dir = Path(args.model) if args.model else build_model(Path(tmp) / args.preset, args.preset)
        runs = measure(args, model_dir, meter)
    results = {m: median_figures(runs[m]) for m in MODES}
    gain = paired_ratio(runs["pipelined"], runs["no_pipeline"])
    idle = results["pipelined"].get("worker_idle_run")
    rows = [[m, f["throughput_tok_s"], f["ttft_ms_p50"], f["ttft_ms_p99"], f["itl_ms_p50"], f["itl_ms_p99"],
             f.get("worker_idle_run"), f["send_lag_ms_max"], gain if m == "pipelined" else None]
            for m, f in results.items()]
    note(table(rows, ["mode", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "worker idle",
                      "send lag ms", "pipelined/no-pipeline"]))
    emit({
        "bench": "poisson",
        "commit": commit,
        "model": args.model or args.preset,
        "dtype": args.dtype,
        "rate": args.rate,
        "requests": args.requests,
        "prompt_len": list(args.prompt_range),
        "max_tokens": list(args.output_range),
        "offered_tok_s": round(args.rate * sum(args.output_range) / 2, 1),
        "reps": args.reps,
        "clients": args.clients,
        "max_num_seqs": args.max_num_seqs,
        "threads": args.threads,
        "results": results,
        "pipelined_vs_no_pipeline": gain,
        "pipelined_vs_no_pipeline_per_rep": [round(a["throughput_tok_s"] / b["throughput_tok_s"], 3)
                                             for a, b in zip(runs["pipelined"], runs["no_pipeline"])],
        "target_worker_idle": TARGET_IDLE,
        "target_idle_met": None if idle is None else idle < TARGET_IDLE,
        "target_gain": TARGET_GAIN,
        "target_gain_met": None if gain is None else gain >= TARGET_GAIN,
        "machine": meter.report(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
