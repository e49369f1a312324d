"""A frontend's heartbeat and the supervisor's FrontendHangWatch: when a frontend that is alive but makes no progress
counts as hung.

A frontend can be alive and serve nothing: stopped (SIGSTOP), or its event loop stuck in a call that never returns.
Its process is then alive, so the supervisor's death watch never sees it, and every client of it waits forever.

The beat: each frontend has an 8-byte counter in a file of the run folder, mapped by it and by the supervisor. A
callback on the frontend's event loop adds one to it every BEAT_INTERVAL_S once the frontend serves. It is the event
loop that beats, not a thread: a thread would go on beating while the loop that serves every stream is stuck. A loop
busy with many streams still beats on time: a due timer runs at the next turn of the loop, after at most one pass over
the callbacks ready then, each a bounded slice of work (a frame, a chunk of a stream) — a delay of one turn, far below
any timeout. Only a loop that stops turning (stopped, blocked, spinning inside one callback) falls silent.

The watch: the supervisor reads each counter on every pass of its watch (a load from a mapped page, no system call)
and times on its own clock how long it has not changed; a frontend silent for longer than `timeout_s`
(--frontend-hang-timeout) is hung, and the supervisor kills it and restarts it as if it had died. A counter still 0
is a frontend starting up (importing, loading its tokenizer, binding its ports), which may take far longer than a
beat's timeout on a busy box: it is timed against STARTUP_S instead, so a frontend stopped before it first served
is still caught (later, never not at all).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from metrale.settings import DEFAULTS

HEARTBEAT_ENV = "METRALE_FRONTEND_HEARTBEAT"  # how the supervisor hands a frontend its heartbeat file
BEAT_INTERVAL_S = 0.25  # a beat's period: a quarter of the smallest timeout, 4 callbacks a second
# A start-up's budget: a restarted frontend imports and builds its tokenizer again; on a starved box that has taken
# tens of seconds. Past it, a frontend that never beat is hung like a silent one.
STARTUP_S = 120.0
_COUNTER = struct.Struct("=Q")


def _mapped(path: str | Path) -> mmap.mmap:
    """The counter's 8 bytes, mapped shared (the file made and zeroed if missing)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < _COUNTER.size:
            os.ftruncate(fd, _COUNTER.size)
        return mmap.mmap(fd, _COUNTER.size)
    finally:
        os.close(fd)  # the mapping keeps the file


class Heartbeat:
    """The frontend's side: a counter its event loop advances every BEAT_INTERVAL_S while `serving()` holds."""

    def __init__(self, path: str | Path, interval_s: float = BEAT_INTERVAL_S):
        self._map = _mapped(path)
        self.interval_s = interval_s
        self.count = 0

    def start(self, loop: asyncio.AbstractEventLoop, serving: Callable[[], bool] = lambda: True) -> None:
        """Beat on this loop from now on (a beat before `serving()` holds is skipped: start-up is not timed)."""

        def beat() -> None:
            if serving():
                self.beat()
            loop.call_later(self.interval_s, beat)

        loop.call_soon(beat)

    def beat(self) -> None:
        """One beat: the counter moves."""
        self.count += 1
        _COUNTER.pack_into(self._map, 0, self.count)


@dataclass(slots=True)
class FrontendHangWatch:
    """The supervisor's side for one frontend: how long its counter has not moved, on the supervisor's clock."""

    path: Path
    timeout_s: float = DEFAULTS.frontend_hang_timeout_s  # --frontend-hang-timeout
    startup_s: float = STARTUP_S  # how long a frontend may take to beat for the first time
    _map: mmap.mmap | None = field(default=None, repr=False)
    _last: int = 0  # the counter as last read
    _since: float = 0.0  # when it last changed

    def reset(self, now: float) -> None:
        """A frontend (re)starts: its counter is 0 (starting up) until it serves."""
        if self._map is None:
            self._map = _mapped(self.path)
        _COUNTER.pack_into(self._map, 0, 0)
        self._last, self._since = 0, now

    def silent_s(self, now: float) -> float | None:
        """Seconds since the counter last moved (or, before the first beat, since the reset); None if never reset."""
        if self._map is None:
            return None
        count = _COUNTER.unpack_from(self._map, 0)[0]
        if count != self._last:
            self._last, self._since = count, now
        return now - self._since

    def hung(self, now: float) -> str | None:
        """Why the frontend counts as hung now, or None."""
        silent = self.silent_s(now)
        if silent is None:
            return None
        if self._last == 0:
            if silent <= self.startup_s:
                return None
            return f"it has not started serving {silent:.1f} s after it was started (start-up budget {self.startup_s:g} s)"
        if silent <= self.timeout_s:
            return None
        return f"its event loop has not beaten for {silent:.1f} s (--frontend-hang-timeout {self.timeout_s:g})"

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
