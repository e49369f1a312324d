"""The soak's faults and the server's resources: a seeded fault schedule, injecting each fault into a live
`metrale serve`, and what the server's processes hold (RSS, file descriptors, shared-memory segments).

Fault kinds: `worker_kill` (SIGKILL a worker rank), `worker_stop` (SIGSTOP one: the engine core's hang watch
must find and kill it), `rank_kill` (SIGKILL a tensor-parallel rank other than 0), `engine_kill` (SIGKILL an
engine core), `replica_kill` (SIGKILL a replica's engine core and every rank of its worker at once) and
`client_reset` (the traffic side resets live HTTP connections: scripts/_soak_traffic.py). Targets are found
from the supervisor's process tree each time, so a fault lands on whatever incarnation is live.

Not a benchmark of its own: scripts/soak.py drives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
from dataclasses import dataclass

import psutil

WORKER, ENGINE, FRONTEND = "metrale.gpu_worker.worker", "metrale.engine_core.core", "metrale.frontend_process"


@dataclass
class Fault:
    """One fault of the schedule and what became of it."""

    at: float  # seconds after the start
    kind: str
    target: str = ""  # what it hit ("worker r0 rank 1 pid 123")
    injected_at: float | None = None  # monotonic
    pids: tuple[int, ...] = ()  # the processes it hit
    resumed_s: float | None = None  # injection -> every stream live then has a new token
    healthy_s: float | None = None  # injection -> /health healthy, every replica ready, its targets replaced


def fault_kinds(tp: int, dp: int) -> list[tuple[str, float]]:
    """The kinds this shape can take, with their weights."""
    kinds = [("worker_kill", 3.0), ("worker_stop", 1.5), ("engine_kill", 1.5), ("client_reset", 1.0)]
    if tp > 1:
        kinds.append(("rank_kill", 1.5))
    if dp > 1:
        kinds.append(("replica_kill", 1.0))
    return kinds


def draw_faults(seed: int, duration_s: float, count: int, tp: int, dp: int, min_gap_s: float) -> list[Fault]:
    """count faults at seeded times in the middle 80 % of the run, at least min_gap_s apart (fewer if it is short)."""
    rng = random.Random(seed * 7919 + 1)
    kinds = fault_kinds(tp, dp)
    lo, hi = 0.1 * duration_s, 0.9 * duration_s
    count = max(0, min(count, int((hi - lo) / min_gap_s)))
    slack = (hi - lo) - count * min_gap_s
    offsets = sorted(rng.uniform(0, slack) for _ in range(count))
    return [Fault(lo + off + i * min_gap_s, rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0])
            for i, off in enumerate(offsets)]


@dataclass
class Proc:
    """A live process of the server and its place."""

    pid: int
    role: str  # "supervisor" | "frontend" | "engine" | "worker"
    replica: int = 0
    rank: int = 0
    ring_token: str = ""


def server_processes(supervisor_pid: int) -> list[Proc]:
    """The supervisor and its live children, each with its role, replica and rank."""
    procs = [Proc(supervisor_pid, "supervisor")]
    try:
        children = psutil.Process(supervisor_pid).children(recursive=True)
    except psutil.Error:
        return procs
    for p in children:
        with contextlib.suppress(psutil.Error):
            if p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                continue
            cmd = p.cmdline()
            if ENGINE in cmd:
                args = json.loads(cmd[cmd.index("--args") + 1])
                procs.append(Proc(p.pid, "engine", args.get("replica", 0), 0, args.get("ring_token", "")))
            elif WORKER in cmd:
                ring = cmd[cmd.index("--ring") + 1] if "--ring" in cmd else ""
                rank = json.loads(cmd[cmd.index("--group") + 1]).get("rank", 0) if "--group" in cmd else 0
                procs.append(Proc(p.pid, "worker", 0, rank, ring.rsplit("-", 1)[-1]))
            elif FRONTEND in cmd:
                procs.append(Proc(p.pid, "frontend"))
    engines = {p.ring_token: p.replica for p in procs if p.role == "engine"}
    for p in procs:
        if p.role == "worker":
            p.replica = engines.get(p.ring_token, -1)
    return procs


def inject(fault: Fault, supervisor_pid: int, rng: random.Random) -> bool:
    """Deliver a process fault (client_reset is the traffic's); False when no target was live."""
    procs = server_processes(supervisor_pid)
    workers = [p for p in procs if p.role == "worker"]
    engines = [p for p in procs if p.role == "engine"]
    if fault.kind in ("worker_kill", "worker_stop"):
        targets = [rng.choice(workers)] if workers else []
    elif fault.kind == "rank_kill":
        ranks = [p for p in workers if p.rank > 0]
        targets = [rng.choice(ranks)] if ranks else []
    elif fault.kind == "engine_kill":
        targets = [rng.choice(engines)] if engines else []
    elif fault.kind == "replica_kill":
        replica = rng.choice(engines).replica if engines else None
        targets = [p for p in engines + workers if p.replica == replica]
    else:
        raise ValueError(fault.kind)
    if not targets:
        return False
    sig = signal.SIGSTOP if fault.kind == "worker_stop" else signal.SIGKILL
    for p in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)
    fault.pids = tuple(p.pid for p in targets)
    fault.target = ", ".join(f"{p.role} r{p.replica}" + (f" rank {p.rank}" if p.role == "worker" else "") +
                             f" pid {p.pid}" for p in targets)
    return True


def rss_by_role(supervisor_pid: int) -> dict[str, int]:
    """Resident bytes of the server's processes, summed by role."""
    out: dict[str, int] = {}
    for p in server_processes(supervisor_pid):
        with contextlib.suppress(psutil.Error):
            out[p.role] = out.get(p.role, 0) + psutil.Process(p.pid).memory_info().rss
    return out


def open_fds(supervisor_pid: int) -> dict[str, int]:
    """Open file descriptors of the long-lived processes (supervisor and frontend), by role."""
    out: dict[str, int] = {}
    for p in server_processes(supervisor_pid):
        if p.role in ("supervisor", "frontend"):
            with contextlib.suppress(psutil.Error):
                out[p.role] = psutil.Process(p.pid).num_fds()
    return out


def shm_entries() -> set[str]:
    """metrale's entries in /dev/shm (segments and doorbell sockets)."""
    with contextlib.suppress(FileNotFoundError):
        return {n for n in os.listdir("/dev/shm") if n.startswith("metrale-")}
    return set()
