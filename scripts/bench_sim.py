"""The lane at GPU scale without a GPU: `metrale serve` on the simulated device, pipelined against --no-pipeline.

The worker serves the real ticket ring with gpu_worker/sim_runner.py (METRALE_SIMULATE_DEVICE): each step takes
a + b·rows + c·tokens ms and sleeps meanwhile, so the host's only cost is the engine core's (and the frontend's
and this client's) own work, and the device's idle share says whether it waited on Python. The model folder is
weightless (config.json and tokenizer of the preset; the step cost, not the folder, stands for the model).

For each concurrency level N (default 64, 256, 1024) two servers start with --max-num-seqs N, one pipelined and
one --no-pipeline, and the same workload runs on each, alternately (the order swapped every repetition; a fresh
seed per repetition). A workload is `waves` × N streamed requests sent at Poisson times, at `load` × the rate the
device could serve at N rows (so the batch fills and a queue forms); prompts and max_tokens uniform over the
ranges; a share of the requests open with one of a few shared prefixes (the prefix cache), a share carry
penalties (fed ahead like plain rows: the device fills the fed token into their history), a share are grammar
rows (a choice list; not fed ahead: their bitmask waits for the commit); ignore_eos, so every request makes exactly its max_tokens (a grammar row fewer:
it ends when its choice is done). With --kv-blocks the pool is that small, so the scheduler preempts.

Figures per level and mode (medians over repetitions): output throughput; the device's idle fraction of wall
time from the first send to the last token (1 − Δbusy ÷ Δwall of the worker's counters in the ring header, as
_bench_common.idle_fraction reads them); the device's mean step; the host's time per tick: the engine core's
CPU seconds ÷ steps (each tick launches one step), also as a share of the mean step, with the frontend's beside
it. pipelined_vs_no_pipeline is the median paired throughput ratio. Issue 27's targets: idle < 1 % at 256 with
a 5 ms step and < 3 % at 1,024 with an 8 ms step (pipelined); throughput ≥ 1.2× synchronous at 256; the
engine core's time per tick at 1,024 rows ≤ 40 % of the step. On a busy or small box the client and frontend
share the engine core's cores, so figures from one are a floor, not the engine's.

With --api-servers A,B the two servers are both pipelined, with --api-server-count A and B (issue 36: the frontend's
CPU per process should halve from 1 to 2): the clients spread over the frontends' ZMQ ports in turn;
frontend_cpu_ms_per_tick is every frontend's CPU together, frontend_cpu_ms_per_tick_per_process one frontend's on
average and frontend_cpu_ms_per_tick_max the busiest one's. The ratio is then api_servers_B_vs_api_servers_A. The
same CPU is also given per output token (*_cpu_us_per_token): two servers that batch the same workload into
different numbers of steps (more tokens a step) differ per tick at the same load, not per token.

    python scripts/bench_sim.py [--levels 64,256,1024] [--step-ms 3,0.003,0.002] [--waves 2] [--load 1.2]
                                [--prompt-len 32,512] [--max-tokens 16,256] [--reps 1] [--shared-prefix 0.5]
                                [--penalties 0.25] [--grammar 0.05] [--kv-blocks N] [--clients 64]
                                [--api-servers 1,2]

Prints one JSON line on stdout (tables go to stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import (  # noqa: E402
    FIRST_PLAIN_TOKEN,
    LoadMeter,
    RingWatch,
    ServeProcess,
    WorkerRingReader,
    close_all,
    emit,
    git_commit,
    median_figures,
    note,
    paired_ratio,
    plain_vocab_end,
    run_clients,
    settle,
    table,
)

MODES = {"pipelined": [], "no_pipeline": ["--no-pipeline"]}  # the two servers compared: their flags
NUM_PREFIXES = 4
PREFIX_LEN = 256
CHOICES = ["alpha", "beta", "gamma", "delta"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="64,256,1024", help="concurrent requests (--max-num-seqs) per level")
    ap.add_argument("--step-ms", default="3,0.003,0.002", help="the simulated step: A,B,C = ms + ms/row + ms/token")
    ap.add_argument("--preset", default="bench-small", help="tiny_model preset of the weightless folder")
    ap.add_argument("--waves", type=float, default=2.0, help="requests per run = waves × N")
    ap.add_argument("--load", type=float, default=1.2, help="offered rate ÷ the device's rate at N decode rows")
    ap.add_argument("--prompt-len", default="32,512", help="MIN,MAX prompt tokens (uniform; shared prefix included)")
    ap.add_argument("--max-tokens", default="16,256", help="MIN,MAX new tokens (uniform)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--shared-prefix", type=float, default=0.5, help="share of requests opening with a shared prefix")
    ap.add_argument("--penalties", type=float, default=0.25, help="share of requests with penalties")
    ap.add_argument("--grammar", type=float, default=0.05, help="share of requests that are grammar rows (a choice)")
    ap.add_argument("--kv-blocks", type=int, default=None, help="KV pool size (small: preemption)")
    ap.add_argument("--clients", type=int, default=64, help="AsyncClients the requests are spread over")
    ap.add_argument("--api-servers", default=None,
                    help="A,B: compare two pipelined servers with --api-server-count A and B (instead of pipelined "
                         "against --no-pipeline)")
    args = ap.parse_args(argv)
    if args.api_servers:
        a, b = (int(x) for x in args.api_servers.split(","))
        args.modes = {f"api_servers_{k}": ["--api-server-count", str(k)] for k in (a, b)}
    else:
        args.modes = MODES
    args.level_list = [int(x) for x in args.levels.split(",")]
    args.prompt_range = _range(args.prompt_len)
    args.output_range = _range(args.max_tokens)
    from metrale.gpu_worker.sim_runner import StepCost

    args.cost = StepCost.parse(args.step_ms)
    return args


def _range(text: str) -> tuple[int, int]:
    parts = [int(x) for x in text.split(",")]
    return parts[0], parts[-1]


def workload(seed: int, n: int, rate: float, args: argparse.Namespace, vocab_end: int):
    """(send offsets, prompts, SamplingParams, expected output tokens) of n requests, fixed by the seed."""
    from metrale.ipc.sampling import SamplingParams, StructuredOutputs

    rng = np.random.default_rng(seed)
    prefixes = np.random.default_rng(12345).integers(FIRST_PLAIN_TOKEN, vocab_end, size=(NUM_PREFIXES, PREFIX_LEN))
    offsets = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, size=n - 1))]).tolist()
    prompts, params, expect = [], [], []
    for _ in range(n):
        length = int(rng.integers(args.prompt_range[0], args.prompt_range[1] + 1))
        prompt = rng.integers(FIRST_PLAIN_TOKEN, vocab_end, size=length).tolist()
        if rng.random() < args.shared_prefix and length > PREFIX_LEN:
            prompt[:PREFIX_LEN] = prefixes[rng.integers(NUM_PREFIXES)].tolist()
        max_tokens = int(rng.integers(args.output_range[0], args.output_range[1] + 1))
        p = dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        kind = rng.random()
        if kind < args.grammar:
            p.update(structured_outputs=StructuredOutputs(choice=CHOICES), ignore_eos=False)
            max_tokens = None  # it ends with its choice
        elif kind < args.grammar + args.penalties:
            p.update(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2)
        prompts.append(prompt)
        params.append(SamplingParams(**p))
        expect.append(max_tokens)
    return offsets, prompts, params, expect


def run_once(server: ServeProcess, watch: RingWatch, work, num_clients: int) -> dict:
    """One run of the workload against a server; its figures."""
    offsets, prompts, params, expect = work
    cpu0 = process_cpu_s(server)
    timeline = run_clients(server.ports, prompts, params, num_clients, watch, offsets)
    cpu1 = process_cpu_s(server)
    figures = timeline.figures()
    for key in ("decode_tok_s", "itl_ms_p99", "tpot_ms_median"):
        figures.pop(key, None)
    figures["send_lag_ms_max"] = round(timeline.send_lag_s * 1e3, 3)
    got = {rid: sum(n for _, n in arr) for rid, arr in timeline.arrivals.items()}
    short = [i for i, k in enumerate(expect) if k is not None and got.get(f"bench-{i}", 0) != k]
    if short:
        raise RuntimeError(f"{len(short)} requests did not stream their max_tokens (first: bench-{short[0]})")
    ring = watch.figures()
    figures["device_idle"] = ring["worker_idle_run"]
    steps = ring["worker_steps"] or 0
    figures["steps"] = steps
    if steps and watch.at_start is not None:
        busy = watch.at_end.since(watch.at_start).busy_ns / 1e9
        figures["step_ms_mean"] = round(busy / steps * 1e3, 3)
        for role in ("engine_core", "frontend"):
            if role in cpu0 and role in cpu1:
                figures[f"{role}_cpu_ms_per_tick"] = round((cpu1[role] - cpu0[role]) / steps * 1e3, 3)
        each = [(cpu1[k] - cpu0[k]) / steps * 1e3 for k in cpu1 if k.startswith("frontend ") and k in cpu0]
        if each:  # per frontend process (a frontend restarted meanwhile would be missing: none is here)
            figures["frontends"] = len(each)
            figures["frontend_cpu_ms_per_tick_per_process"] = round(sum(each) / len(each), 3)
            figures["frontend_cpu_ms_per_tick_max"] = round(max(each), 3)
    tokens = figures.get("output_tokens")
    if tokens:  # per token: the same for two servers given the same workload, whatever their steps' sizes
        for role in ("engine_core", "frontend"):
            if role in cpu0 and role in cpu1:
                figures[f"{role}_cpu_us_per_token"] = round((cpu1[role] - cpu0[role]) / tokens * 1e6, 2)
        if figures.get("frontends"):
            figures["frontend_cpu_us_per_token_per_process"] = round(
                figures["frontend_cpu_us_per_token"] / figures["frontends"], 2)
        if "engine_core_cpu_ms_per_tick" in figures:
            figures["tick_vs_step"] = round(figures["engine_core_cpu_ms_per_tick"] / figures["step_ms_mean"], 3)
    return figures


def process_cpu_s(server: ServeProcess) -> dict[str, float]:
    """CPU seconds so far of the server's engine core and frontends, by role (every frontend together under
    "frontend", each also under "frontend PID")."""
    roles = {"metrale.engine_core.core": "engine_core", "metrale.frontend_process": "frontend"}
    out: dict[str, float] = {}
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(server.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                role = next((r for key, r in roles.items() if key in p.cmdline()), None)
                if role is not None:
                    t = p.cpu_times()
                    out[role] = out.get(role, 0.0) + t.user + t.system
                    if role == "frontend":
                        out[f"frontend {p.pid}"] = t.user + t.system
    return out


def measure_level(n: int, args: argparse.Namespace, model_dir: Path, vocab_end: int, meter: LoadMeter) -> dict:
    """Both servers at --max-num-seqs n, the repetitions alternated; every run's figures by mode."""
    flags = ["--max-num-seqs", str(n), "--max-model-len", "2048"]
    if args.kv_blocks:
        flags += ["--num-kv-blocks", str(args.kv_blocks)]
    env = {"METRALE_SIMULATE_DEVICE": args.step_ms}
    mean_out = sum(args.output_range) / 2
    rate = args.load * n / (mean_out * args.cost.seconds(n, n))  # requests/s the device serves at n decode rows
    requests = max(1, int(args.waves * n))
    servers: dict[str, ServeProcess] = {}
    readers: dict[str, WorkerRingReader | None] = {}
    modes = list(args.modes)
    try:
        for mode, mode_flags in args.modes.items():
            servers[mode] = ServeProcess(model_dir, *flags, *mode_flags, env=env)
        for mode, server in servers.items():
            readers[mode] = WorkerRingReader(server.ring_name())
        warm = workload(30_000 + n, min(32, requests), rate, args, vocab_end)
        for mode in modes:
            run_once(servers[mode], RingWatch(readers[mode]), warm, args.clients)
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for rep in range(args.reps):
            work = workload(rep, requests, rate, args, vocab_end)
            for mode in (modes if rep % 2 == 0 else modes[::-1]):
                settle(0.3, max_s=2.0)
                runs[mode].append(run_once(servers[mode], RingWatch(readers[mode]), work, args.clients))
            meter.sample()
            note(f"N={n} rep {rep}: " + ", ".join(
                f"{m} {runs[m][-1]['throughput_tok_s']:.0f} tok/s idle {runs[m][-1]['device_idle']} "
                f"tick {runs[m][-1].get('engine_core_cpu_ms_per_tick')} ms "
                f"frontend {runs[m][-1].get('frontend_cpu_ms_per_tick_per_process')} ms/tick a process" for m in modes))
        return {"rate_req_s": round(rate, 2), "requests": requests, "runs": runs}
    finally:
        close_all(readers, servers)


