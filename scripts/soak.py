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

`--simulate A,B,C` soaks the simulated device instead (scripts/_soak_sim.py): `--concurrency` (1,024) closed-loop ZMQ
streams, each checked against the tokens the simulated device gives its prompt (no replay), the frontend's SIGKILL
and SIGSTOP among the faults (the clients re-attach; a stopped frontend is never continued: the supervisor's hang
watch replaces it after --frontend-hang-timeout-s), then a shorter fault-free phase for TTFT:

    python scripts/soak.py --simulate 3,0.003,0.002 [--concurrency 1024] [--duration-s 3600] [--faults 40]
                           [--min-gap-s 45] [--dp 2] [--tp 1] [--baseline-s 300] [--frontend-hang-timeout-s 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import LoadMeter, ServeProcess, build_model, emit, git_commit, note  # noqa: E402
from _soak_plot import draw as _plot  # noqa: E402
from _soak_faults import Fault, draw_faults, fault_loop, open_fds, sample_series, shm_entries  # noqa: E402
from _soak_traffic import Outcome, Spec, draw_requests, reset_live, run_request  # noqa: E402

MODEL_NAME = "soak"


def start_server(model: Path, args: argparse.Namespace) -> tuple[ServeProcess, str]:
    server = ServeProcess(model, "--http-port", "0", "-dp", str(args.dp), "-tp", str(args.tp), "--served-model-name",
                          MODEL_NAME, "--worker-hang-timeout", str(args.hang_timeout_s), "--frontend-hang-timeout",
                          str(args.frontend_hang_timeout_s), "--max-model-len", "1024",
                          "--dtype", args.dtype)
    return server, server.http_base()


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

        async def reset(_) -> str:
            return f"{reset_live(live, rng, 3)} live HTTP streams"

        sampler = asyncio.create_task(sample_series(session, base, sup_pid, start, series, done))
        faulting = asyncio.create_task(fault_loop(session, base, sup_pid, faults, start, args.deadline_s,
                                                  args.seed + 17, reset, note=note))
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
    """Streamed chunks/s, TTFT p50/p99 and RSS over time, faults marked; None without matplotlib."""
    start, outs, bin_s = chaos["start"], chaos["outcomes"].values(), 10.0
    n = int(max(s.at for s in specs) // bin_s) + 2 if specs else 1
    chunks, ttfts = [0.0] * n, [[] for _ in range(n)]
    for o in outs:
        for t in o.chunk_times:
            chunks[min(n - 1, int((t - start) // bin_s))] += 1 / bin_s
        if o.ttft_s is not None:
            ttfts[min(n - 1, int((o.sent_at - start) // bin_s))].append(o.ttft_s * 1000)
    return _plot(path, bin_s, chunks, "streamed chunks/s", ttfts, chaos["series"], faults, start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=3600.0)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    ap.add_argument("--faults", type=int, default=30)
    ap.add_argument("--min-gap-s", type=float, default=8.0, help="least time between two faults")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel size (2; 1 simulated: its ranks share no "
                                                          "collective, so a rank > 0 is not held to rank 0's pace)")
    ap.add_argument("--max-tokens", type=int, default=None, help="most new tokens a request asks (96; 256 simulated)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=180.0, help="a request without a final answer by then is lost")
    ap.add_argument("--hang-timeout-s", type=float, default=10.0, help="the server's --worker-hang-timeout")
    ap.add_argument("--frontend-hang-timeout-s", type=float, default=10.0,
                    help="the server's --frontend-hang-timeout: how soon a stopped frontend is replaced")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--preset", default="bench-tiny")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="out/soak")
    ap.add_argument("--no-replay", action="store_true")
    sim = ap.add_argument_group("the simulated device (scripts/_soak_sim.py)")
    sim.add_argument("--simulate", default=None, metavar="A,B,C",
                     help="serve the simulated device (step: A ms + B ms/row + C ms/token) under --concurrency "
                          "closed-loop ZMQ streams, frontend faults included")
    sim.add_argument("--concurrency", type=int, default=1024, help="live streams at every moment")
    sim.add_argument("--clients", type=int, default=64, help="AsyncClients the streams share")
    sim.add_argument("--prompt-len", default="16,512", help="MIN,MAX prompt ids (uniform)")
    sim.add_argument("--reset-clients", type=int, default=2, help="clients a client_reset closes")
    sim.add_argument("--baseline-s", type=float, default=None,
                     help="the fault-free phase's length (default: a quarter of the run, 60 to 300 s; 0: none)")
    sim.add_argument("--warmup-s", type=float, default=None,
                     help="left out of TTFT and the resource baseline (default: a tenth of the run, at least 20 s)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.simulate is not None:
        args.tp = args.tp or 1
        return main_simulated(args, out)
    args.max_tokens = args.max_tokens or 96
    args.tp = args.tp or 2
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
    if record["png"] is None:
        note("no matplotlib (pip install -e '.[soak]'): no plot")
    (out / "soak.json").write_text(json.dumps(record) + "\n")
    emit(record)
    ok = record["lost"] == 0 and not record["left_after_shutdown"] and not record["shm_after_shutdown"]
    return 0 if ok else 1


def main_simulated(args: argparse.Namespace, out: Path) -> int:
    """--simulate: the soak on the simulated device (scripts/_soak_sim.py); one JSON line, soak.json, requests.jsonl,
    series.json and the plot in out."""
    from _soak_sim import figures as sim_figures, plot_inputs, run_sim_phase, write_outcomes

    from metrale.gpu_worker.sim_runner import write_weightless_model

    args.max_tokens = args.max_tokens or 256
    args.warmup_s = args.warmup_s if args.warmup_s is not None else max(20.0, 0.1 * args.duration_s)
    if args.baseline_s is None:
        args.baseline_s = min(300.0, max(60.0, args.duration_s / 4))
    faults = draw_faults(args.seed, args.duration_s, args.faults, args.tp, args.dp, args.min_gap_s, frontend=True,
                         every_kind=True)
    with tempfile.TemporaryDirectory(prefix="metrale-soak-") as tmp:
        model = write_weightless_model(Path(tmp) / "sim")
        note(f"soak on the simulated device {args.simulate}: {args.concurrency} streams, {len(faults)} faults over "
             f"{args.duration_s:.0f} s (dp={args.dp} tp={args.tp}), then {args.baseline_s:.0f} s without faults")
        meter = LoadMeter()
        chaos = run_sim_phase(model, args, faults, args.duration_s)
        meter.sample()
        baseline = run_sim_phase(model, args, [], args.baseline_s) if args.baseline_s > 0 else None
        record = {"bench": "soak", "mode": "simulated", "commit": git_commit(), "cores": os.cpu_count(),
                  "simulate": args.simulate, "shape": {"dp": args.dp, "tp": args.tp}, "concurrency": args.concurrency,
                  "clients": args.clients, "duration_s": args.duration_s, "baseline_s": args.baseline_s,
                  "warmup_s": args.warmup_s, "seed": args.seed, "max_tokens": args.max_tokens,
                  "prompt_len": args.prompt_len, "hang_timeout_s": args.hang_timeout_s,
                  "frontend_hang_timeout_s": args.frontend_hang_timeout_s,
                  **sim_figures(chaos, baseline, faults, args), "load": meter.report()}
        write_outcomes(out / "requests.jsonl", chaos)
        (out / "series.json").write_text(json.dumps(chaos["series"]))
        (out / "server.log").write_text(chaos["log"])  # the chaos run's server log, whole
    rate, ttfts = plot_inputs(chaos, 10.0)
    record["png"] = _plot(out / "soak.png", 10.0, rate, "output tokens/s", ttfts, chaos["series"], faults,
                          chaos["start"])
    (out / "soak.json").write_text(json.dumps(record) + "\n")
    emit(record)
    stops = sum(f.kind == "frontend_stop" and f.pids != () for f in faults)  # each replaced by the hang watch, no more
    ok = (record["lost"] == 0 and not record["failed"] and record["equal_to_expected"] == record["read_to_end"]
          and record["frontend_hang_kills"] == stops
          and record["aborted_prefix_equal"] == record["aborted_by_clients"] and not record["left_after_shutdown"]
          and not record["shm_after_shutdown"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
