"""The soak on the simulated device (scripts/soak.py --simulate A,B,C): `metrale serve` with
METRALE_SIMULATE_DEVICE under `concurrency` closed-loop ZMQ streams (scripts/_soak_streams.py), faults of every
kind the shape has, the frontend's included (scripts/_soak_faults.py), then a shorter fault-free phase on a fresh
server with the same streams: the TTFT a quiet server gives at this concurrency. No replay is needed for the
answers: every stream is checked against the tokens the simulated device gives its prompt.

Figures: every request's outcome (lost = no final answer by the deadline), the streams equal to their expected
tokens (all samplings; greedy and seeded apart), each fault's recovery (/health healthy without the processes it
hit) and resumption (the last stream live at the fault has its next token), TTFT p50/p99 outside fault windows and
after the warm-up against the fault-free phase's, RSS by role and open fds by role once a second (warm-up against
the end), /dev/shm entries and processes left after shutdown. Not a benchmark of its own: soak.py drives it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from pathlib import Path

import aiohttp

from _bench_common import ServeProcess, note, plain_vocab_end
from _soak_faults import Fault, fault_loop, open_fds, owned_by, resume, sample_series, shm_entries
from _soak_streams import StreamOutcome, Streams, check_expected

FD_ROLES = ("supervisor", "frontend", "engine")  # the engine cores too: they hold every client's outputs


def model_facts(model_dir: Path) -> tuple[int, tuple[int, ...], int]:
    """(vocab size, EOS ids, one past the largest plain id) of the weightless folder."""
    from metrale.model_facts import resolve_model

    facts = resolve_model(str(model_dir), None)
    return facts.vocab_size, tuple(facts.eos_token_ids), plain_vocab_end(model_dir)


def serve_flags(args: argparse.Namespace) -> list[str]:
    per_replica = -(-args.concurrency // args.dp)
    return ["--http-port", "0", "-dp", str(args.dp), "-tp", str(args.tp), "--max-num-seqs", str(per_replica),
            "--max-model-len", "2048", "--worker-hang-timeout", str(args.hang_timeout_s),
            "--frontend-hang-timeout", str(args.frontend_hang_timeout_s)]


def run_sim_phase(model_dir: Path, args: argparse.Namespace, faults: list[Fault], duration_s: float) -> dict:
    """Start a server on the simulated device, run the streams (and the faults) for duration_s, stop it; the phase
    with what it held and left."""
    vocab, eos, vocab_end = model_facts(model_dir)
    check_expected(vocab, eos)
    shm_before = shm_entries()
    server = ServeProcess(model_dir, *serve_flags(args), env={"METRALE_SIMULATE_DEVICE": args.simulate})
    try:
        res = {"shm_at_start": sorted(shm_entries() - shm_before), "fds_at_start": open_fds(server.proc.pid, FD_ROLES)}
        streams = Streams(server.port, concurrency=args.concurrency, clients=args.clients, seed=args.seed, vocab=vocab,
                          eos=eos, vocab_end=vocab_end, deadline_s=args.deadline_s, max_tokens=args.max_tokens,
                          prompt_len=tuple(int(x) for x in args.prompt_len.split(",")))
        phase = _run(_phase(server, streams, faults, duration_s, args))
        res.update(fds_at_end=open_fds(server.proc.pid, FD_ROLES), shm_at_end=sorted(shm_entries() - shm_before))
    finally:
        log = server.log_text()  # before stop(), which removes the log when nothing was left behind
        left = server.stop()
    seen = phase["pids"] | server.pids
    new = shm_entries() - shm_before
    res.update(left_after_shutdown=left, shm_after_shutdown=owned_by(new, seen),
               shm_after_shutdown_not_ours=len(new) - len(owned_by(new, seen)))
    phase.update(resources=res, log=log)
    return phase


def _run(coro):
    """The phase on uvloop when it is there (as bench_sim's clients): a thousand streams' client is CPU-bound."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


async def _phase(server: ServeProcess, streams: Streams, faults: list[Fault], duration_s: float,
                 args: argparse.Namespace) -> dict:
    """The streams on this loop; the faults, /health and the resource samples on a thread with a loop of its own, so
    that a thousand streams' busy loop neither delays a fault nor times out a health probe. This loop's lag (how late
    a 0.1 s timer fires) is measured: every client-side time (TTFT, resumption) includes it."""
    loop = asyncio.get_running_loop()
    base, sup = server.http_base(), server.proc.pid
    series: list[dict] = []
    seen: set[int] = set()
    resumed: list[tuple[Fault, dict]] = []
    lags: list[float] = []
    streams_done = threading.Event()

    async def reset(rng) -> str:
        cut = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            streams.reset_clients(rng, args.reset_clients), loop))
        return f"{args.reset_clients} ZMQ clients closed with {cut} live requests"

    def on_inject(f: Fault) -> None:
        record: dict = {}
        resumed.append((f, record))
        loop.call_soon_threadsafe(streams.watch, record)

    async def control(start: float) -> None:
        done = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            sampler = asyncio.create_task(sample_series(session, base, sup, start, series, done, FD_ROLES, seen))
            try:
                await fault_loop(session, base, sup, faults, start, args.deadline_s, args.seed + 17, reset, on_inject,
                                 note=note)
                await asyncio.to_thread(streams_done.wait)
            finally:
                done.set()
                await sampler

    run = asyncio.create_task(streams.run(duration_s))
    while not streams.start:  # the clients connect first; the clock starts then
        if run.done():
            run.result()
        await asyncio.sleep(0.05)
    start = streams.start
    thread = threading.Thread(target=lambda: asyncio.run(control(start)), name="soak-control", daemon=True)
    thread.start()
    watchers = [asyncio.create_task(_progress(streams, duration_s)), asyncio.create_task(_lag(lags))]
    try:
        outcomes = await run
        wall = time.monotonic() - start  # the streams' time (the fault loop may still wait on a recovery)
    finally:
        streams_done.set()
        for w in watchers:
            w.cancel()
        await asyncio.to_thread(thread.join)
        for f in faults:  # never leave a frontend stopped (the watch failed), whatever ended the phase
            if f.kind == "frontend_stop":
                resume(f)
    for f, record in resumed:
        if "resumed_at" in record:
            f.resumed_s = record["resumed_at"] - f.injected_at
    lags.sort()
    return {"start": start, "outcomes": outcomes, "series": series, "tokens_by_second": streams.tokens_by_second,
            "wall_s": wall, "pids": seen,
            "client_loop_lag_ms": {"p50": _pct(lags, 50), "p99": _pct(lags, 99), "max": _pct(lags, 100)}}


