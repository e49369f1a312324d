"""HangWatch: when a worker that is alive but makes no progress counts as hung.

A worker can be alive and still never answer: stopped (SIGSTOP), deadlocked, or in a kernel that never
returns. Liveness checks cannot see that; progress can. The worker runs tickets in order, so the oldest
ticket in flight is the one it works on, and it started no earlier than the later of its launch and the
previous result. HangWatch keeps the recent steps' time per unit of work (tokens x steps) and allows a ticket
`factor` times the slowest recent rate for its own work, never less than `floor_s`; a worker's first steps
(compilation, warm-up, a long first prefill) get `first_steps_s`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from metrale.settings import DEFAULTS

NS = 1_000_000_000


@dataclass(slots=True)
class HangWatch:
    """Step deadlines that adapt to the model's own step times."""

    floor_s: float = DEFAULTS.worker_hang_timeout_s  # a step may always take this long (--worker-hang-timeout)
    factor: float = 20.0  # ... or this many times the slowest recent step, per unit of work
    first_steps_s: float = 300.0  # the allowance of a worker's first `warmup` steps
    warmup: int = 2
    history: int = 64
    _rates: deque[float] = field(default_factory=deque)  # recent ns per unit of work
    _seen: int = 0  # steps completed by the current worker

    def reset(self) -> None:
        """A new worker: its first steps get the warm-up allowance again."""
        self._rates.clear()
        self._seen = 0

    def record(self, elapsed_ns: int, work: int) -> None:
        """A ticket of `work` units (tokens x steps) took elapsed_ns."""
        self._seen += 1
        if self._seen <= self.warmup:
            return  # warm-up steps say nothing about the model's steady step time
        self._rates.append(elapsed_ns / max(1, work))
        if len(self._rates) > self.history:
            self._rates.popleft()

    def limit_ns(self, work: int) -> int:
        """How long a ticket of `work` units may run before its worker counts as hung."""
        if self._seen < self.warmup or not self._rates:
            return int(max(self.floor_s, self.first_steps_s) * NS)
        return int(max(self.floor_s * NS, self.factor * max(self._rates) * max(1, work)))
