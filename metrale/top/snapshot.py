"""What `metrale top` shows, gathered from a running server: its health, the engine's and the frontend's counters
(one `health` and one `stats` query), each local process's CPU and memory (psutil), and the rates between two
snapshots (tokens in and out per second, the worker's idle share).

Everything comes from what the server already reports. TTFT and ITL percentiles over the last minute are the
frontend's (`Stats.frontend`, frontend/latency_window.py); rates are differences of cumulative counters between
this snapshot and the one before, so the first snapshot has none.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from metrale.frontend.client import Client, RequestError
from metrale.ipc.messages import EngineStats, FrontendStats, Health

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
FAULTS_KEPT = 5


@dataclass(slots=True)
class ProcessRow:
    """One server process: what the supervisor reports, and (on this machine) what the OS says."""

    name: str
    pid: int
    alive: bool
    uptime_s: float
    restarts: int
    cpu_percent: float | None = None  # None: not measured (a remote server, a process gone, the first look)
    rss_bytes: int | None = None


@dataclass(slots=True)
class Snapshot:
    """One frame's facts."""

    address: str
    taken_at: float  # time.time()
    healthy: bool = False
    waiting_for: str | None = None
    processes: list[ProcessRow] = field(default_factory=list)
    stats: EngineStats | None = None
    frontend: FrontendStats | None = None
    tokens_in_per_s: float | None = None
    tokens_out_per_s: float | None = None
    worker_idle: float | None = None  # the worker's idle share since the snapshot before
    faults: list[tuple[float, str]] = field(default_factory=list)  # (time.time() first seen, fault), newest last
    error: str | None = None  # why part of the frame is missing


@dataclass(slots=True)
class _Counters:
    """The cumulative counters a rate is the difference of."""

    at: float
    generated: int
    prompt: int | None
    busy_s: float
    idle_s: float


class Sampler:
    """Takes snapshots of one server, remembering what rates and the fault list need between them."""

    def __init__(self, client: Client, host: str, port: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.clock = clock
        self.address = f"{host}:{port}"
        self.local = host in LOCAL_HOSTS
        self._procs: dict[int, psutil.Process] = {}
        self._before: _Counters | None = None
        self._faults: deque[tuple[float, str]] = deque(maxlen=FAULTS_KEPT)
        self._last_fault: str | None = None

    def sample(self) -> Snapshot:
        """A snapshot now; a server that does not answer gives one with `error` set."""
        snap = Snapshot(self.address, time.time())
        try:
            health = self.client.health()
        except TimeoutError as e:
            snap.error = f"no answer to health: {e}"
            snap.faults = list(self._faults)
            return snap
        self._note_fault(health, snap.taken_at)
        snap.healthy, snap.waiting_for = health.healthy, health.waiting_for
        snap.processes = [self._row(p) for p in health.processes]
        try:
            reply = self.client.server_stats()
            snap.stats, snap.frontend = reply.stats, reply.frontend
        except (TimeoutError, RequestError) as e:  # the engine core may be restarting: health still tells
            snap.error = f"no engine counters: {e}"
        if snap.stats is not None:
            self._rates(snap, self.clock())
        snap.faults = list(self._faults)
        return snap

    def _row(self, p) -> ProcessRow:
        """A process's row, with CPU (since the last look) and RSS when it runs on this machine."""
        row = ProcessRow(p.name, p.pid, p.alive, p.uptime_s, p.restarts)
        if not (self.local and p.alive):
            return row
        try:
            proc = self._procs.get(p.pid)
            if proc is None:  # cpu_percent counts from the first call: the first look has none
                proc = self._procs[p.pid] = psutil.Process(p.pid)
                proc.cpu_percent(None)
            else:
                row.cpu_percent = proc.cpu_percent(None)
            row.rss_bytes = proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            self._procs.pop(p.pid, None)
        return row

    def _rates(self, snap: Snapshot, now: float) -> None:
        """Rates since the snapshot before; none across a restart (a counter that went back)."""
        s = snap.stats
        prompt = snap.frontend.prompt_tokens if snap.frontend is not None else None
        now_c = _Counters(now, s.generated_tokens, prompt, s.worker_busy_s, s.worker_idle_s)
        before, self._before = self._before, now_c
        if before is None or now_c.at <= before.at or now_c.generated < before.generated:
            return
        dt = now_c.at - before.at
        snap.tokens_out_per_s = (now_c.generated - before.generated) / dt
        if prompt is not None and before.prompt is not None and prompt >= before.prompt:
            snap.tokens_in_per_s = (prompt - before.prompt) / dt
        busy, idle = now_c.busy_s - before.busy_s, now_c.idle_s - before.idle_s
        if busy >= 0 and idle >= 0 and busy + idle > 0:
            snap.worker_idle = idle / (busy + idle)

    def _note_fault(self, health: Health, at: float) -> None:
        """Keep the last few distinct faults the supervisor reported, with when top first saw each."""
        fault = health.last_fault
        if fault and fault != self._last_fault:
            self._faults.append((at, fault))
        self._last_fault = fault
