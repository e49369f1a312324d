"""What the benchmark scripts share: workloads, per-token timelines, `metrale serve` as a subprocess, the
worker's counters read from its ticket ring, and the machine's load while a benchmark ran.

Not a benchmark itself: bench_serve.py, bench_pipeline.py and bench_compare.py import it (the scripts
folder is on sys.path when a script runs). Nothing here imports torch; metrale and zmq are imported where
they are used, so that `python scripts/bench_compare.py --help` stays quick.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
FIRST_PLAIN_TOKEN = 16  # random prompt ids start here: below are the tiny tokenizer's special tokens


# ---- facts about the run ---------------------------------------------------------------------


def git_commit() -> str:
    """The short hash of the checkout measured (with "+dirty" when the tree has local changes)."""
    try:
        sha = subprocess.run(["git", "log", "-1", "--format=%h"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class LoadMeter:
    """How busy the machine was during a benchmark, and how much of that was not the benchmark.

    other_cpu_fraction: CPU seconds used by processes outside the benchmark's tree ÷ (wall × cores) — the
    share of the machine other workers took while we measured (0 = a quiet machine)."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self._cpu0 = _busy_cpu_s()
        self._load0 = os.getloadavg()[0]
        self._ours: dict[int, float] = {}
        self._ours0: dict[int, float] = {}
        self.sample()
        self._ours0 = dict(self._ours)

    def sample(self) -> None:
        """Note the CPU time of our process tree now (call while subprocesses are alive)."""
        me = psutil.Process()
        for p in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                self._ours[p.pid] = t.user + t.system

    def report(self) -> dict:
        """The machine's load over the meter's life."""
        self.sample()
        wall = time.monotonic() - self._t0
        cores = os.cpu_count() or 1
        busy = _busy_cpu_s() - self._cpu0
        ours = sum(t - self._ours0.get(pid, 0.0) for pid, t in self._ours.items())
        return {
            "cores": cores,
            "loadavg_1m_start": round(self._load0, 2),
            "loadavg_1m_end": round(os.getloadavg()[0], 2),
            "cpu_busy_fraction": round(busy / (wall * cores), 3),
            "other_cpu_fraction": round(max(0.0, busy - ours) / (wall * cores), 3),
            "wall_s": round(wall, 1),
        }


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)


def emit(record: dict) -> None:
    """Print the benchmark's one JSON line on stdout, with the CPU kernel class it ran (metrale/cpu_isa.py: the
    forced one or the CPU's best) and the CPU's best."""
    from metrale import cpu_isa

    record.setdefault("cpu_isa", {"ran": cpu_isa.chosen(), "best": cpu_isa.best()})
    print(json.dumps(record, separators=(",", ":")), flush=True)


def note(text: str) -> None:
    """Progress and tables go to stderr, so stdout carries only the JSON line."""
    print(text, file=sys.stderr, flush=True)


# ---- models and workloads --------------------------------------------------------------------


def build_model(out_dir: str | Path, preset: str = "bench-tiny") -> Path:
    """A random Llama folder of the preset (float32 weights: every engine casts at load)."""
    from metrale.gpu_worker.tiny_model import make_tiny_model

    return Path(make_tiny_model(out_dir, "llama", preset=preset, seed=0, dtype="float32"))


def plain_vocab_end(model_dir: str | Path) -> int:
    """One past the largest id the model's tokenizer knows: prompts stay inside what every engine accepts."""
    tok = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    ids = list(tok["model"]["vocab"].values()) + [a["id"] for a in tok.get("added_tokens", [])]
    return max(ids) + 1


def random_prompts(n: int, length: int, seed: int, vocab_end: int) -> list[list[int]]:
    """n prompts of `length` random token ids (no special tokens), the same for a given seed."""
    rng = np.random.default_rng(seed)
    return rng.integers(FIRST_PLAIN_TOKEN, vocab_end, size=(n, length)).tolist()


