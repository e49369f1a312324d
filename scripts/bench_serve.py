"""The cost of the three-process split: N concurrent ZMQ clients against `metrale serve` vs metrale.LLM in-process.

Starts `metrale serve` as a subprocess (any free port; stopped, with nothing left behind, on every path) and
an LLM in this process on the same model and engine settings, then alternates runs of the same requests
(serve, offline, serve, offline, ...; a fresh prompt set per repetition, so the prefix cache never helps).
Each run is `batch` requests of `prompt-len` random token ids, greedy, exactly `max-tokens` new tokens,
all submitted at once (through one AsyncClient per request for serve; one LLM.generate call offline).

Prints one JSON line on stdout (the table goes to stderr):

    python scripts/bench_serve.py [--model DIR] [--dtype bfloat16] [--batch 32] [--prompt-len 128]
                                  [--max-tokens 128] [--reps 3] [--threads N] [--no-pipeline]

Figures per engine (medians over repetitions): throughput (output tokens ÷ wall time from the first
send to the last token), steady-decode throughput (tokens inside the window where every request is
decoding), TTFT, inter-token latency (gap between consecutive streamed deltas of a request) p50/p99,
time per output token, and CPU milliseconds per output token of each process (worker, engine core,
frontend, supervisor and the benchmark's own clients for serve; this process for offline). serve_vs_offline is the median over repetitions of serve ÷ offline throughput of
the pair run back to back; the target is >= 0.95 at batch 32. Without --model a bench-tiny model
(512 hidden, 8 layers, 32k vocab) is built in a temp folder.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import (  # noqa: E402
    LoadMeter,
    RingWatch,
    ServeProcess,
    WorkerRingReader,
    build_model,
    emit,
    git_commit,
    greedy_params,
    median_figures,
    note,
    paired_ratio,
    plain_vocab_end,
    random_prompts,
    run_clients,
    run_offline,
    set_torch_threads,
    table,
    thread_env,
)

TARGET_SERVE_VS_OFFLINE = 0.95
WARMUP_SEED = 10_000  # prompt sets of warm-up runs; repetitions use seeds 0, 1, 2, ...


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: build bench-tiny in a temp folder)")
    ap.add_argument("--preset", default="bench-tiny", help="tiny-model preset built when --model is not given")
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--batch", default="32", help="comma-separated batch sizes (concurrent requests), e.g. 1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--no-pipeline", action="store_true", help="both engines run the synchronous loop")
    ap.add_argument("--clients", type=int, default=None, help="AsyncClients the requests are spread over (default: one per request)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for both engines (OMP_NUM_THREADS for the server; default: torch's own)")
    return ap.parse_args(argv)


def measure(args: argparse.Namespace, model_dir: Path, meter: LoadMeter) -> dict:
    """Start both engines, alternate the runs, and return the figures per batch size."""
    from metrale import LLM

    batches = [int(b) for b in args.batch.split(",")]
    serve_flags = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)] + (["--no-pipeline"] if args.no_pipeline else [])
    vocab_end = plain_vocab_end(model_dir)
    params = greedy_params(args.max_tokens)
    server = ServeProcess(model_dir, *serve_flags, env=thread_env(args.threads))
    llm = reader = None
    try:
        args.threads_in_force = set_torch_threads(args.threads)
        llm = LLM(str(model_dir), dtype=args.dtype, max_num_seqs=args.max_num_seqs, pipeline=not args.no_pipeline, show_progress=False)
        ring = server.ring_name()
        reader = WorkerRingReader(ring) if ring else None
        results = {}
        for batch in batches:
            warm = random_prompts(batch, args.prompt_len, WARMUP_SEED + batch, vocab_end)
            run_clients(server.port, warm, params)
            run_offline(llm, warm, params)
            serve_runs, offline_runs = [], []
            for rep in range(args.reps):
                prompts = random_prompts(batch, args.prompt_len, rep * 1000 + batch, vocab_end)
                watch = RingWatch(reader)
                before = {**server.process_cpu_s(), "client": own_cpu_s()}
                figures = {**run_clients(server.port, prompts, params, num_clients=args.clients, watch=watch).figures(), **watch.figures()}
                serve_runs.append({**figures, **cpu_ms_per_token(before, {**server.process_cpu_s(), "client": own_cpu_s()}, figures)})
                before = {"offline": own_cpu_s()}
                figures = run_offline(llm, prompts, params).figures()
                offline_runs.append({**figures, **cpu_ms_per_token(before, {"offline": own_cpu_s()}, figures)})
                meter.sample()
                note(f"batch {batch} rep {rep}: serve {serve_runs[-1]['throughput_tok_s']:.0f} tok/s, "
                     f"offline {offline_runs[-1]['throughput_tok_s']:.0f} tok/s")
            results[f"b{batch}"] = {
                "serve": median_figures(serve_runs),
                "offline": median_figures(offline_runs),
                "serve_vs_offline": paired_ratio(serve_runs, offline_runs),
                "serve_vs_offline_decode": paired_ratio(serve_runs, offline_runs, "decode_tok_s"),
            }
        return results
    finally:
        if reader is not None:
            reader.close()
        if llm is not None:
            llm.close()
        server.stop()


def own_cpu_s() -> float:
    """CPU seconds used so far by this process (all its threads)."""
    t = psutil.Process().cpu_times()
    return t.user + t.system


def cpu_ms_per_token(before: dict[str, float], after: dict[str, float], figures: dict) -> dict[str, float]:
    """CPU milliseconds per output token of each process over a run: where the time went."""
    tokens = figures["output_tokens"]
    return {f"cpu_ms_tok_{role}": round((after[role] - before.get(role, 0.0)) * 1e3 / tokens, 3) for role in after if role in before}


def main(argv: list[str] | None = None) -> int:
    """Run, print the table (stderr) and the JSON line (stdout)."""
    args = parse_args(argv)
    meter = LoadMeter()
    commit = git_commit()
    with tempfile.TemporaryDirectory(prefix="metrale-bench-") as tmp:
        model_dir = Path(args.model) if args.model else build_model(Path(tmp) / args.preset, args.preset)
        results = measure(args, model_dir, meter)
    rows = []
    for key, r in results.items():
        for engine in ("serve", "offline"):
            f = r[engine]
            rows.append([key, engine, f["throughput_tok_s"], f["decode_tok_s"], f["ttft_ms_p50"], f["ttft_ms_p99"],
                         f["itl_ms_p50"], f["itl_ms_p99"], r["serve_vs_offline"] if engine == "serve" else None])
    note(table(rows, ["batch", "engine", "tok/s", "decode tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "serve/offline"]))
    b32 = results.get("b32", {}).get("serve_vs_offline")
    emit({
        "bench": "serve",
        "commit": commit,
        "model": args.model or args.preset,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "pipeline": not args.no_pipeline,
        "clients": args.clients,
        "threads": args.threads,
        "offline_torch_threads": getattr(args, "threads_in_force", None),
        "results": results,
        "target_serve_vs_offline_b32": TARGET_SERVE_VS_OFFLINE,
        "target_met": None if b32 is None else b32 >= TARGET_SERVE_VS_OFFLINE,
        "machine": meter.report(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
