"""The soak's faults and the server's resources: a seeded fault schedule, injecting each fault into a live
`metrale serve`, and what the server's processes hold (RSS, file descriptors, shared-memory segments).

Fault kinds: `worker_kill` (SIGKILL a worker rank), `worker_stop` (SIGSTOP one: the engine core's hang watch
must find and kill it), `rank_kill` (SIGKILL a tensor-parallel rank other than 0), `engine_kill` (SIGKILL an
engine core), `replica_kill` (SIGKILL a replica's engine core and every rank of its worker at once) and
`client_reset` (the traffic side resets live HTTP connections, scripts/_soak_traffic.py, or closes ZMQ clients
with live requests, scripts/_soak_streams.py). With ZMQ clients (which re-attach to their requests after a frontend
restart) also `frontend_kill` (SIGKILL the frontend: the supervisor starts a new one on the same ports) and
`frontend_stop` (SIGSTOP the frontend and never continue it: the supervisor's frontend hang watch,
--frontend-hang-timeout, must find its heartbeat silent, kill it and start a new one; recovered once /health answers
from the new one).
Targets are found from the supervisor's process tree each time, so a fault lands on whatever incarnation is live.
`fault_loop` delivers a schedule and times each fault's recovery as /health sees it.

Not a benchmark of its own: scripts/soak.py drives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
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


def fault_kinds(tp: int, dp: int, frontend: bool = False) -> list[tuple[str, float]]:
    """The kinds this shape can take, with their weights (the frontend's only for clients that re-attach)."""
    kinds = [("worker_kill", 3.0), ("worker_stop", 1.5), ("engine_kill", 1.5), ("client_reset", 1.0)]
    if tp > 1:
        kinds.append(("rank_kill", 1.5))
    if dp > 1:
        kinds.append(("replica_kill", 1.0))
    if frontend:
        kinds += [("frontend_kill", 2.0), ("frontend_stop", 1.5)]
    return kinds


def draw_faults(seed: int, duration_s: float, count: int, tp: int, dp: int, min_gap_s: float, *,
                frontend: bool = False, every_kind: bool = False) -> list[Fault]:
    """count faults at seeded times in the middle 80 % of the run, at least min_gap_s apart (fewer if it is short).
    every_kind: each kind at least once (in a seeded order) when count allows, the rest drawn by weight."""
    rng = random.Random(seed * 7919 + 1)
    kinds = fault_kinds(tp, dp, frontend)
    lo, hi = 0.1 * duration_s, 0.9 * duration_s
    count = max(0, min(count, int((hi - lo) / min_gap_s)))
    slack = (hi - lo) - count * min_gap_s
    offsets = sorted(rng.uniform(0, slack) for _ in range(count))
    names = [k for k, _ in kinds]
    drawn = rng.sample(names, len(names))[:count] if every_kind else []
    drawn += rng.choices(names, [w for _, w in kinds], k=count - len(drawn))
    if every_kind:
        rng.shuffle(drawn)
    return [Fault(lo + off + i * min_gap_s, kind) for i, (off, kind) in enumerate(zip(offsets, drawn))]


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
    elif fault.kind in ("frontend_kill", "frontend_stop"):
        frontends = [p for p in procs if p.role == "frontend"]
        targets = [rng.choice(frontends)] if frontends else []
    else:
        raise ValueError(fault.kind)
    if not targets:
        return False
    sig = signal.SIGSTOP if fault.kind in ("worker_stop", "frontend_stop") else signal.SIGKILL
    for p in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)
    fault.pids = tuple(p.pid for p in targets)
    fault.target = ", ".join(f"{p.role} r{p.replica}" + (f" rank {p.rank}" if p.role == "worker" else "") +
                             f" pid {p.pid}" for p in targets)
    return True


def resume(fault: Fault) -> None:
    """SIGKILL what a frontend_stop stopped if it is still there (the hang watch failed; the fault then counts as not
    recovered): the phase never leaves a stopped process behind. Gone already (killed by the watch): nothing to do."""
    for pid in fault.pids:
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                os.kill(pid, signal.SIGKILL)


