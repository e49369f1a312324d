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
    engine_fault_to_resumed  the fault's start as the engine core knows it (the death noticed, or the hung step's
                          start) -> its first token of a resumed request (its log): the device's idle time
    hang_detect           (--fault stop) the stuck step's start -> the engine core's kill of the hung worker
                          (its log's "made no progress for X s"); detect_to_resumed is the rest (the new worker's
                          start, the recompute)
    engine_recompute      the new worker ready -> the engine core sends those first tokens (its own log)

Every stream must still complete with exactly max-tokens tokens and no error.

--fault picks what is done at the kill point: `kill` (SIGKILL the worker, above), `stop` (SIGSTOP the worker: the
engine core's hang watch kills it and a new one starts) or `engine` (SIGKILL the engine core: the supervisor starts
a fresh one with fresh workers and the frontend resubmits its requests with the tokens they streamed), `frontend`
(SIGKILL the frontend: the supervisor starts a new one on the same port, the engine core runs on, and the client
re-attaches every stream where it was, docs/protocol.md §5.6; `stall_s` is then the time from the kill to the first
token after it, as no token can come meanwhile) or
`stop-prefill` (each round streams without a fault, then SIGSTOPs the worker and sends one --long-prompt prompt of
4,000 tokens by default, as one step: the hang watch must kill the worker within --worker-hang-timeout plus the
prefill's expected time; the figures are the engine core's: the stuck step's work, expected and allowed time). `stall_s` is
the longest time no stream received a token, from the fault to the end of the round (a fault-free round's
is about one step): how long the device stood idle, as the clients see it. The log-based splits are given for the
worker faults only.

--simulate A,B,C serves the simulated device (gpu_worker/sim_runner.py: a weightless bench-small folder, each step
A + B·rows + C·tokens ms, slept) with --max-num-seqs = streams, so a fault can be measured at GPU-scale
concurrency (1,024 streams) on any box; every stream must then also equal the tokens the simulated device gives
its prompt without a fault (sim_runner.expected_tokens), so nothing is lost or changed by the fault. The fault is
sent when the clients have seen kill-after tokens a stream, and at 1,024 streams the clients see tokens well after
the simulated device made them: give --max-tokens enough (512) that the device still has work when the fault lands.
The client-side stall then understates the device's idle time (a backlog of tokens reaches the clients after the
fault); engine_fault_to_resumed is the engine core's own measure of it.

Prints one JSON line on stdout (progress on stderr):

    python scripts/bench_faults.py [--model DIR | --preset test | --simulate A,B,C] [--fault kill|stop|engine|frontend]
                                   [--kills 10] [--streams 32] [--prompt-len 64] [--max-tokens 64] [--kill-after 8]
                                   [--worker-hang-timeout S] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

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
HUNG = re.compile(r"worker lost \(.*made no progress for ([\d.]+) s")
STUCK = re.compile(r"worker lost \(.*a step of (\d+) prefill tokens and (\d+) decode positions, "
                   r"expected to take ([\d.]+) s; allowed ([\d.]+) s")
RESUMED = re.compile(r"the first resumed token came ([\d.]+) s after the fault")


ROLES = {"worker": "metrale.gpu_worker.worker", "engine": "metrale.engine_core.core",
         "frontend": "metrale.frontend_process"}


def child_pid(server: ServeProcess, role: str) -> int:
    """The pid of the server's live GPU worker (role "worker") or engine core ("engine")."""
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if ROLES[role] in p.cmdline():
                return p.pid
    raise RuntimeError(f"metrale serve has no {role} process")


def fault_action(server: ServeProcess, fault: str):
    """What the round does at the kill point."""
    if fault in ("engine", "frontend"):
        pid = child_pid(server, fault)
        return lambda: os.kill(pid, signal.SIGKILL)
    pid = child_pid(server, "worker")
    return lambda: os.kill(pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)


