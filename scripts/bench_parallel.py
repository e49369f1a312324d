"""Tensor parallel and data parallel on this machine, as same-run ratios.

    python scripts/bench_parallel.py tp [--preset bench-small] [--dtype bfloat16] [--prompt-len 128]
        [--new-tokens 128] [--repeats 3]
    python scripts/bench_parallel.py dp [--preset bench-tiny] [--dtype bfloat16] [--batch 32] [--prompt-len 128]
        [--new-tokens 128] [--repeats 3]

tp: batch-1 decode ms/token through metrale.LLM, alternating in each repetition:
  tp1_inproc  LLM() as usual: the runner in this process, 2 torch threads
  tp1_worker  one worker process on a ticket ring, 2 torch threads (the path TP=2 takes, with one rank)
  tp2_shm     LLM(tensor_parallel_size=2): two ranks of one thread each, sums over the shared-memory all-reduce
  tp2_gloo    the same two ranks summing over gloo
ms/token = (time of a new-tokens + 1 token generation - time of a 1-token one on a fresh prompt) / new-tokens,
so prefill and start-up drop out. Ratios are medians over repetitions of same-repetition ratios.

dp: throughput at `batch` concurrent requests through `metrale serve --data-parallel-size 2` (a worker thread
per replica) vs `--data-parallel-size 1` (two worker threads), both servers up at once, runs alternated.

Output: a table on stderr, one JSON line on stdout. Run it on a quiet machine (the JSON says how busy it was).
"""

from __future__ import annotations

import argparse
import statistics
import time

from _bench_common import (
    LoadMeter,
    ServeProcess,
    emit,
    git_commit,
    greedy_params,
    note,
    plain_vocab_end,
    random_prompts,
    run_clients,
    table,
)


def _model(preset: str, dtype: str) -> str:
    """The preset's random Llama in this dtype, built once into the cache folder (as bench_offline.py does)."""
    from metrale.gpu_worker.tiny_model import FORMAT_VERSION, cached_model_dir

    return str(cached_model_dir(f"bench/{preset}-llama-{dtype}-v{FORMAT_VERSION}", preset, dtype))


def _ms_per_token(llm, prompt_a: list[int], prompt_b: list[int], new_tokens: int) -> float:
    """Decode ms/token: a long generation minus a one-token one, on two fresh prompts."""
    t0 = time.perf_counter()
    llm.generate([prompt_a], greedy_params(new_tokens + 1))
    long = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([prompt_b], greedy_params(1))
    short = time.perf_counter() - t0
    return (long - short) / new_tokens * 1e3


def _worker_llm(model_dir: str, dtype: str, threads: int):
    """An LLM whose one worker runs in a process of its own on a ring (TP=2's path with a single rank)."""
    from metrale import LLM
    from metrale.engine_core.engine import EngineCore, EngineOptions
    from metrale.llm import _spawn_group, special_tokens_of

    llm = LLM(model_dir, dtype=dtype, show_progress=False, worker_threads=threads)
    llm.device.close()
    llm.runner = None
    llm.device = _spawn_group(llm.args, llm.model_dir)
    llm.engine = EngineCore(llm.device, EngineOptions.from_args(llm.args), special_tokens=special_tokens_of(llm.tokenizer))
    return llm