async def _lag(lags: list[float]) -> None:
    """How late a 0.1 s sleep wakes, every 0.1 s (seconds, into lags)."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(0.1)
        lags.append(time.monotonic() - t - 0.1)


async def _progress(streams: Streams, duration_s: float) -> None:
    """A line a minute on stderr: how far, how many answered, lost, not equal."""
    while True:
        await asyncio.sleep(60)
        outs = streams.outcomes
        note(f"  {time.monotonic() - streams.start:.0f}/{duration_s:.0f} s: {len(outs)} answered, "
             f"{sum(o.status == 'lost' for o in outs)} lost, {sum(o.status == 'error' for o in outs)} errors, "
             f"{sum(o.equal is False for o in outs)} not equal, {len(streams.live)} live")


def figures(chaos: dict, baseline: dict | None, faults: list[Fault], args: argparse.Namespace) -> dict:
    """The run's figures (module docstring)."""
    outs: list[StreamOutcome] = chaos["outcomes"]
    by_status: dict[str, int] = {}
    errors: dict[str, int] = {}
    for o in outs:
        by_status[o.status] = by_status.get(o.status, 0) + 1
        if o.status == "error":
            errors[o.error.split(":")[0]] = errors.get(o.error.split(":")[0], 0) + 1
    read = [o for o in outs if o.status == "ok"]
    fixed = [o for o in read if o.sampling != "free"]
    cut = [o for o in outs if o.status == "aborted"]
    warm = args.warmup_s
    windows = [(f.injected_at - chaos["start"], f.injected_at - chaos["start"]
                + max(f.resumed_s or 0.0, f.healthy_s if f.healthy_s is not None else args.deadline_s))
               for f in faults if f.injected_at is not None]
    quiet = sorted(o.ttft_s for o in outs if o.ttft_s is not None and o.sent_at - chaos["start"] >= warm
                   and not any(a < o.first_at - chaos["start"] and o.sent_at - chaos["start"] < b for a, b in windows))
    base = sorted(o.ttft_s for o in baseline["outcomes"] if o.ttft_s is not None
                  and o.sent_at - baseline["start"] >= min(warm, args.baseline_s / 4)) if baseline else []
    rec = {
        "requests_answered": len(outs), "by_status": by_status, "lost": by_status.get("lost", 0),
        "failed": errors, "lost_examples": [f"{o.idx}: {o.error}" for o in outs if o.status == "lost"][:10],
        "read_to_end": len(read), "equal_to_expected": sum(bool(o.equal) for o in read),
        "greedy_or_seeded": len(fixed), "greedy_or_seeded_equal": sum(bool(o.equal) for o in fixed),
        "aborted_by_clients": len(cut), "aborted_prefix_equal": sum(bool(o.equal) for o in cut),
        "not_equal_examples": [f"{o.idx} (stream {o.stream}, {o.status}): {o.error}" for o in outs
                               if o.equal is False][:10],
        "output_tokens": sum(chaos["tokens_by_second"].values()),
        "tokens_per_s": round(sum(chaos["tokens_by_second"].values()) / chaos["wall_s"]),
        "faults_injected": sum(f.injected_at is not None and f.target != "no target was live" for f in faults),
        # recovered: /health healthy without the processes it hit and (a frontend_stop) the streams moving again
        "faults_recovered": sum(f.healthy_s is not None and (f.kind != "frontend_stop" or f.resumed_s is not None)
                                for f in faults),
        # the frontend hang watch's kills (its log line): one per frontend_stop, none of a frontend merely busy
        "frontend_hang_kills": chaos["log"].count("hung: its event loop has not beaten"),
        "fault_kinds": _count(f.kind for f in faults if f.injected_at is not None),
        "faults": [{"at_s": round(f.at, 1), "injected_s": _r(f.injected_at and f.injected_at - chaos["start"]),
                    "kind": f.kind, "target": f.target, "healthy_s": _r(f.healthy_s),
                    "resumed_s": _r(f.resumed_s)}
                   for f in faults],
        "resumed_s_by_kind": {k: _spread([f.resumed_s for f in faults if f.kind == k and f.resumed_s is not None])
                              for k in sorted({f.kind for f in faults})},
        "client_loop_lag_ms": chaos["client_loop_lag_ms"],
        "ttft_quiet_requests": len(quiet), "ttft_quiet_p50_ms": _pct(quiet, 50), "ttft_quiet_p99_ms": _pct(quiet, 99),
        "ttft_fault_free_p50_ms": _pct(base, 50), "ttft_fault_free_p99_ms": _pct(base, 99),
        "ttft_p99_ratio_to_fault_free": round(_pct(quiet, 99) / _pct(base, 99), 3) if quiet and base else None,
    }
    if baseline:
        b = baseline["outcomes"]
        rec["fault_free"] = {"answered": len(b), "lost": sum(o.status == "lost" for o in b),
                             "equal_to_expected": sum(bool(o.equal) for o in b if o.status == "ok"),
                             "read_to_end": sum(o.status == "ok" for o in b),
                             "tokens_per_s": round(sum(baseline["tokens_by_second"].values()) / baseline["wall_s"]),
                             "client_loop_lag_ms": baseline["client_loop_lag_ms"]}
    rec.update(_resources(chaos, warm))
    return rec


