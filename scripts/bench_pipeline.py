"""The pipelined decode lane vs the synchronous loop, both through `metrale serve`, with the worker's idle share.

Starts two servers on the same model — one as shipped (lane on), one with `--no-pipeline` — and alternates
runs of the same requests between them (pipelined, synchronous, pipelined, ...; a fresh prompt set per
repetition). Each run is `batch` concurrent requests of `prompt-len` random token ids, greedy, exactly
`max-tokens` new tokens, one AsyncClient per request.

The worker's idle fraction (time it waited for a plan ÷ wall time) is read from the header of each
server's ticket ring: the benchmark attaches to the segment the worker serves (its `--ring NAME`, under
/dev/shm) and reads the counters the worker publishes after every step (TicketRing.worker_stats) at
the edges of each run and of its steady-decode window (every request decoding). It writes nothing there.

    python scripts/bench_pipeline.py [--model DIR] [--dtype bfloat16] [--batch 1,8,32] [--prompt-len 128]
                                     [--max-tokens 128] [--reps 3] [--threads N]

Prints one JSON line on stdout (the table goes to stderr). pipelined_vs_sync is the median over
repetitions of the paired ratio of steady-decode throughput. Targets (at batch 32, lane on): worker idle
< 5 % and a visible gain over the synchronous loop.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import (  # noqa: E402
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
    random_prompts,
    run_clients,
    table,
    thread_env,
)

TARGET_IDLE_B32 = 0.05
WARMUP_SEED = 20_000
MODES = ("pipelined", "sync")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: build bench-tiny in a temp folder)")
    ap.add_argument("--preset", default="bench-tiny")
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the servers (default: torch's own)")
    return ap.parse_args(argv)


def measure(args: argparse.Namespace, model_dir: Path, meter: LoadMeter) -> dict:
    """Both servers up, runs alternated; figures per batch size and mode."""
    flags = ["--dtype", args.dtype]
    vocab_end = plain_vocab_end(model_dir)
    params = greedy_params(args.max_tokens)
    servers: dict[str, ServeProcess] = {}
    readers: dict[str, WorkerRingReader | None] = {}
    try:
        servers["pipelined"] = ServeProcess(model_dir, *flags, env=thread_env(args.threads))
        servers["sync"] = ServeProcess(model_dir, *flags, "--no-pipeline", env=thread_env(args.threads))
        for mode, server in servers.items():
            ring = server.ring_name()
            readers[mode] = WorkerRingReader(ring) if ring else None
            if ring is None:
                note(f"{mode}: the worker's ring was not found; no idle figures")
        results = {}
        for batch in (int(b) for b in args.batch.split(",")):
            warm = random_prompts(batch, args.prompt_len, WARMUP_SEED + batch, vocab_end)
            for mode in MODES:
                run_clients(servers[mode].port, warm, params)
            runs: dict[str, list[dict]] = {m: [] for m in MODES}
            for rep in range(args.reps):
                prompts = random_prompts(batch, args.prompt_len, rep * 1000 + batch, vocab_end)
                for mode in MODES:
                    watch = RingWatch(readers[mode])
                    figures = run_clients(servers[mode].port, prompts, params, watch=watch).figures()
                    runs[mode].append({**figures, **watch.figures()})
                meter.sample()
                note(f"batch {batch} rep {rep}: " + ", ".join(
                    f"{m} {runs[m][-1]['decode_tok_s'] or 0:.0f} decode tok/s, idle {runs[m][-1]['worker_idle_decode']}" for m in MODES))
            results[f"b{batch}"] = {
                **{m: median_figures(runs[m]) for m in MODES},
                "pipelined_vs_sync": paired_ratio(runs["pipelined"], runs["sync"], "decode_tok_s"),
                "pipelined_vs_sync_throughput": paired_ratio(runs["pipelined"], runs["sync"]),
            }
        return results
    finally:
        close_all(readers, servers)


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
        for mode in MODES:
            f = r[mode]
            rows.append([key, mode, f["throughput_tok_s"], f["decode_tok_s"], f["itl_ms_p50"], f["itl_ms_p99"],
                         f["worker_idle_decode"], f["worker_idle_run"], r["pipelined_vs_sync"] if mode == "pipelined" else None])
    note(table(rows, ["batch", "loop", "tok/s", "decode tok/s", "ITL p50 ms", "ITL p99 ms", "idle (decode)", "idle (run)", "pipelined/sync"]))
    b32 = results.get("b32")
    emit({
        "bench": "pipeline",
        "commit": commit,
        "model": args.model or args.preset,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "threads": args.threads,
        "results": results,
        "target_idle_b32": TARGET_IDLE_B32,
        "target_idle_met": None if b32 is None or b32["pipelined"]["worker_idle_decode"] is None
        else b32["pipelined"]["worker_idle_decode"] < TARGET_IDLE_B32,
        "gain_b32": None if b32 is None else b32["pipelined_vs_sync"],
        "machine": meter.report(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
