"""How long a SIGKILLed worker costs: from the kill to the first token of a resumed stream, over repeated kills.

Starts `metrale serve` as a subprocess (any free port; stopped, with nothing left behind, on every path). Each
round streams `streams` requests (random prompts of `prompt-len` ids, greedy, exactly `max-tokens` new tokens)
and, once every stream has `kill-after` tokens, SIGKILLs the worker. The supervisor starts a new one (a real
restart: python, torch, the model load); the engine core requeues what was running and recomputes it. Every
delta's arrival is timed on CLOCK_MONOTONIC, which the engine core's log lines share ("ready at monotonic T",
"first tokens ... at monotonic T"), so each kill splits into:

    kill_to_first_token   SIGKILL -> the first token a client receives from a resumed stream (model load included)
    ready_to_first_token  the new worker ready -> that token: requeue, recompute (prefill of prompt + streamed
                          tokens), the first new decode, and the trip to the client (model load excluded)
    kill_to_ready         SIGKILL -> the new worker ready (process start, imports, model load)
    engine_recompute      the new worker ready -> the engine core sends those first tokens (its own log)

Every stream must still complete with exactly max-tokens tokens and no error. Prints one JSON line on stdout
(progress on stderr):

    python scripts/bench_faults.py [--model DIR | --preset test] [--kills 10] [--streams 32]
                                   [--prompt-len 64] [--max-tokens 64] [--kill-after 8] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import (  # noqa: E402
    LoadMeter,
    ServeProcess,
    build_model,
    emit,
    git_commit,
    greedy_params,
    note,
    plain_vocab_end,
    random_prompts,
    thread_env,
)

READY = re.compile(r"new worker ready .* \(ready at monotonic ([\d.]+)\)")
FIRST = re.compile(r"first tokens .* \(at monotonic ([\d.]+)\)")


def worker_pid(server: ServeProcess) -> int:
    """The pid of the server's live GPU worker."""
    for p in psutil.Process(server.proc.pid).children():
        if "metrale.gpu_worker.worker" in p.cmdline():
            return p.pid
    raise RuntimeError("metrale serve has no worker process")


async def one_round(port: int, prompts, params, kill_after: int, kill) -> tuple[float, list[list[float]], list]:
    """Stream every prompt; kill() once each stream has kill_after tokens. (kill time, arrivals, results)."""
    from metrale.frontend.client import AsyncClient

    arrivals: list[list[float]] = [[] for _ in prompts]
    counts = [0] * len(prompts)
    under_way = asyncio.Event()

    async def stream(client, i):
        n, finish = 0, None
        async for d in client.generate(token_ids=prompts[i], params=params):
            if d.token_ids:
                arrivals[i].append(time.monotonic())
                n += len(d.token_ids)
                counts[i] = n
                if min(counts) >= kill_after:
                    under_way.set()
            finish = d.finish_reason or finish
        return n, finish

    async with AsyncClient("127.0.0.1", port, timeout=600) as client:
        tasks = [asyncio.ensure_future(stream(client, i)) for i in range(len(prompts))]
        await under_way.wait()
        t_kill = time.monotonic()
        kill()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return t_kill, arrivals, results


def summary(values: list[float]) -> dict:
    """Median, min and max, in seconds (3 decimals)."""
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: build --preset in a temp folder)")
    ap.add_argument("--preset", default="test", help="tiny-model preset built when --model is not given")
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kill-after", type=int, default=8, help="tokens every stream has before the kill")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads of each torch process")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: the server's choice)")
    args = ap.parse_args()
    if args.kill_after >= args.max_tokens:
        ap.error("--kill-after must be below --max-tokens")

    with tempfile.TemporaryDirectory(prefix="metrale-bench-faults-") as tmp:
        model_dir = args.model or build_model(tmp, args.preset)
        vocab_end = plain_vocab_end(model_dir)
        params = greedy_params(args.max_tokens)
        flags = ["--device", args.device] if args.device else []
        meter = LoadMeter()
        with ServeProcess(model_dir, *flags, env=thread_env(args.threads)) as server:
            rounds = []
            for k in range(args.kills):
                prompts = random_prompts(args.streams, args.prompt_len, seed=1000 + k, vocab_end=vocab_end)
                victim = worker_pid(server)
                t_kill, arrivals, results = asyncio.run(
                    one_round(server.port, prompts, params, args.kill_after, lambda: os.kill(victim, signal.SIGKILL))
                )
                meter.sample()
                bad = [r for r in results if isinstance(r, BaseException) or r != (args.max_tokens, "length")]
                if bad:
                    raise SystemExit(f"kill {k}: {len(bad)} streams did not complete: {bad[:3]}")
                log = server.log_text()
                t_ready = float(READY.findall(log)[k])
                t_engine_first = float(FIRST.findall(log)[k])
                t_first = min(t for a in arrivals for t in a if t > t_ready)
                rounds.append({
                    "kill_to_first_token": t_first - t_kill,
                    "ready_to_first_token": t_first - t_ready,
                    "kill_to_ready": t_ready - t_kill,
                    "engine_recompute": t_engine_first - t_ready,
                })
                note(f"kill {k + 1}/{args.kills}: first resumed token {rounds[-1]['kill_to_first_token']:.3f} s after "
                     f"the kill, {rounds[-1]['ready_to_first_token'] * 1000:.1f} ms after the new worker was ready")
        figures = {name: summary([r[name] for r in rounds]) for name in rounds[0]}
        emit({
            "bench": "faults",
            "commit": git_commit(),
            "model": str(args.model or f"tiny:{args.preset}"),
            "kills": args.kills,
            "streams": args.streams,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "kill_to_first_token_s_median": figures["kill_to_first_token"]["median"],
            "ready_to_first_token_s_median": figures["ready_to_first_token"]["median"],
            "seconds": figures,
            "all_streams_complete": True,
            "load": meter.report(),
        })


if __name__ == "__main__":
    main()
