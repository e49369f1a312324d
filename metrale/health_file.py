"""The supervisor's health file: how `metrale serve` tells its frontend which processes are alive.

The supervisor publishes a `Health` message into a file in its run folder; the frontend reads it when a
client asks. It is rewritten only when what it says changes (a death, a restart, giving up), or once every
REFRESH_S: uptimes move on every pass of the supervisor's watch, so the file holds them as of its writing
and the reader adds the file's age.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from metrale.ipc.messages import Health

REFRESH_S = 1.0  # the longest the file goes unwritten: bounds how far a step of the wall clock skews its age


class HealthFile:
    """The writer's side: publish(health) on every watch pass; the file changes only when it must."""

    def __init__(self, path: Path, clock: Callable[[], float]):
        self.path = path
        self.clock = clock
        self._written: tuple | None = None  # _state of the file's content
        self._written_at = float("-inf")

    def publish(self, health: Health) -> None:
        """Write health (atomic replace) if it says something new or REFRESH_S have passed."""
        now = self.clock()
        state = _state(health)
        if state == self._written and now - self._written_at < REFRESH_S:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.msgpack.encode(health))
        os.replace(tmp, self.path)
        self._written, self._written_at = state, now


def read_health(path: str | Path) -> Health:
    """The reader's side: the file's Health, each live process's uptime brought forward by the file's age."""
    with open(path, "rb") as f:  # the mtime of the very file read (a newer one may replace it meanwhile)
        data = f.read()
        written = os.fstat(f.fileno()).st_mtime
    health = msgspec.msgpack.decode(data, type=Health)
    age = max(0.0, time.time() - written)
    for p in health.processes:
        if p.alive:
            p.uptime_s += age
    return health


def _state(health: Health) -> tuple:
    """What a Health says apart from uptimes: a change of it is published at once."""
    return health.healthy, health.last_fault, tuple((p.name, p.pid, p.restarts, p.alive) for p in health.processes)