def mixed_workload(seed: int, vocab_end: int, n: int = 256) -> tuple[list[list[int]], list[int]]:
    """The scheduler issue's mixed workload: n requests, prompts of 32–1024 and outputs of 32–512 tokens."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(32, 1025, size=n)
    outs = rng.integers(32, 513, size=n)
    prompts = [rng.integers(FIRST_PLAIN_TOKEN, vocab_end, size=int(k)).tolist() for k in lens]
    return prompts, [int(o) for o in outs]


# ---- timelines and their figures -------------------------------------------------------------


@dataclass(slots=True)
class Timeline:
    """When each request was sent and when each of its tokens arrived (perf_counter seconds)."""

    start: float = 0.0
    sent: dict[str, float] = field(default_factory=dict)
    send_lag_s: float = 0.0  # the latest a scheduled send went out after its time (Poisson arrivals)
    arrivals: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # (time, tokens in that delta)

    def arrived(self, rid: str, at: float, ntokens: int) -> None:
        """Record one delta of a request."""
        if ntokens:
            self.arrivals.setdefault(rid, []).append((at, ntokens))

    def figures(self) -> dict:
        """Throughput, steady-decode throughput, TTFT, inter-token latency and time per output token."""
        tokens = sum(n for arr in self.arrivals.values() for _, n in arr)
        end = max(arr[-1][0] for arr in self.arrivals.values())
        wall = end - self.start
        ttft = [arr[0][0] - self.sent[rid] for rid, arr in self.arrivals.items()]
        itl = [b[0] - a[0] for arr in self.arrivals.values() for a, b in zip(arr, arr[1:])]
        tpot = [(arr[-1][0] - arr[0][0]) / (sum(n for _, n in arr) - 1) for arr in self.arrivals.values() if sum(n for _, n in arr) > 1]
        lo, hi = self.decode_window()
        decode_tokens = sum(n for arr in self.arrivals.values() for t, n in arr if lo < t <= hi)
        return {
            "output_tokens": tokens,
            "wall_s": round(wall, 4),
            "throughput_tok_s": round(tokens / wall, 2),
            "decode_tok_s": round(decode_tokens / (hi - lo), 2) if hi > lo else None,
            "ttft_ms_p50": _ms(np.percentile(ttft, 50)),
            "ttft_ms_p99": _ms(np.percentile(ttft, 99)),
            "itl_ms_p50": _ms(np.percentile(itl, 50)) if itl else None,
            "itl_ms_p99": _ms(np.percentile(itl, 99)) if itl else None,
            "tpot_ms_median": _ms(np.median(tpot)) if tpot else None,
        }

    def decode_window(self) -> tuple[float, float]:
        """(every request has its first token, the first request has its last): only decodes run inside."""
        lo = max(arr[0][0] for arr in self.arrivals.values())
        hi = min(arr[-1][0] for arr in self.arrivals.values())
        return lo, hi


def _ms(seconds: float) -> float:
    """Seconds as milliseconds, rounded for the JSON line."""
    return round(float(seconds) * 1e3, 3)


def median_figures(runs: list[dict]) -> dict:
    """The median of every numeric figure over repeated runs (None where a run had none)."""
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        out[key] = round(statistics.median(values), 4) if values else None
    return out


def paired_ratio(a_runs: list[dict], b_runs: list[dict], key: str = "throughput_tok_s") -> float | None:
    """Median over repetitions of a[i][key] / b[i][key]: each pair ran back to back, so load drift cancels."""
    pairs = [a[key] / b[key] for a, b in zip(a_runs, b_runs) if a.get(key) and b.get(key)]
    return round(statistics.median(pairs), 3) if pairs else None


# ---- metrale offline, timed per token ----------------------------------------------------------


class _StepClock:
    """Stands in for LLM.engine: forwards everything, and stamps the tokens each step commits.

    The commits are read from the engine's sequences, not from its deltas: LLM.generate asks for a request's
    tokens only when it finishes (deltas would date every token at the end). Reading 32 sequences costs a few
    microseconds a step, inside the timed run: if anything, offline is measured a little slow.
    """

    def __init__(self, engine, timeline: Timeline) -> None:
        self._engine = engine
        self._timeline = timeline
        self._committed: dict[str, int] = {}  # output tokens stamped so far, by request id

    def step(self):
        """The engine's step; every request's newly committed tokens stamped with the step's end."""
        deltas = self._engine.step()
        now = time.perf_counter()
        committed = self._committed
        for rid, seq in self._engine.requests.items():  # a request finished this step is still listed
            n = seq.num_output
            if n > committed.get(rid, 0):
                self._timeline.arrived(rid, now, n - committed.get(rid, 0))
                committed[rid] = n
        return deltas

    def __getattr__(self, name):
        """Everything else is the engine's."""
        return getattr(self._engine, name)


