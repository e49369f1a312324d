"""Worker control for fault tests: the supervisor's answers to `metrale worker kill` / `metrale worker restart`.

The supervisor owns the worker process, so it is the one that signals it; what happens next is the ordinary fault
path: a KILLed or TERMed worker dies, the engine core requeues its requests and the supervisor starts a new one; a
STOPped worker lives on without progress until the engine core's hang watch (`--worker-hang-timeout`) kills it as
hung. `restart` is TERM, then KILL if the worker has not exited within RESTART_GRACE_S. The death an admin request
caused is named so in the last fault and is not counted as a crash in a row (RestartPolicy).

Ranks and replicas: a server runs `replicas` engine cores of `ranks` worker ranks each (--data-parallel-size,
--tensor-parallel-size, on this host); a rank or replica outside them is refused with the range that exists.
Killing one rank of a tensor-parallel group takes the group down, as any rank's death does, and it restarts whole.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from metrale.ipc.errors import ErrorCode
from metrale.ipc.messages import Admin, AdminReply, Error

SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "STOP": signal.SIGSTOP}
ACTIONS = ("kill", "restart")
RESTART_GRACE_S = 5.0


@dataclass(slots=True)
class AdminSignal:
    """A signal an admin request sent to a worker, remembered until that worker's death is noted."""

    pid: int
    signal: str
    action: str
    at: float  # on the supervisor's clock
    escalate_at: float | None = None  # restart: KILL it then if it still lives

    def describe(self) -> str:
        return f"metrale worker {self.action}" + (f" --signal {self.signal}" if self.action == "kill" else "")


@dataclass(slots=True)
class WorkerControl:
    """Validates admin requests against the workers that exist and signals the one named."""

    ranks: int = 1  # workers per replica (tensor parallel size)
    replicas: int = 1  # engine cores (data parallel size)
    sent: AdminSignal | None = None

    def handle(self, msg: Admin, pid_of: Callable[[int, int], int | None], now: float) -> AdminReply | Error:
        """Signal the worker msg names (pid_of(replica, rank): its pid, None while it is not running); Error
        naming the field when it cannot be done."""
        refused = self._check(msg)
        if refused is not None:
            return Error(id=msg.id, code=ErrorCode.BAD_REQUEST.value, message=refused)
        worker_pid = pid_of(msg.replica, msg.rank)
        if worker_pid is None:
            return Error(id=msg.id, code=ErrorCode.BUSY.value,
                         message="the worker is not running now (it is being restarted); try again")
        name = "TERM" if msg.action == "restart" else msg.signal.upper()
        try:
            os.kill(worker_pid, SIGNALS[name])
        except ProcessLookupError:
            return Error(id=msg.id, code=ErrorCode.BUSY.value, message="the worker exited meanwhile; try again")
        self.sent = AdminSignal(worker_pid, name, msg.action, now,
                                escalate_at=now + RESTART_GRACE_S if msg.action == "restart" else None)
        what = {"KILL": "killed (SIGKILL)", "TERM": "sent SIGTERM", "STOP": "stopped (SIGSTOP): the hang watch "
                "will find it, kill it and a new worker will take over"}[name]
        if msg.action == "restart":
            what = "sent SIGTERM (SIGKILL follows if it has not exited within %g s); a new worker takes over" % RESTART_GRACE_S
        return AdminReply(id=msg.id, pid=worker_pid, detail=f"gpu_worker rank {msg.rank} of replica {msg.replica} "
                                                              f"(pid {worker_pid}): {what}")

    def _check(self, msg: Admin) -> str | None:
        """Why msg cannot be done, or None."""
        if msg.action not in ACTIONS:
            return f"action must be one of {', '.join(ACTIONS)} (got {msg.action!r})"
        if msg.signal.upper() not in SIGNALS:
            return f"signal must be one of {', '.join(SIGNALS)} (got {msg.signal!r})"
        if not 0 <= msg.rank < self.ranks:
            return (f"rank {msg.rank}: this server runs {self.ranks} worker rank{'s' * (self.ranks > 1)} per replica "
                    f"(rank 0{f' to {self.ranks - 1}' if self.ranks > 1 else ' only'})")
        if not 0 <= msg.replica < self.replicas:
            return (f"replica {msg.replica}: this server runs {self.replicas} replica{'s' * (self.replicas > 1)} "
                    f"(replica 0{f' to {self.replicas - 1}' if self.replicas > 1 else ' only'})")
        return None

    def escalate(self, alive: Callable[[int], bool], now: float) -> None:
        """A restart whose TERM the worker has not obeyed in time (alive(pid) still): KILL it."""
        sent = self.sent
        if sent is not None and sent.escalate_at is not None and now >= sent.escalate_at:
            sent.escalate_at = None
            if alive(sent.pid):
                os.kill(sent.pid, signal.SIGKILL)

    def took(self, pids: set[int]) -> AdminSignal | None:
        """The admin signal that ended a worker group of these pids (forgotten then), or None when it died on its
        own."""
        sent = self.sent
        if sent is None or sent.pid not in pids:
            return None
        self.sent = None
        return sent