def _resources(chaos: dict, warm_s: float) -> dict:
    """RSS and open fds by role: at the end of the warm-up against the end, and their growth."""
    series = [p for p in chaos["series"] if p["rss"]]
    at_warm = next((p for p in series if p["t"] >= warm_s), series[0] if series else {"rss": {}, "fds": {}})
    # the end: the last sample before the streams stopped (the last requests then drain and the server idles)
    end = [p for p in series if p["t"] <= chaos["wall_s"]][-1] if series else at_warm
    res = chaos["resources"]
    out = {"rss_mib_warm": {k: round(v / 2**20, 1) for k, v in at_warm["rss"].items()},
           "rss_mib_end": {k: round(v / 2**20, 1) for k, v in end["rss"].items()},
           "fds_warm": at_warm.get("fds", {}), "fds_end": end.get("fds", {}),
           "fds_max": {r: max(p.get("fds", {}).get(r, 0) for p in series) for r in at_warm.get("fds", {})}}
    out["rss_growth_by_role"] = {k: round(end["rss"].get(k, 0) / v - 1, 4) for k, v in at_warm["rss"].items() if v}
    out["fds_growth_by_role"] = {k: round(end.get("fds", {}).get(k, 0) / v - 1, 4)
                                 for k, v in at_warm.get("fds", {}).items() if v}
    out["lives"] = _lives(series, warm_s, chaos["wall_s"])
    out.update({"fds_at_start": res["fds_at_start"], "fds_at_end": res["fds_at_end"],
                "shm_at_start": len(res["shm_at_start"]), "shm_at_end": len(res["shm_at_end"]),
                "shm_after_shutdown": res["shm_after_shutdown"],
                "shm_after_shutdown_not_ours": res["shm_after_shutdown_not_ours"],
                "left_after_shutdown": res["left_after_shutdown"]})
    return out


