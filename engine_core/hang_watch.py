"""HangWatch: when a worker that is alive but makes no progress counts as hung.

A worker can be alive and still never answer: stopped (SIGSTOP), deadlocked, or in a kernel that never
returns. Liveness checks cannot see that; progress can. The worker runs tickets in order, so the oldest
ticket in flight is the one it works on, and it started no earlier than the later of its launch and the
previous result.

A ticket may run `floor_s` (--worker-hang-timeout) plus `margin` times its EXPECTED time. The expected time
comes from the work the ticket carries (StepWork: forward passes, prefill tokens, decode positions) through a
linear fit of the steps this server ran, t = a·forwards + b·prefill_tokens + c·decode_positions, so a
4,096-token prefill after a run of decode steps is priced at prefill speed, not at the per-token time of a
one-row decode. Until the fit has seen enough prefill (or decode) steps to price that kind of work, the
slowest recent time per unit of work stands in for its rate: cautious, never the old 20-fold of it. A
worker's first `warmup` steps (compilation, warm-up) are not recorded and get `first_steps_s`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from metrale.ipc.plan import StepKind, StepPlan
from metrale.settings import DEFAULTS

NS = 1_000_000_000
MIN_SAMPLES = 2  # steps with prefill (or decode) work before the fit prices that kind of work


@dataclass(frozen=True, slots=True)
class StepWork:
    """What a ticket asks of the device, in the units its time grows with."""

    forwards: int = 1  # forward passes: a burst's steps; 1 for any other ticket
    prefill_tokens: int = 0  # tokens of rows that run more than one new position (prompt chunks)
    decode_positions: int = 0  # one per decode row and forward; a verify row's last token and its drafts

    @classmethod
    def of_plan(cls, plan: StepPlan, kind: StepKind = StepKind.STEP, steps: int = 1) -> StepWork:
        """A plan's work: a row whose new tokens are more than its last token and drafts is a prefill chunk."""
        per_row = np.diff(plan.query_start)
        chunk = per_row > 1 + plan.num_drafts
        prefill = int(per_row[chunk].sum())
        decode = int(per_row.sum()) - prefill
        if kind == StepKind.BURST:
            return cls(forwards=steps, prefill_tokens=0, decode_positions=(decode + prefill) * steps)
        return cls(forwards=1, prefill_tokens=prefill, decode_positions=decode)

    @property
    def vector(self) -> tuple[float, float, float]:
        return float(self.forwards), float(self.prefill_tokens), float(self.decode_positions)

    @property
    def units(self) -> int:
        """Tokens times forwards, at least 1: the old single measure (for the slowest-rate stand-in)."""
        return max(1, self.prefill_tokens + self.decode_positions)


NO_WORK = StepWork()  # a ticket without a plan (logits, LoRA): one forward's overhead


@dataclass(slots=True)
class HangWatch:
    """Step deadlines from each step's expected time, fitted to the steps this server ran."""

    floor_s: float = DEFAULTS.worker_hang_timeout_s  # a step may always take this long (--worker-hang-timeout)
    margin: float = 2.0  # ... plus this many times its expected time
    first_steps_s: float = 300.0  # the allowance of a worker's first `warmup` steps
    warmup: int = 2
    history: int = 64  # recent steps the fit reads (and the slowest rate's window)
    prefill_history: int = 32  # recent steps with prefill work, kept apart so decode runs do not push them out
    refit_every: int = 16  # records between fits (a fit is a few small least-squares solves)
    _recent: deque = field(default_factory=deque)  # (StepWork, seconds)
    _prefills: deque = field(default_factory=deque)  # (StepWork, seconds) of steps with prefill tokens
    _seen: int = 0  # steps completed by the current worker
    _stale: int = 0  # records since the last fit
    _rates: np.ndarray | None = None  # seconds per forward, prefill token, decode position (None: not fitted)

    def reset(self) -> None:
        """A new worker: its first steps get the warm-up allowance again. The fit stays: same model, same device."""
        self._seen = 0

    def record(self, elapsed_ns: int, work: StepWork | int) -> None:
        """A ticket of this work took elapsed_ns (an int work: that many decode positions). A ticket without
        tokens (a logits read, a LoRA load) is no step: it neither counts toward warm-up nor feeds the fit."""
        work = _as_work(work)
        if not (work.prefill_tokens or work.decode_positions):
            return
        self._seen += 1
        if self._seen <= self.warmup:
            return  # warm-up steps say nothing about the model's steady step time
        sample = (work, elapsed_ns / NS)
        if work.prefill_tokens:
            self._prefills.append(sample)
            if len(self._prefills) > self.prefill_history:
                self._prefills.popleft()
        else:
            self._recent.append(sample)
            if len(self._recent) > self.history:
                self._recent.popleft()
        self._stale += 1
        if self._rates is None or self._stale >= self.refit_every:
            self._refit()

    def expected_s(self, work: StepWork | int) -> float | None:
        """The time a ticket of this work is expected to take; None while nothing steady has been measured."""
        if self._rates is None:
            return None
        return float(np.dot(self._rates, _as_work(work).vector))

    def limit_ns(self, work: StepWork | int = NO_WORK) -> int:
        """How long a ticket of this work may run before its worker counts as hung."""
        expected = self.expected_s(work)
        if self._seen < self.warmup or expected is None:
            return int(max(self.floor_s, self.first_steps_s) * NS)
        return int((self.floor_s + self.margin * expected) * NS)

    def _refit(self) -> None:
        """Fit seconds = a·forwards + b·prefill_tokens + c·decode_positions with every rate >= 0; a kind of work
        seen in fewer than MIN_SAMPLES steps gets the slowest recent time per unit of work instead."""
        self._stale = 0
        samples = [*self._recent, *self._prefills]
        if not samples:
            self._rates = None
            return
        x = np.array([w.vector for w, _ in samples])
        y = np.array([t for _, t in samples])
        slowest = max(t / w.units for w, t in samples)
        known = [True, len(self._prefills) >= MIN_SAMPLES, int((x[:, 2] > 0).sum()) >= MIN_SAMPLES]
        rates = _nonnegative_fit(x, y, [j for j in range(3) if known[j]])
        for j in (1, 2):
            if not known[j]:
                rates[j] = slowest
        self._rates = rates


def _nonnegative_fit(x: np.ndarray, y: np.ndarray, columns: list[int]) -> np.ndarray:
    """Least squares of y on x's `columns` with no negative coefficient (a negative one leaves the fit and the
    rest is solved again); columns scaled to unit norm first, so a rarely seen kind of work is not drowned."""
    rates = np.zeros(x.shape[1])
    active = list(columns)
    while active:
        sub = x[:, active]
        norms = np.linalg.norm(sub, axis=0)
        norms[norms == 0] = 1.0
        coef = np.linalg.lstsq(sub / norms, y, rcond=None)[0] / norms
        if (coef >= 0).all():
            rates[active] = coef
            break
        active = [j for j, c in zip(active, coef) if c >= 0] if (coef >= 0).any() else []
    return rates


def _as_work(work: StepWork | int) -> StepWork:
    return work if isinstance(work, StepWork) else StepWork(decode_positions=max(1, int(work)))