def stall(arrivals: list[list[float]], since: float) -> float:
    """The longest time after `since` (the fault) that no stream received a token."""
    times = sorted([since, *(t for a in arrivals for t in a if t >= since)])
    return max(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else 0.0


async def one_round(port: int, prompts, params, kill_after: int, kill) -> tuple[float, list[list[float]], list]:
    """Stream every prompt; kill() once each stream has kill_after tokens. (kill time, arrivals, results)."""
    from metrale.frontend.client import AsyncClient

    arrivals: list[list[float]] = [[] for _ in prompts]
    counts = [0] * len(prompts)
    under_way = asyncio.Event()
    below = [len(prompts)]  # streams still short of kill_after tokens

    async def stream(client, i):
        tokens, finish = [], None
        async for d in client.generate(token_ids=prompts[i], params=params):
            if d.token_ids:
                arrivals[i].append(time.monotonic())
                before = counts[i]
                tokens += d.token_ids
                counts[i] = len(tokens)
                if before < kill_after <= counts[i]:
                    below[0] -= 1
                    if below[0] == 0:
                        under_way.set()
            finish = d.finish_reason or finish
        return tokens, finish

    async with AsyncClient("127.0.0.1", port, timeout=600) as client:
        tasks = [asyncio.ensure_future(stream(client, i)) for i in range(len(prompts))]
        await under_way.wait()
        t_kill = time.monotonic()
        kill()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return t_kill, arrivals, results


def emit_prefill_hangs(server: ServeProcess, args, vocab: int, vocab_end: int, meter: LoadMeter) -> None:
    """--fault stop-prefill: each round streams the requests without a fault (the hang watch measures the steps),
    then SIGSTOPs the worker and sends one --long-prompt prompt, whose prefill is then the step in flight; the
    engine core's log says when it killed the worker and what the step was allowed. Prints the JSON line."""
    from metrale.frontend.client import AsyncClient

    params = greedy_params(args.max_tokens)
    rounds = []
    for k in range(args.kills):
        prompts = random_prompts(args.streams, args.prompt_len, seed=1000 + k, vocab_end=vocab_end)
        asyncio.run(one_round(server.port, prompts, params, args.kill_after, lambda: None))
        asyncio.run(wait_idle(server.port))  # a step launched ahead of the streams' last one is settled too
        long_prompt = random_prompts(1, args.long_prompt, seed=2000 + k, vocab_end=vocab_end)[0]
        os.kill(child_pid(server, "worker"), signal.SIGSTOP)

        async def one() -> list[int]:
            async with AsyncClient("127.0.0.1", server.port, timeout=600) as client:
                return (await client.complete(token_ids=long_prompt, params=params)).token_ids

        tokens = asyncio.run(one())
        meter.sample()
        if len(tokens) != args.max_tokens or (args.simulate is not None
                                              and tokens != expected_tokens(long_prompt, args.max_tokens, vocab)):
            raise SystemExit(f"round {k}: the long prompt's tokens differ from its fault-free run")
        log = server.log_text()
        if len(STUCK.findall(log)) <= k:
            raise SystemExit(f"round {k}: no hung prefill in the engine core's log; it ends:\n{log[-2000:]}")
        prefill, decode, expected, allowed = STUCK.findall(log)[k]
        rounds.append({"prefill_tokens": int(prefill), "decode_positions": int(decode), "expected_s": float(expected),
                       "allowed_s": float(allowed), "hang_detect_s": float(HUNG.findall(log)[k]),
                       "fault_to_resumed_s": float(RESUMED.findall(log)[k])})
        note(f"prefill hang {k + 1}/{args.kills}: {rounds[-1]}")
    timeout = args.worker_hang_timeout if args.worker_hang_timeout is not None else 10.0
    emit({
        "bench": "faults",
        "commit": git_commit(),
        "model": f"simulated:{args.simulate}" if args.simulate is not None else str(args.model or f"tiny:{args.preset}"),
        "fault": "stop-prefill",
        "kills": args.kills,
        "long_prompt": args.long_prompt,
        "streams": args.streams,
        "rounds": rounds,
        # the target: killed within the timeout plus the step's expected time (the watch allows it twice)
        "within_timeout_plus_2x_expected": sum(r["hang_detect_s"] <= timeout + 2 * r["expected_s"] + 0.15
                                               for r in rounds),
        "load": meter.report(),
    })


async def wait_idle(port: int, timeout_s: float = 60.0) -> None:
    """Until the engine core runs nothing and holds no KV block (polling its counters: there is no event)."""
    from metrale.frontend.client import AsyncClient

    deadline = time.monotonic() + timeout_s
    async with AsyncClient("127.0.0.1", port, timeout=30) as client:
        while time.monotonic() < deadline:
            stats = await client.stats()
            if stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0:
                return
            await asyncio.sleep(0.05)
    raise SystemExit(f"the engine core did not go idle within {timeout_s:.0f} s")


def expected_tokens(prompt: list[int], n: int, vocab: int) -> list[int]:
    from metrale.gpu_worker.sim_runner import expected_tokens as simulated

    return simulated(prompt, n, vocab)


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
    ap.add_argument("--fault", choices=("kill", "stop", "engine", "frontend", "stop-prefill"), default="kill",
                    help="SIGKILL the worker, SIGSTOP it, SIGKILL the engine core, SIGKILL the frontend, or SIGSTOP "
                         "the worker before a --long-prompt prefill")
    ap.add_argument("--long-prompt", type=int, default=4000,
                    help="the prefill's tokens (--fault stop-prefill; the simulated model holds 4,096 positions)")
    ap.add_argument("--worker-hang-timeout", type=float, default=None,
                    help="serve's --worker-hang-timeout (the least time a step may take before its worker counts as hung)")
    ap.add_argument("--simulate", default=None, metavar="A,B,C",
                    help="serve the simulated device with this step cost (ms + ms/row + ms/token); streams are checked")
    args = ap.parse_args()
    if args.kill_after >= args.max_tokens:
        ap.error("--kill-after must be below --max-tokens")

    long_len = args.long_prompt + args.max_tokens + 16  # the long prompt's request, with room to spare
    with tempfile.TemporaryDirectory(prefix="metrale-bench-faults-") as tmp:
        env = thread_env(args.threads)
        flags = ["--device", args.device] if args.device else []
        if args.worker_hang_timeout is not None:
            flags += ["--worker-hang-timeout", str(args.worker_hang_timeout)]
        if args.simulate is not None:
            from metrale.gpu_worker.sim_runner import expected_tokens, write_weightless_model

            model_dir = write_weightless_model(Path(tmp) / "sim")
            env = {**env, "METRALE_SIMULATE_DEVICE": args.simulate}
            flags += ["--max-num-seqs", str(args.streams),
                      "--max-model-len", str(max(2048, long_len) if args.fault == "stop-prefill" else 2048)]
        else:
            model_dir = args.model or build_model(tmp, args.preset)
        if args.fault == "stop-prefill":  # the long prompt is one step
            flags += ["--max-num-batched-tokens", str(max(2048, args.long_prompt))]
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        vocab_end = plain_vocab_end(model_dir)
        params = greedy_params(args.max_tokens)
        meter = LoadMeter()
        with ServeProcess(model_dir, *flags, env=env) as server:
            if args.fault == "stop-prefill":
                try:
                    emit_prefill_hangs(server, args, vocab, vocab_end, meter)
                except BaseException:
                    note("the server's log ends:\n" + server.log_text()[-6000:])  # it goes with the server
                    raise
                return
            rounds = []
            for k in range(args.kills):
                prompts = random_prompts(args.streams, args.prompt_len, seed=1000 + k, vocab_end=vocab_end)
                t_kill, arrivals, results = asyncio.run(
                    one_round(server.port, prompts, params, args.kill_after, fault_action(server, args.fault))
                )
                meter.sample()
                bad = [r for r in results if isinstance(r, BaseException) or (len(r[0]), r[1]) != (args.max_tokens, "length")]
                if bad:
                    raise SystemExit(f"fault {k}: {len(bad)} streams did not complete: {bad[:3]}; the server's log "
                                     f"ends:\n{server.log_text()[-4000:]}")
                if args.simulate is not None:
                    changed = [i for i, (tokens, _) in enumerate(results)
                               if tokens != expected_tokens(prompts[i], args.max_tokens, vocab)]
                    if changed:
                        raise SystemExit(f"fault {k}: {len(changed)} streams differ from their fault-free tokens "
                                         f"(first: stream {changed[0]})")
                figures = {"stall": stall(arrivals, t_kill)}
                if args.fault not in ("engine", "frontend"):
                    log = server.log_text()
                    if len(READY.findall(log)) <= k:
                        raise SystemExit(f"fault {k}: the engine core logged no new worker: the fault landed after the "
                                         f"device had done the round's work (the clients lag the engine; give more "
                                         f"--max-tokens); its log ends:\n{log[-2000:]}")
                    t_ready = float(READY.findall(log)[k])
                    t_engine_first = float(FIRST.findall(log)[k])
                    t_first = min(t for a in arrivals for t in a if t > t_ready)
                    figures.update({
                        "kill_to_first_token": t_first - t_kill,
                        "ready_to_first_token": t_first - t_ready,
                        "kill_to_ready": t_ready - t_kill,
                        "engine_recompute": t_engine_first - t_ready,
                    })
                    # The engine core's own figure: the fault's start (the death noticed, or the hung step's start)
                    # to the first token of a resumed request, i.e. how long the device stood idle.
                    figures["engine_fault_to_resumed"] = float(RESUMED.findall(log)[k])
                    if args.fault == "stop":  # the hang watch's share: the stuck step's start to its kill
                        figures["hang_detect"] = float(HUNG.findall(log)[k])
                        figures["detect_to_resumed"] = figures["engine_fault_to_resumed"] - figures["hang_detect"]
                rounds.append(figures)
                note(f"{args.fault} {k + 1}/{args.kills}: no token for {figures['stall']:.3f} s after the fault"
                     + (f"; first resumed token {figures['kill_to_first_token']:.3f} s after it, "
                        f"{figures['ready_to_first_token'] * 1000:.1f} ms after the new worker was ready"
                        if "kill_to_first_token" in figures else ""))
        figures = {name: summary([r[name] for r in rounds]) for name in rounds[0]}
        emit({
            "bench": "faults",
            "commit": git_commit(),
            "model": f"simulated:{args.simulate}" if args.simulate is not None else str(args.model or f"tiny:{args.preset}"),
            "fault": args.fault,
            "kills": args.kills,
            "streams": args.streams,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "stall_s_median": figures["stall"]["median"],
            "kill_to_first_token_s_median": figures.get("kill_to_first_token", {}).get("median"),
            "ready_to_first_token_s_median": figures.get("ready_to_first_token", {}).get("median"),
            "seconds": figures,
            "all_streams_complete": True,
            "streams_equal_fault_free": args.simulate is not None or None,
            "load": meter.report(),
        })


if __name__ == "__main__":
    main()
