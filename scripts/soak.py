"""Chaos soak: `metrale serve` under a seeded open-loop mix of real HTTP traffic while faults are injected, every
request's outcome checked against a fault-free replay, and the server's resources watched for leaks.

Two runs of one seeded schedule (scripts/_soak_traffic.py): the chaos run, with a seeded fault schedule
(scripts/_soak_faults.py: worker SIGKILL and SIGSTOP, a tensor-parallel rank killed, an engine core killed, a
replica's whole group killed, live HTTP connections reset), then the replay on a fresh server with no faults.
A greedy or seeded request that its client read to the end must answer the same in both; a request that
ends with a typed error is counted as failed; one with no final answer by its deadline (or a connection the
server dropped without one) is lost. Resources: RSS by role once warmed up and at the end, open fds of the
long-lived processes, metrale's /dev/shm entries before the start, at the end and after shutdown, processes
left after shutdown.

Prints one JSON line (progress on stderr) and writes it, with a PNG of throughput, TTFT and RSS over time
(faults marked; matplotlib, the `soak` extra), to --out:

    python scripts/soak.py [--duration-s 3600] [--rate 2] [--faults 30] [--dp 2] [--tp 2] [--seed 0]
                           [--preset bench-tiny | --model DIR] [--out out/soak]

`--duration-s 300` is the CI-sized setting (tests/test_soak.py, marked slow).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import ServeProcess, build_model, emit, git_commit, note  # noqa: E402
from _soak_faults import Fault, draw_faults, inject, open_fds, rss_by_role, shm_entries  # noqa: E402
from _soak_traffic import Outcome, Spec, draw_requests, reset_live, run_request  # noqa: E402

MODEL_NAME = "soak"


def start_server(model: Path, args: argparse.Namespace) -> tuple[ServeProcess, str]:
    server = ServeProcess(model, "--http-port", "0", "-dp", str(args.dp), "-tp", str(args.tp), "--served-model-name",
                          MODEL_NAME, "--worker-hang-timeout", str(args.hang_timeout_s), "--max-model-len", "1024",
                          "--dtype", args.dtype)
    return server, server.http_base()


async def healthy(session: aiohttp.ClientSession, base: str, gone: tuple[int, ...] = ()) -> bool:
    """/health is 200 with every replica ready, and none of the processes `gone` is among its processes."""
    try:
        async with session.get(f"{base}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            body = await resp.json()
            return (resp.status == 200 and all(body.get("replicas_ready") or [True])
                    and not {p["pid"] for p in body.get("processes", [])} & set(gone))
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return False


async def run_phase(base: str, sup_pid: int, specs: list[Spec], faults: list[Fault], args: argparse.Namespace) -> dict:
    """Run the schedule (and the faults) against one server; outcomes by index and the time series."""
    rng = random.Random(args.seed + 17)
    live: dict[int, tuple] = {}
    series: list[dict] = []
    done = asyncio.Event()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.monotonic()

        async def one(spec: Spec) -> Outcome:
            await asyncio.sleep(max(0.0, start + spec.at - time.monotonic()))
            return await run_request(session, base, spec, args.deadline_s, live)

        async def sample() -> None:
            while not done.is_set():
                t = time.monotonic()
                series.append({"t": t - start, "rss": rss_by_role(sup_pid), "healthy": await healthy(session, base)})
                await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t)))  # a sampling period, not a wait on work

        async def fault_loop() -> None:
            for f in faults:
                await asyncio.sleep(max(0.0, start + f.at - time.monotonic()))
                f.injected_at = time.monotonic()
                if f.kind == "client_reset":
                    f.target = f"{reset_live(live, rng, 3)} live HTTP streams"
                elif not inject(f, sup_pid, rng):
                    f.target = "no target was live"
                note(f"fault at {f.injected_at - start:.0f} s: {f.kind} -> {f.target}")
                while time.monotonic() - f.injected_at < args.deadline_s:
                    if await healthy(session, base, f.pids):
                        f.healthy_s = time.monotonic() - f.injected_at
                        break
                    await asyncio.sleep(0.2)  # a poll of /health: the server has no event to wait on

        sampler = asyncio.create_task(sample())
        faulting = asyncio.create_task(fault_loop())
        outcomes = await asyncio.gather(*(one(s) for s in specs))
        await faulting
        done.set()
        await sampler
    return {"start": start, "outcomes": {o.idx: o for o in outcomes}, "series": series}


def run_server_phase(model: Path, specs: list[Spec], faults: list[Fault], args: argparse.Namespace) -> dict:
    """Start a server, run a phase, watch its resources, stop it; the phase and what it left."""
    shm_before = shm_entries()
    server, base = start_server(model, args)
    try:
        res = {"shm_at_start": sorted(shm_entries() - shm_before), "fds_at_start": open_fds(server.proc.pid)}
        phase = asyncio.run(run_phase(base, server.proc.pid, specs, faults, args))
        res.update(fds_at_end=open_fds(server.proc.pid), shm_at_end=sorted(shm_entries() - shm_before))
    finally:
        left = server.stop()
    res.update(left_after_shutdown=left, shm_after_shutdown=sorted(shm_entries() - shm_before))
    phase["resources"] = res
    return phase


def figures(specs: list[Spec], chaos: dict, replay: dict | None, faults: list[Fault], args) -> dict:
    outs: dict[int, Outcome] = chaos["outcomes"]
    by_status: dict[str, int] = {}
    for o in outs.values():
        by_status[o.status] = by_status.get(o.status, 0) + 1
    errors: dict[str, int] = {}
    for o in outs.values():
        if o.status == "error":
            key = o.error.split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    compared = equal = 0
    mismatched = []
    if replay is not None:
        for s in specs:
            a, b = outs[s.idx], replay["outcomes"][s.idx]
            if s.comparable and a.status != "aborted" and b.status == "ok":
                compared += 1
                if a.status == "ok" and (a.texts, a.finish) == (b.texts, b.finish):
                    equal += 1
                else:
                    mismatched.append({"idx": s.idx, "body": s.body, "stream": s.stream, "status": a.status,
                                       "error": a.error, "got": [a.texts, a.finish], "replay": [b.texts, b.finish]})
    for f in faults:  # resumed: every request live at the fault and answered has moved on (a token, or its answer)
        if f.injected_at is None:
            continue
        after = [min((t for t in o.chunk_times if t > f.injected_at), default=o.done_at) for o in outs.values()
                 if o.status == "ok" and o.sent_at < f.injected_at < o.done_at]
        f.resumed_s = max(after) - f.injected_at if after else None
    windows = [(f.injected_at, f.injected_at + max(f.resumed_s or 0.0, args.deadline_s if f.healthy_s is None else f.healthy_s))
               for f in faults if f.injected_at is not None]
    quiet = [o for o in outs.values() if o.ttft_s is not None
             and not any(a < o.first_at and o.sent_at < b for a, b in windows)]
    ttft = sorted(o.ttft_s for o in quiet)
    base = sorted(replay["outcomes"][o.idx].ttft_s for o in quiet if replay["outcomes"][o.idx].ttft_s is not None) if replay else []
    res = chaos["resources"]
    rss = [s["rss"] for s in chaos["series"] if s["rss"]]
    warm = rss[min(len(rss) - 1, max(0, int(0.1 * len(rss))))] if rss else {}
    end = rss[-1] if rss else {}
    return {
        "requests_sent": len(specs), "by_status": by_status, "lost": by_status.get("lost", 0),
        "failed_typed": errors, "greedy_or_seeded_compared": compared, "equal_to_replay": equal,
        "mismatched": [m["idx"] for m in mismatched][:20], "mismatch_details": mismatched,
        "lost_examples": [f"{o.idx}: {o.error}" for o in outs.values() if o.status == "lost"][:10],
        "faults_injected": sum(f.injected_at is not None and f.target != "no target was live" for f in faults),
        "faults_recovered": sum(f.healthy_s is not None for f in faults),
        "faults": [{"at_s": round(f.at, 1), "kind": f.kind, "target": f.target, "healthy_s": _r(f.healthy_s),
                    "resumed_s": _r(f.resumed_s)} for f in faults],
        "ttft_quiet_p50_ms": _pct(ttft, 50), "ttft_quiet_p99_ms": _pct(ttft, 99),
        "ttft_replay_p99_ms": _pct(base, 99),
        "ttft_p99_ratio_to_replay": round(_pct(ttft, 99) / _pct(base, 99), 3) if ttft and base else None,
        "rss_mib_warm": {k: round(v / 2**20) for k, v in warm.items()},
        "rss_mib_end": {k: round(v / 2**20) for k, v in end.items()},
        "rss_growth": round(sum(end.values()) / sum(warm.values()) - 1, 4) if warm and end else None,
        # The processes that live through every fault: a leak shows here (restarted ones start afresh).
        "rss_growth_long_lived": _growth(warm, end, ("supervisor", "frontend")),
        "fds_at_start": res["fds_at_start"], "fds_at_end": res["fds_at_end"],
        "shm_at_start": len(res["shm_at_start"]), "shm_at_end": len(res["shm_at_end"]),
        "shm_after_shutdown": res["shm_after_shutdown"], "left_after_shutdown": res["left_after_shutdown"],
    }


def _growth(warm: dict, end: dict, roles: tuple[str, ...]) -> float | None:
    a, b = sum(warm.get(r, 0) for r in roles), sum(end.get(r, 0) for r in roles)
    return round(b / a - 1, 4) if a else None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return round(1000 * xs[min(len(xs) - 1, int(q / 100 * len(xs)))], 1)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def plot(path: Path, chaos: dict, faults: list[Fault], specs: list[Spec]) -> str | None:
    """Throughput, TTFT p50/p99 and RSS over time, faults marked; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note("no matplotlib (pip install -e '.[soak]'): no plot")
        return None
    start, outs, bin_s = chaos["start"], chaos["outcomes"].values(), 10.0
    n = int(max(s.at for s in specs) // bin_s) + 2 if specs else 1
    chunks, ttfts = [0] * n, [[] for _ in range(n)]
    for o in outs:
        for t in o.chunk_times:
            chunks[min(n - 1, int((t - start) // bin_s))] += 1
        if o.ttft_s is not None:
            ttfts[min(n - 1, int((o.sent_at - start) // bin_s))].append(o.ttft_s * 1000)
    xs = [i * bin_s for i in range(n)]
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    axes[0].plot(xs, [c / bin_s for c in chunks])
    axes[0].set_ylabel("streamed chunks/s")
    for q, style in ((50, "-"), (99, "--")):
        axes[1].plot(xs, [statistics.quantiles(v, n=100)[q - 1] if len(v) > 1 else (v[0] if v else None) for v in ttfts],
                     style, label=f"TTFT p{q}")
    axes[1].set_ylabel("ms")
    axes[1].set_yscale("log")
    axes[1].legend()
    roles = sorted({r for s in chaos["series"] for r in s["rss"]})
    for role in roles:
        axes[2].plot([s["t"] for s in chaos["series"]], [s["rss"].get(role, 0) / 2**20 for s in chaos["series"]], label=role)
    axes[2].set_ylabel("RSS MiB")
    axes[2].set_xlabel("seconds")
    axes[2].legend()
    for f in faults:
        if f.injected_at is not None:
            for ax in axes:
                ax.axvline(f.injected_at - start, color="red", alpha=0.3)
            axes[0].annotate(f.kind, (f.injected_at - start, 0), rotation=90, fontsize=6, color="red")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=3600.0)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    ap.add_argument("--faults", type=int, default=30)
    ap.add_argument("--min-gap-s", type=float, default=8.0, help="least time between two faults")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=180.0, help="a request without a final answer by then is lost")
    ap.add_argument("--hang-timeout-s", type=float, default=10.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--preset", default="bench-tiny")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="out/soak")
    ap.add_argument("--no-replay", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="metrale-soak-") as tmp:
        model = Path(args.model) if args.model else build_model(tmp, args.preset)
        specs = draw_requests(args.seed, args.duration_s, args.rate, MODEL_NAME, args.max_tokens)
        faults = draw_faults(args.seed, args.duration_s, args.faults, args.tp, args.dp, args.min_gap_s)
        note(f"soak: {len(specs)} requests, {len(faults)} faults over {args.duration_s:.0f} s (dp={args.dp} tp={args.tp})")
        chaos = run_server_phase(model, specs, faults, args)
        replay = None if args.no_replay else run_server_phase(model, specs, [], args)
        record = {"bench": "soak", "commit": git_commit(), "cores": os.cpu_count(),
                  "model": args.model or args.preset, "dtype": args.dtype, "shape": {"dp": args.dp, "tp": args.tp},
                  "duration_s": args.duration_s, "rate": args.rate, "seed": args.seed,
                  **figures(specs, chaos, replay, faults, args)}
        with open(out / "requests.jsonl", "w") as f:  # every request's outcome, for a look after the run
            for s in specs:
                o, start = chaos["outcomes"][s.idx], chaos["start"]
                f.write(json.dumps({"idx": s.idx, "at": round(s.at, 2), "route": s.route, "stream": s.stream,
                                    "sampling": s.sampling, "behaviour": s.behaviour, "status": o.status,
                                    "error": o.error, "sent": round(o.sent_at - start, 3),
                                    "first": None if o.first_at is None else round(o.first_at - start, 3),
                                    "done": None if o.done_at is None else round(o.done_at - start, 3),
                                    "chunks": len(o.chunk_times)}) + "\n")
        (out / "mismatches.json").write_text(json.dumps(record.pop("mismatch_details"), indent=1))
        (out / "series.json").write_text(json.dumps(chaos["series"]))  # RSS and health once a second
    record["png"] = plot(out / "soak.png", chaos, faults, specs)
    (out / "soak.json").write_text(json.dumps(record) + "\n")
    emit(record)
    ok = record["lost"] == 0 and not record["left_after_shutdown"] and not record["shm_after_shutdown"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