async def healthy(session: aiohttp.ClientSession, base: str, gone: tuple[int, ...] = ()) -> bool:
    """/health is 200 with every replica ready, and none of the processes `gone` is among its processes."""
    try:
        async with session.get(f"{base}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            body = await resp.json()
            return (resp.status == 200 and all(body.get("replicas_ready") or [True])
                    and not {p["pid"] for p in body.get("processes", [])} & set(gone))
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return False


async def fault_loop(session: aiohttp.ClientSession, base: str, sup_pid: int, faults: list[Fault], start: float,
                     deadline_s: float, seed: int, reset: Callable[[random.Random], Awaitable[str]],
                     on_inject: Callable[[Fault], None] = lambda f: None, note: Callable[[str], None] = print) -> None:
    """Deliver each fault at its time (reset() does a client_reset and says what it cut; on_inject is called as a
    fault lands), then wait for /health to be healthy without the processes it hit: a stopped frontend is never
    continued, so a frontend_stop recovers only when the supervisor's hang watch has replaced it."""
    rng = random.Random(seed)  # which target of several a fault hits
    for f in faults:
        await asyncio.sleep(max(0.0, start + f.at - time.monotonic()))
        f.injected_at = time.monotonic()
        if f.kind == "client_reset":
            f.target = await reset(rng)
        elif not inject(f, sup_pid, rng):
            f.target = "no target was live"
        on_inject(f)
        note(f"fault at {f.injected_at - start:.0f} s: {f.kind} -> {f.target}")
        while time.monotonic() - f.injected_at < deadline_s:
            if await healthy(session, base, f.pids):
                f.healthy_s = time.monotonic() - f.injected_at
                break
            await asyncio.sleep(0.2)  # a poll of /health: the server has no event to wait on


async def sample_series(session: aiohttp.ClientSession, base: str, sup_pid: int, start: float, series: list[dict],
                        done: asyncio.Event, fd_roles: tuple[str, ...] = (), seen: set[int] | None = None) -> None:
    """Once a second until done: RSS by role, health (and open fds of fd_roles) into series; every pid of the
    server's tree into seen."""
    while not done.is_set():
        t = time.monotonic()
        point = {"t": t - start, "rss": rss_by_role(sup_pid, seen), "healthy": await healthy(session, base)}
        if fd_roles:
            point["fds"] = open_fds(sup_pid, fd_roles)
            point["by_pid"] = by_pid(sup_pid, fd_roles)
        series.append(point)
        with contextlib.suppress(TimeoutError):  # a sampling period, not a wait on work
            await asyncio.wait_for(done.wait(), max(0.0, 1.0 - (time.monotonic() - t)))


def rss_by_role(supervisor_pid: int, seen: set[int] | None = None) -> dict[str, int]:
    """Resident bytes of the server's processes, summed by role (their pids added to seen)."""
    out: dict[str, int] = {}
    for p in server_processes(supervisor_pid):
        if seen is not None:
            seen.add(p.pid)
        with contextlib.suppress(psutil.Error):
            out[p.role] = out.get(p.role, 0) + psutil.Process(p.pid).memory_info().rss
    return out


def open_fds(supervisor_pid: int, roles: tuple[str, ...] = ("supervisor", "frontend")) -> dict[str, int]:
    """Open file descriptors of the server's processes of these roles (by default the long-lived ones), by role."""
    out: dict[str, int] = {}
    for p in server_processes(supervisor_pid):
        if p.role in roles:
            with contextlib.suppress(psutil.Error):
                out[p.role] = out.get(p.role, 0) + psutil.Process(p.pid).num_fds()
    return out


def owned_by(entries: set[str] | list[str], pids: set[int]) -> list[str]:
    """The entries named for one of pids (metrale-PID-...): the box may hold other servers' segments meanwhile."""
    from metrale.ipc.segments import owner_pid_of

    return sorted(e for e in entries if owner_pid_of(e) in pids)


def by_pid(supervisor_pid: int, roles: tuple[str, ...]) -> dict[int, tuple[str, int, int]]:
    """pid -> (role, RSS bytes, open fds) of the server's processes of these roles: a leak shows in one process's own
    life, which a restart (a fault) would hide in a sum by role."""
    out: dict[int, tuple[str, int, int]] = {}
    for p in server_processes(supervisor_pid):
        if p.role in roles:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(p.pid)
                out[p.pid] = (p.role, proc.memory_info().rss, proc.num_fds())
    return out


def shm_entries() -> set[str]:
    """metrale's entries in /dev/shm (segments and doorbell sockets)."""
    with contextlib.suppress(FileNotFoundError):
        return {n for n in os.listdir("/dev/shm") if n.startswith("metrale-")}
    return set()
