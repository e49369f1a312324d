"""The processes a supervisor runs: one `Child`, a replica's `WorkerGroup` of tensor-parallel ranks supervised as
one, and the `RestartPolicy` that decides when a dead one starts again."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil


@dataclass(slots=True)
class RestartPolicy:
    """When a dead child is started again: at once, after a backoff, or never (the server is then unhealthy)."""

    window_s: float = 30.0  # a child that lived longer than this did not crash "in a row"
    max_in_a_row: int = 5  # this many deaths in a row: give up
    backoff_s: float = 0.5  # the wait before the second restart in a row; it doubles after each death
    max_backoff_s: float = 10.0

    def delay(self, in_a_row: int) -> float | None:
        """Seconds to wait before the next start after this many deaths in a row; None: do not restart."""
        if in_a_row >= self.max_in_a_row:
            return None
        if in_a_row <= 1:
            return 0.0
        return min(self.max_backoff_s, self.backoff_s * 2 ** (in_a_row - 2))


@dataclass(slots=True)
class Child:
    """One supervised process and its restart history."""

    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0  # on the supervisor's clock
    restarts: int = 0
    env_extra: dict[str, str] = field(default_factory=dict)  # on top of the supervisor's environment
    in_a_row: int = 0  # deaths without work done in between (RestartPolicy)
    restart_at: float | None = None  # set when it died: when to start it again (NEVER: given up)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def start(self, env: dict[str, str], now: float) -> None:
        """Start (or restart) the process."""
        env = {**env, **self.env_extra} if self.env_extra else env
        self.proc = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        self.started = now
        self.restart_at = None

    def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after grace_s; reaps the process and waits for what it started to end too."""
        if self.proc is None:
            return
        try:  # e.g. multiprocessing's resource tracker, which exits once its parent has
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            descendants = []
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        _, alive = psutil.wait_procs(descendants, timeout=grace_s)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:  # it ended meanwhile: the rest are still killed
                pass

    def kill(self) -> None:
        """SIGKILL it (and what it started) at once and reap it: a rank of a broken group, which may be stopped or
        waiting in a collective that will never finish."""
        if self.proc is None:
            return
        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            descendants = []
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        for p in descendants:
            try:
                p.kill()
            except psutil.Error:
                pass


@dataclass(slots=True)
class WorkerGroup:
    """A replica's worker ranks on this host, supervised as one child: they start together (each start meets at a
    fresh rendezvous), and any rank's death is the group's, which then is killed whole and restarted.

    It answers what the supervisor asks a Child (alive, proc, pid, name, the restart fields); for a dead group,
    proc, pid and name are the dead rank's, so a fault names the rank that died."""

    role: str  # "gpu_worker"
    argvs: Callable[[int], list[list[str]]]  # generation -> one command line per rank
    env_extra: dict[str, str] = field(default_factory=dict)
    ranks: list[Child] = field(default_factory=list)
    started: float = 0.0
    restarts: int = 0
    in_a_row: int = 0
    restart_at: float | None = None
    generation: int = 0  # starts so far

    @classmethod
    def of(cls, child: Child) -> WorkerGroup:
        """A group of one already made child (a stand-in, in tests)."""
        group = cls(child.name, lambda generation: [child.argv], dict(child.env_extra), [child], child.started)
        return group

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def alive(self) -> bool:
        """Every rank runs."""
        return bool(self.ranks) and all(r.alive for r in self.ranks)

    @property
    def dead_rank(self) -> int | None:
        """The first rank that is not running (None while all run)."""
        return next((i for i, r in enumerate(self.ranks) if not r.alive), None)

    @property
    def proc(self) -> subprocess.Popen | None:
        """The dead rank's process once one died, else rank 0's."""
        rank = self.dead_rank
        return self.ranks[rank if rank is not None else 0].proc if self.ranks else None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    @property
    def name(self) -> str:
        """"gpu_worker", or "gpu_worker rank R" for the rank of a larger group that died."""
        rank = self.dead_rank
        return self.role if len(self.ranks) < 2 or rank is None else f"{self.role} rank {rank}"

    def start(self, env: dict[str, str], now: float) -> None:
        """Start every rank (a fresh generation)."""
        self.generation += 1
        self.ranks = [Child(self.role, argv, env_extra=self.env_extra) for argv in self.argvs(self.generation)]
        for child in self.ranks:
            child.start(env, now)
        self.started = now
        self.restart_at = None

    def stop(self, grace_s: float) -> None:
        """Stop every rank (SIGTERM, then SIGKILL after grace_s)."""
        for child in self.ranks:
            if child.alive:
                child.proc.terminate()
        for child in self.ranks:
            child.stop(grace_s)

    def kill(self) -> None:
        """SIGKILL every rank that still runs: the group is broken (see Child.kill)."""
        for child in self.ranks:
            child.kill()