def main(argv: list[str] | None = None) -> int:
    """Run every level, print the table (stderr) and the JSON line (stdout)."""
    from metrale.gpu_worker.sim_runner import write_weightless_model

    args = parse_args(argv)
    meter = LoadMeter()
    commit = git_commit()
    levels = {}
    with tempfile.TemporaryDirectory(prefix="metrale-bench-sim-") as tmp:
        model_dir = write_weightless_model(Path(tmp) / args.preset, args.preset)
        vocab_end = plain_vocab_end(model_dir)
        first, second = list(args.modes)
        ratio = "pipelined_vs_no_pipeline" if first == "pipelined" else f"{second}_vs_{first}"
        for n in args.level_list:
            got = measure_level(n, args, model_dir, vocab_end, meter)
            levels[str(n)] = {
                "rate_req_s": got["rate_req_s"],
                "requests": got["requests"],
                "step_ms_at_n_decodes": round(args.cost.seconds(n, n) * 1e3, 3),
                **{m: median_figures(got["runs"][m]) for m in args.modes},
                # pipelined ÷ no_pipeline, or B ÷ A frontends
                ratio: paired_ratio(*(got["runs"][m] for m in
                                      ((first, second) if first == "pipelined" else (second, first)))),
            }
    rows = [[n, m, f[m]["throughput_tok_s"], f[m]["device_idle"], f[m].get("step_ms_mean"),
             f[m].get("engine_core_cpu_ms_per_tick"), f[m].get("tick_vs_step"), f[m].get("frontend_cpu_ms_per_tick"),
             f[m].get("frontend_cpu_ms_per_tick_per_process"), f[m].get("frontend_cpu_us_per_token_per_process"),
             f[ratio] if m == first else None]
            for n, f in levels.items() for m in args.modes]
    note(table(rows, ["N", "mode", "tok/s", "device idle", "step ms", "engine ms/tick", "tick/step",
                      "frontend ms/tick", "per frontend", "µs/token per frontend", ratio.replace("_vs_", "/")]))
    emit({
        "bench": "sim",
        "commit": commit,
        "step_ms": [args.cost.a_ms, args.cost.b_ms, args.cost.c_ms],
        "step_cost_source": "assumed (bench-small on an H200, not measured)",
        "preset": args.preset,
        "prompt_len": list(args.prompt_range),
        "max_tokens": list(args.output_range),
        "waves": args.waves,
        "load": args.load,
        "reps": args.reps,
        "shared_prefix": args.shared_prefix,
        "penalties": args.penalties,
        "grammar": args.grammar,
        "kv_blocks": args.kv_blocks,
        "clients": args.clients,
        "modes": args.modes,
        "levels": levels,
        "targets": {"idle_256_5ms": 0.01, "idle_1024_8ms": 0.03, "gain_256": 1.2, "tick_vs_step_1024": 0.4},
        "machine": meter.report(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