def bench_tp(args) -> None:
    """TP=2 vs TP=1 batch-1 ms/token, gloo and shared memory."""
    import torch

    from metrale import LLM

    model = _model(args.preset, args.dtype)
    vocab_end = plain_vocab_end(model)
    torch.set_num_threads(2)
    meter = LoadMeter()
    llms = {
        "tp1_inproc": LLM(model, dtype=args.dtype, show_progress=False),
        "tp1_worker": _worker_llm(model, args.dtype, 2),
        "tp2_shm": LLM(model, dtype=args.dtype, show_progress=False, tensor_parallel_size=2, all_reduce="shm", worker_threads=1),
        "tp2_gloo": LLM(model, dtype=args.dtype, show_progress=False, tensor_parallel_size=2, all_reduce="gloo", worker_threads=1),
    }
    runs: dict[str, list[float]] = {name: [] for name in llms}
    try:
        for llm in llms.values():  # warm-up: first steps, kernels, caches
            _ms_per_token(llm, *random_prompts(2, args.prompt_len, 999, vocab_end), 8)
        for rep in range(args.repeats):
            for i, (name, llm) in enumerate(llms.items()):
                a, b = random_prompts(2, args.prompt_len, 1000 * rep + i, vocab_end)
                runs[name].append(_ms_per_token(llm, a, b, args.new_tokens))
                meter.sample()
    finally:
        for llm in llms.values():
            llm.close()
    med = {name: round(statistics.median(v), 3) for name, v in runs.items()}

    def ratio(a: str, b: str) -> float:
        return round(statistics.median(x / y for x, y in zip(runs[a], runs[b])), 3)

    record = {
        "bench": "parallel_tp", "commit": git_commit(), "preset": args.preset, "dtype": args.dtype,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
        **{f"{k}_ms_per_token": v for k, v in med.items()},
        "tp2_shm_over_tp1_worker": ratio("tp2_shm", "tp1_worker"),
        "tp2_gloo_over_tp1_worker": ratio("tp2_gloo", "tp1_worker"),
        "tp2_shm_over_tp1_inproc": ratio("tp2_shm", "tp1_inproc"),
        "tp2_gloo_over_tp2_shm": ratio("tp2_gloo", "tp2_shm"),
        "load": meter.report(),
    }
    note(table([[k, v] for k, v in med.items()], ["config", "ms/token"]))
    emit(record)


def bench_dp(args) -> None:
    """DP=2 vs DP=1 throughput at a batch of concurrent requests through metrale serve."""
    model = _model(args.preset, args.dtype)
    vocab_end = plain_vocab_end(model)
    meter = LoadMeter()
    common = ["--dtype", args.dtype, "--max-num-seqs", str(max(64, args.batch))]
    servers = {
        "dp1": ServeProcess(model, *common, "--worker-threads", "2"),
        "dp2": ServeProcess(model, *common, "--data-parallel-size", "2", "--worker-threads", "1"),
    }
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    try:
        params = greedy_params(args.new_tokens)
        for name, server in servers.items():  # warm-up
            run_clients(server.port, random_prompts(4, args.prompt_len, 999, vocab_end), greedy_params(8))
        for rep in range(args.repeats):
            for i, (name, server) in enumerate(servers.items()):
                prompts = random_prompts(args.batch, args.prompt_len, 1000 * rep + i, vocab_end)
                runs[name].append(run_clients(server.port, prompts, params).figures())
                meter.sample()
    finally:
        for server in servers.values():
            server.stop()
    tput = {name: round(statistics.median(r["throughput_tok_s"] for r in v), 1) for name, v in runs.items()}
    ratio = round(statistics.median(a["throughput_tok_s"] / b["throughput_tok_s"] for a, b in zip(runs["dp2"], runs["dp1"])), 3)
    record = {
        "bench": "parallel_dp", "commit": git_commit(), "preset": args.preset, "dtype": args.dtype, "batch": args.batch,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "dp1_tok_s": tput["dp1"], "dp2_tok_s": tput["dp2"], "dp2_over_dp1": ratio, "load": meter.report(),
    }
    note(table([[k, v] for k, v in tput.items()], ["config", "output tok/s"]))
    emit(record)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    tp = sub.add_parser("tp")
    tp.add_argument("--preset", default="bench-small")
    tp.add_argument("--new-tokens", type=int, default=128)
    dp = sub.add_parser("dp")
    dp.add_argument("--preset", default="bench-tiny")
    dp.add_argument("--batch", type=int, default=32)
    dp.add_argument("--new-tokens", type=int, default=128)
    for p in (tp, dp):
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--prompt-len", type=int, default=128)
        p.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    (bench_tp if args.what == "tp" else bench_dp)(args)


if __name__ == "__main__":
    main()
