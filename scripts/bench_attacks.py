"""What misbehaving HTTP clients cost everyone else: a steady set of well-behaved clients against `metrale serve`,
alone and while one attack runs beside them, alternated.

Attacks: `slowloris` (connections that trickle their headers a byte at a time), `slow_body` (requests that trickle
their bodies), `idle` (10,000 open connections that send nothing), `deaf_streams` (50 streams whose clients never read), `oversized` (bodies over the frame limit, back to back: each a 413), `grammar_bomb` (a schema that takes too
long to compile, back to back: each a 400 after --grammar-timeout). The victims are `clients` loops of greedy
completions; throughput is their completion tokens per second over `window-s`. Every attack's run is paired
with the baseline run before it (baseline, attack, baseline, attack, ...), and the ratio is the median over pairs.
The target is >= 0.9 for each. Also checked: each attack is refused or contained as it should be (its outcomes
are counted), and no victim request fails.

Prints one JSON line (progress on stderr):

    python scripts/bench_attacks.py [--model DIR | --preset bench-tiny] [--clients 8] [--window-s 10] [--reps 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import ServeProcess, build_model, emit, git_commit, note  # noqa: E402

BOMB = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{3,30}[0-9]{2,9}"} for i in range(800)},
        "required": [f"p{i}" for i in range(800)]}  # tests/test_grammar_compiler.py's SLOW


async def victims(base: str, clients: int, window_s: float, stop: asyncio.Event) -> dict:
    """`clients` loops of greedy completions for window_s; their tokens per second and failures."""
    tokens, failures = [0], [0]
    end = time.monotonic() + window_s
    body = {"prompt": "The river ran past the old stone market and", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def loop() -> None:
            while time.monotonic() < end:
                try:
                    async with session.post(f"{base}/v1/completions", json=body) as resp:
                        reply = await resp.json()
                        if resp.status == 200:
                            tokens[0] += reply["usage"]["completion_tokens"]
                        else:
                            failures[0] += 1
                except aiohttp.ClientError:
                    failures[0] += 1

        await asyncio.gather(*(loop() for _ in range(clients)))
    stop.set()
    return {"tok_s": tokens[0] / window_s, "failures": failures[0]}


async def attack(kind: str, host: str, port: int, stop: asyncio.Event) -> dict:
    """Run one attack until stop is set; what came of its requests."""
    outcome: dict[str, int] = {}

    def count(what: str) -> None:
        outcome[what] = outcome.get(what, 0) + 1

    writers: list[asyncio.StreamWriter] = []
    try:
        if kind in ("slowloris", "slow_body", "idle"):
            n = {"slowloris": 1000, "slow_body": 200, "idle": 10_000}[kind]
            for i in range(n):
                _, w = await asyncio.open_connection(host, port)
                if kind == "slowloris":
                    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                elif kind == "slow_body":
                    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 1000\r\n\r\n{")
                writers.append(w)
                if i % 500 == 499:
                    await asyncio.sleep(0)  # let the victims' requests interleave with the connecting
            outcome["connections"] = len(writers)
            while not stop.is_set():
                if kind != "idle":
                    for w in writers:
                        if not w.is_closing():
                            w.write(b"a" if kind == "slow_body" else b"X")  # a byte per second each
                await asyncio.sleep(1.0)  # the trickle's pace, not a wait on work
            outcome["closed_by_server"] = sum(w.transport.is_closing() for w in writers)
        elif kind == "deaf_streams":
            # Few tokens each: what is measured is the frontend holding unread streams, not the engine's work for them.
            body = json.dumps({"prompt": "Once upon a time", "max_tokens": 16, "stream": True, "ignore_eos": True}).encode()
            for _ in range(50):
                _, w = await asyncio.open_connection(host, port)
                w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # never drained
                w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(body) + body)
                writers.append(w)
            outcome["streams"] = len(writers)
            await stop.wait()
        else:
            async with aiohttp.ClientSession() as session:
                url, big = f"http://{host}:{port}/v1/completions", b'{"prompt": "' + b"z" * (9 << 20) + b'"}'
                while not stop.is_set():
                    try:
                        if kind == "oversized":
                            async with session.post(url, data=big, headers={"Content-Type": "application/json"}) as resp:
                                count(str(resp.status))
                        else:  # grammar_bomb
                            body = {"prompt": "x", "max_tokens": 4, "response_format": {
                                "type": "json_schema", "json_schema": {"name": "bomb", "schema": BOMB}}}
                            async with session.post(url, json=body) as resp:
                                count(str(resp.status))
                            BOMB["properties"]["p0"]["pattern"] += "x"  # a new schema each time: no cached refusal
                    except aiohttp.ClientError:
                        count("connection cut")  # the server answered 413 and closed before the body was sent
    finally:
        for w in writers:
            w.close()
    return outcome


async def run_pair(base: str, host: str, port: int, kind: str | None, args) -> dict:
    stop = asyncio.Event()
    tasks = [victims(base, args.clients, args.window_s, stop)]
    if kind is not None:
        tasks.append(attack(kind, host, port, stop))
    results = await asyncio.gather(*tasks)
    return {"victims": results[0], "attack": results[1] if kind else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default="bench-tiny")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--attacks", default="slowloris,slow_body,idle,deaf_streams,oversized,grammar_bomb")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))
    kinds = args.attacks.split(",")
    with tempfile.TemporaryDirectory(prefix="metrale-attacks-") as tmp:
        model = Path(args.model) if args.model else build_model(tmp, args.preset)
        with ServeProcess(model, "--http-port", "0", "--grammar-timeout", "1") as server:
            base = server.http_base()
            host, port = "127.0.0.1", int(base.rsplit(":", 1)[1])
            asyncio.run(run_pair(base, host, port, None, argparse.Namespace(clients=args.clients, window_s=3.0)))  # warm-up
            per: dict[str, list] = {k: [] for k in kinds}
            failures = 0
            for rep in range(args.reps):
                for kind in kinds:
                    alone = asyncio.run(run_pair(base, host, port, None, args))
                    under = asyncio.run(run_pair(base, host, port, kind, args))
                    failures += alone["victims"]["failures"] + under["victims"]["failures"]
                    per[kind].append((alone["victims"]["tok_s"], under["victims"]["tok_s"], under["attack"]))
                    note(f"rep {rep} {kind}: {alone['victims']['tok_s']:.0f} tok/s alone, "
                         f"{under['victims']['tok_s']:.0f} under attack; attack: {under['attack']}")
    record = {"bench": "attacks", "commit": git_commit(), "cores": os.cpu_count(), "model": args.model or args.preset,
              "clients": args.clients, "window_s": args.window_s, "reps": args.reps, "victim_failures": failures,
              "attacks": {k: {"ratio": round(statistics.median(u / a for a, u, _ in v), 3),
                              "alone_tok_s": round(statistics.median(a for a, _, _ in v), 1),
                              "under_tok_s": round(statistics.median(u for _, u, _ in v), 1),
                              "outcome": v[-1][2]} for k, v in per.items()}}
    emit(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