def run_offline(llm, prompts: list[list[int]], params) -> Timeline:
    """LLM.generate on the prompts (one call, as a user would), with every token's arrival time.

    params: one SamplingParams or one per prompt. The offline request ids are LLM's own ("offline-N")."""
    timeline = Timeline()
    engine = llm.engine
    llm.engine = _StepClock(engine, timeline)
    try:
        timeline.start = time.perf_counter()
        outputs = llm.generate(prompts, params)
    finally:
        llm.engine = engine
    for out in outputs:  # every request was added when generate() began
        timeline.sent[out.request_id] = timeline.start
    return timeline


# ---- metrale serve: the subprocess and its clients ---------------------------------------------


class ServeProcess:
    """`metrale serve` started as a user would (own port, log file); stop() leaves nothing behind."""

    def __init__(self, model_dir: str | Path, *args: str, env: dict[str, str] | None = None, ready_timeout_s: float = 300.0) -> None:
        """Start it (env: extra environment variables) and wait for its "metrale serving ... on tcp://HOST:PORT" line."""
        self.log = tempfile.NamedTemporaryFile(prefix="metrale-bench-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "metrale.cli", "serve", "--model", str(model_dir), "--port", "0", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=REPO)
        self.pids: set[int] = {self.proc.pid}
        self.port = 0
        self.ports: list[int] = []  # every frontend's ZMQ port (--api-server-count), frontend 0's first
        try:
            self._wait_ready(ready_timeout_s)
            self.pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            match = re.search(r"metrale serving .* on tcp://[^:]+:(\d+).*", self.log_text())
            if match:
                self.port = int(match.group(1))
                several = re.search(r"ZMQ ports ([\d, ]+)", match.group(0))
                self.ports = [int(p) for p in several.group(1).split(",")] if several else [self.port]
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"metrale serve exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"metrale serve not ready within {timeout_s:.0f} s:\n{self.log_text()[-3000:]}")
            time.sleep(0.1)  # the server's only sign of life is its log; there is no event to wait on

    def http_base(self) -> str:
        """The HTTP API's base URL, from the serving line (started with --http-port)."""
        return "http://127.0.0.1:" + re.search(r"HTTP on http://[^:]+:(\d+)", self.log_text()).group(1)

    def log_text(self) -> str:
        """What the server has logged so far."""
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def child_cmdline(self, module: str) -> list[str] | None:
        """The command line of the server's child running `module` (engine core, worker), if alive."""
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                cmd = p.cmdline()
                if module in cmd:
                    self.pids.add(p.pid)
                    return cmd
        return None

    def process_cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far by each process of the server, by role."""
        roles = {"metrale.gpu_worker.worker": "worker", "metrale.engine_core.core": "engine_core", "frontend": "frontend"}
        out = {}
        with contextlib.suppress(psutil.Error):
            sup = psutil.Process(self.proc.pid)
            t = sup.cpu_times()
            out["supervisor"] = t.user + t.system
            for p in sup.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    cmd, t = p.cmdline(), p.cpu_times()
                    role = next((r for key, r in roles.items() if key in cmd), None)
                    if role is not None:
                        out[role] = t.user + t.system
        return out

    def ring_name(self) -> str | None:
        """The ticket ring the worker serves (from its `--ring NAME` argument)."""
        cmd = self.child_cmdline("metrale.gpu_worker.worker")
        if cmd and "--ring" in cmd:
            return cmd[cmd.index("--ring") + 1]
        return None

    def stop(self) -> list[str]:
        """SIGTERM the supervisor, wait, kill what survived; what had to be cleaned up by hand."""
        with contextlib.suppress(psutil.Error):
            self.pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        left = []
        for pid in self.pids - {self.proc.pid}:
            with contextlib.suppress(psutil.NoSuchProcess):
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE and p.ppid() in (self.proc.pid, 1):
                    left.append(f"process {pid}")
                    p.kill()
        from metrale.ipc.segments import sweep_segments

        left += [f"/dev/shm/{name}" for name in sweep_segments(self.pids)]
        self.log.close()
        if not left:
            os.unlink(self.log.name)
        else:
            note(f"metrale serve left {left} behind (cleaned up); its log: {self.log.name}")
        return left

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class WorkerRingReader:
    """The worker's own clock (idle vs busy), read from the header of a running server's ticket ring.

    Attaches to the ring read-only in effect: it only reads the header the worker writes after every
    step (TicketRing.worker_stats); it never writes a slot and never unlinks the segment."""

    def __init__(self, ring_name: str) -> None:
        from metrale.ipc.tickets import TicketRing

        self.ring = TicketRing.attach(ring_name)

    def snapshot(self):
        """The worker's counters now (a WorkerStats)."""
        return self.ring.worker_stats()

    def close(self) -> None:
        """Unmap the ring (the server owns it and removes it)."""
        self.ring.close()


def idle_fraction(before, after) -> float | None:
    """The worker's idle share between two WorkerStats snapshots: 1 − Δbusy ÷ Δwall.

    Computed from busy time, not idle_ns: the worker clears its "waiting since" mark when a plan arrives
    but adds that wait to idle_ns only after the step, so a snapshot taken while a step runs misses the
    whole wait before it (seconds, after an idle gap between runs) and Δidle can exceed the interval.
    busy_ns has the same lag but only by the one step in progress, which cancels at the two edges."""
    if before is None or after is None:
        return None
    d = after.since(before)
    if d.wall_ns <= 0:
        return None
    return round(min(1.0, max(0.0, 1.0 - d.busy_ns / d.wall_ns)), 4)


@dataclass(slots=True)
class RingWatch:
    """Worker snapshots at a run's edges and at its steady-decode window's edges."""

    reader: WorkerRingReader | None
    at_start: object = None
    at_all_started: object = None
    at_first_finished: object = None
    at_end: object = None

    def take(self):
        """A snapshot now (None without a ring)."""
        return self.reader.snapshot() if self.reader is not None else None

    def figures(self) -> dict:
        """Idle share over the whole run and over its steady-decode window; steps run."""
        return {
            "worker_idle_run": idle_fraction(self.at_start, self.at_end),
            "worker_idle_decode": idle_fraction(self.at_all_started, self.at_first_finished),
            "worker_steps": (self.at_end.steps - self.at_start.steps) if self.at_start and self.at_end else None,
        }


async def _drive(port: int | list[int], prompts, params_list, num_clients: int, watch: RingWatch | None,
                 offsets: list[float] | None) -> Timeline:
    """Run every prompt through num_clients AsyncClients, all at once or request i at start + offsets[i];
    per-token timeline, watch filled in."""
    from metrale import AsyncClient

    ports = port if isinstance(port, list) else [port]
    clients = [AsyncClient(port=ports[i % len(ports)], timeout=600.0) for i in range(num_clients)]
    timeline = Timeline()
    n = len(prompts)
    started, finished = [0], [0]

    async def one(i: int) -> None:
        if offsets is not None:
            delay = timeline.start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        client = clients[i % num_clients]
        rid = f"bench-{i}"
        got_first = False
        sent = timeline.sent[rid] = time.perf_counter()
        if offsets is not None:
            timeline.send_lag_s = max(timeline.send_lag_s, sent - timeline.start - offsets[i])
        async for delta in client.generate(token_ids=prompts[i], params=params_list[i], request_id=rid):
            now = time.perf_counter()
            timeline.arrived(rid, now, len(delta.token_ids))
            if delta.token_ids and not got_first:
                got_first = True
                started[0] += 1
                if watch is not None and started[0] == n:
                    watch.at_all_started = watch.take()
            if delta.finish_reason is not None:
                finished[0] += 1
                if watch is not None and finished[0] == 1:
                    watch.at_first_finished = watch.take()
                if delta.finish_reason not in ("length", "stop"):
                    raise RuntimeError(f"request {rid} ended with {delta.finish_reason!r}")

    try:
        await asyncio.gather(*(c.health() for c in clients))  # every DEALER connected before the clock starts
        if watch is not None:
            watch.at_start = watch.take()
        timeline.start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        if watch is not None:
            watch.at_end = watch.take()
    finally:
        for c in clients:
            await c.close()
    return timeline


def run_clients(port: int | list[int], prompts, params, num_clients: int | None = None, watch: RingWatch | None = None,
                offsets: list[float] | None = None) -> Timeline:
    """The prompts through `metrale serve` on port (uvloop when available), one client per request by default;
    params is one SamplingParams or one per prompt; offsets, when given, are each request's send time (s). A list
    of ports (one per frontend, --api-server-count) spreads the clients over them in turn."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    coro = _drive(port, prompts, params_list, min(num_clients or len(prompts), len(prompts)), watch, offsets)
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    except ImportError:
        return asyncio.run(coro)


def close_all(readers: dict, servers: dict) -> None:
    """Close the ring readers, then stop the servers (a benchmark's finally)."""
    for reader in readers.values():
        if reader is not None:
            reader.close()
    for server in servers.values():
        server.stop()


def thread_env(threads: int | None) -> dict[str, str]:
    """Environment that gives every torch process of `metrale serve` this many intra-op threads (None: its default)."""
    return {} if threads is None else {"OMP_NUM_THREADS": str(threads)}


def set_torch_threads(threads: int | None) -> int:
    """Give torch in this process this many intra-op threads (None: leave the default); the count in force."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def greedy_params(max_tokens: int):
    """The benchmark sampling: greedy, exactly max_tokens new tokens."""
    from metrale.ipc.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _cell(v) -> str:
    """A table cell: ratios and fractions with 3 decimals, larger figures with 1."""
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def table(rows: list[list], header: list[str]) -> str:
    """A plain-text table."""
    cells = [header] + [[_cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---- quiet before a run ---------------------------------------------------------------------------


def settle(min_s: float, max_s: float = 10.0, busy_below: float = 0.15) -> float:
    """Wait at least min_s, then until the machine's CPUs are mostly idle over 100 ms (the last engine's
    OpenMP threads, or vLLM's background processes, have stopped spinning), at most max_s. Seconds waited."""
    start = time.monotonic()
    time.sleep(min_s)
    while time.monotonic() - start < max_s and psutil.cpu_percent(interval=0.1) / 100.0 >= busy_below:
        pass
    return time.monotonic() - start


# ---- the forward-only floor's steps ---------------------------------------------------------------


@dataclass
class FloorRun:
    """One forward-only pass over a batch: its wall time and each step's."""

    wall_s: float
    prefill_steps_s: list[float]
    decode_steps_s: list[float]


class Floor:
    """The forward-only floor: an LLM's own model runner stepping a batch with ModelRunner.forward_only.

    The very runner the LLM executes on (same weights, same cache pages): the floor differs from the
    engine only in skipping it (a second runner with the same settings measured ~5 % apart, from where
    its memory landed). Steps are the engine's shapes: whole prompts per prefill step within the token
    budget, then one token per row. KV blocks are handed out as the engine's pool does: each run
    continues where the last one stopped (wrapping at the end of the cache), a prompt's blocks in a run,
    then each row's next block as it crosses a block boundary; reusing the same few blocks every run
    would keep them in the CPU's caches, which no engine serving fresh requests enjoys. After a run the
    LLM's prefix cache is reset: the floor has overwritten blocks it may hold.
    """

    def __init__(self, llm) -> None:
        self.llm = llm
        self.runner = llm.runner
        self.num_blocks = self.runner.kv_cache.num_blocks
        self.block_size = llm.args.block_size
        self.budget = llm.args.max_num_batched_tokens
        self._next = 0  # where the next run's blocks start (block 0 is never handed out)

    def run(self, prompts: list[list[int]], new_tokens: int) -> FloorRun:
        """Every step of the batch, plans built before the clock starts."""
        plans, n_prefill = self.build(prompts, new_tokens)
        steps = []
        start = time.perf_counter()
        for plan in plans:
            t = time.perf_counter()
            self.runner.forward_only(plan)
            steps.append(time.perf_counter() - t)
        wall = time.perf_counter() - start
        self.llm.reset_prefix_cache()
        return FloorRun(wall, steps[:n_prefill], steps[n_prefill:])

    def build(self, prompts: list[list[int]], new_tokens: int) -> tuple[list, int]:
        """(plans, number of prefill steps) for this batch, built before any clock starts."""
        import numpy as np

        b, p, bs = len(prompts), len(prompts[0]), self.block_size
        prompt_blocks, width = -(-p // bs), -(-(p + new_tokens) // bs)
        order = np.zeros((b, width), dtype=np.int64)
        order[:, :prompt_blocks] = np.arange(b * prompt_blocks).reshape(b, prompt_blocks)
        order[:, prompt_blocks:] = b * prompt_blocks + np.arange(b * (width - prompt_blocks)).reshape(width - prompt_blocks, b).T
        tables = (1 + (self._next + order) % (self.num_blocks - 1)).astype(np.int32)
        self._next = (self._next + b * width) % (self.num_blocks - 1)
        ids = np.asarray(prompts, dtype=np.int32)
        plans = []
        per_step = max(1, self.budget // p)
        for r0 in range(0, b, per_step):
            rows = np.arange(r0, min(b, r0 + per_step))
            pos = np.tile(np.arange(p, dtype=np.int32), len(rows))
            slots = tables[np.repeat(rows, p), pos // bs].astype(np.int64) * bs + pos % bs
            plans.append(floor_plan(ids[rows].reshape(-1), pos, slots, np.arange(len(rows) + 1, dtype=np.int32) * p,
                                    np.full(len(rows), p, dtype=np.int32), tables[rows, :prompt_blocks]))
        n_prefill = len(plans)
        last = ids[:, -1]
        for s in range(new_tokens - 1):
            pos = np.full(b, p + s, dtype=np.int32)
            slots = tables[np.arange(b), pos // bs].astype(np.int64) * bs + pos % bs
            plans.append(floor_plan(last, pos, slots, np.arange(b + 1, dtype=np.int32), pos + 1, tables[:, : -(-(p + s + 1) // bs)]))
        return plans, n_prefill


def floor_plan(input_ids, positions, slot_mapping, query_start, seq_lens, block_tables):
    """A greedy StepPlan over these tokens, every row sampling (the floor computes their logits)."""
    import numpy as np

    from metrale.ipc.plan import FEED_HOST, MASK_NONE, StepPlan

    r = len(seq_lens)
    return StepPlan(
        input_ids=np.ascontiguousarray(input_ids, dtype=np.int32), positions=positions, slot_mapping=slot_mapping,
        query_start=query_start, seq_lens=np.asarray(seq_lens, dtype=np.int32),
        block_tables=np.ascontiguousarray(block_tables), sample=np.ones(r, dtype=bool),
        feed_from_row=np.full(r, FEED_HOST, dtype=np.int32), temperature=np.zeros(r, dtype=np.float32),
        top_k=np.zeros(r, dtype=np.int32), top_p=np.ones(r, dtype=np.float32), min_p=np.zeros(r, dtype=np.float32),
        repetition_penalty=np.ones(r, dtype=np.float32), presence_penalty=np.zeros(r, dtype=np.float32),
        frequency_penalty=np.zeros(r, dtype=np.float32), seeds=np.zeros(r, dtype=np.int64),
        mask_kind=np.full(r, MASK_NONE, dtype=np.uint8), force_token=np.zeros(r, dtype=np.int32),
        ban_ids=np.zeros((r, 0), dtype=np.int32), num_logprobs=np.full(r, -1, dtype=np.int32),
        hist_tokens=np.zeros(0, dtype=np.int32), hist_start=np.zeros(r + 1, dtype=np.int32),
        hist_prompt_len=np.zeros(r, dtype=np.int32),
    )