def _lives(series: list[dict], warm_s: float, end_s: float, min_s: float = 60.0) -> list[dict]:
    """Each process that lived at least min_s past the warm-up (its own first warm_s left out too): its RSS and open
    fds then and at its last sample before end_s, and their growth. A leak grows within one life; sums by role
    mix a restarted process's fresh start into them."""
    first: dict[int, tuple[float, tuple]] = {}
    last: dict[int, tuple[float, tuple]] = {}
    born: dict[int, float] = {}
    for p in series:
        for pid, entry in p.get("by_pid", {}).items():
            born.setdefault(pid, p["t"])
            if p["t"] >= warm_s and p["t"] - born[pid] >= min(warm_s, 20.0) and p["t"] <= end_s:
                first.setdefault(pid, (p["t"], entry))
                last[pid] = (p["t"], entry)
    out = []
    for pid, (t0, (role, rss0, fds0)) in first.items():
        t1, (_, rss1, fds1) = last[pid]
        if t1 - t0 >= min_s:
            out.append({"role": role, "pid": pid, "from_s": round(t0), "to_s": round(t1),
                        "rss_mib": [round(rss0 / 2**20, 1), round(rss1 / 2**20, 1)],
                        "rss_growth": round(rss1 / rss0 - 1, 4),
                        "fds": [fds0, fds1], "fds_growth": round(fds1 / fds0 - 1, 4) if fds0 else None})
    return sorted(out, key=lambda d: (d["role"], d["from_s"]))


def write_outcomes(path: Path, chaos: dict) -> None:
    """Every request's outcome, one JSON line each (times in seconds after the start)."""
    start = chaos["start"]
    with open(path, "w") as f:
        for o in chaos["outcomes"]:
            f.write(json.dumps({"idx": o.idx, "stream": o.stream, "sampling": o.sampling, "status": o.status,
                                "equal": o.equal, "error": o.error, "finish": o.finish, "tokens": o.tokens,
                                "sent": round(o.sent_at - start, 3), "ttft": _r(o.ttft_s),
                                "done": None if o.done_at is None else round(o.done_at - start, 3)}) + "\n")


def plot_inputs(chaos: dict, bin_s: float) -> tuple[list[float], list[list[float]]]:
    """(tokens/s per bin, TTFTs in ms of the requests sent in each bin) for _soak_plot."""
    n = int(chaos["wall_s"] // bin_s) + 2
    tokens, ttfts = [0.0] * n, [[] for _ in range(n)]
    for second, count in chaos["tokens_by_second"].items():
        tokens[min(n - 1, int(second // bin_s))] += count / bin_s
    for o in chaos["outcomes"]:
        if o.ttft_s is not None:
            ttfts[min(n - 1, int((o.sent_at - chaos["start"]) // bin_s))].append(o.ttft_s * 1000)
    return tokens, ttfts


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in items:
        out[k] = out.get(k, 0) + 1
    return out


def _spread(xs: list[float]) -> dict | None:
    return {"median": round(statistics.median(xs), 2), "max": round(max(xs), 2), "n": len(xs)} if xs else None


def _pct(xs: list[float], q: float) -> float | None:
    return round(1000 * xs[min(len(xs) - 1, int(q / 100 * len(xs)))], 1) if xs else None


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
