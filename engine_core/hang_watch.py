"""HangWatch: when a worker that is alive but makes no progress counts as hung.

A worker can be alive and still never answer: stopped (SIGSTOP), deadlocked, or in a kernel that never
returns. Liveness checks cannot see that; progress can. The worker runs tickets in order, so the oldest
ticket in flight is the one it works on, and it started no earlier than the later of its launch and the
previous result.

A ticket may run `floor_s` (--worker-hang-timeout) plus `margin` times its EXPECTED time. The expected time
comes from the work the ticket carries (StepWork: forward passes, prefill tokens, decode positions) through a
linear fit of the steps this server ran, t = a·forwards + b·prefill_tokens + c·decode_positions, so a
4,096-token prefill after a run of decode steps is priced at prefill speed, not at the per-token time of a
one-row decode. Until the fit has seen enough prefill (or decode) steps to price that kind of work, a guess
stands in for its rate: for prefill, the slowest time per token of the prefill steps seen (a one-row decode's
time per token is its whole step overhead, which would price a long prompt at minutes), else the slowest recent
time per unit of any work; cautious, never the old 20-fold of it. A step of a kind still guessed refits at once
rather than `refit_every` records later. A worker's first `warmup` steps (compilation, warm-up) are not
recorded and get `first_steps_s`.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        rows, tokens = len(plan.seq_lens), int(plan.query_start[-1])
        if tokens == rows:  # one token a row: all decodes (the common step, priced without numpy)
            return cls(forwards=steps, decode_positions=rows * steps) if kind == StepKind.BURST \
                else cls(decode_positions=rows)
        per_row = np.diff(plan.query_start)
        chunk = per_row > 1 + plan.num_drafts
        prefill = int(per_row[chunk].sum())
        decode = int(per_row.sum()) - prefill
        if kind == StepKind.BURST:
            return cls(forwards=steps, prefill_tokens=0, decode_positions=(decode + prefill) * steps)
        return cls(forwards=1, prefill_tokens=prefill, decode_positions=decode)


NO_WORK = StepWork()  # a ticket that runs no forward (a resample, a LoRA load): one forward's overhead


@dataclass(slots=True)
class HangWatch:
    """Step deadlines from each step's expected time, fitted to the steps this server ran."""

    floor_s: float = DEFAULTS.worker_hang_timeout_s  # a step may always take this long (--worker-hang-timeout)
    margin: float = 2.0  # ... plus this many times its expected time
    first_steps_s: float = 300.0  # the allowance of a worker's first `warmup` steps
    warmup: int = 2
    history: int = 64  # recent steps the fit reads (and the slowest rate's window)
    prefill_history: int = 32  # recent steps with prefill work, kept apart so decode runs do not push them out
    refit_every: int = 32  # records between fits (a fit is a few small least-squares solves)
    _recent: _Samples | None = None  # the last `history` steps without prefill tokens
    _prefills: _Samples | None = None  # the last `prefill_history` steps with prefill tokens
    _seen: int = 0  # steps completed by the current worker
    _stale: int = 0  # records since the last fit
    _rates: tuple[float, float, float] | None = None  # seconds per forward, prefill token, decode position
    _guessed: tuple[bool, bool] = (True, True)  # the prefill, the decode rate is a guess (too few steps of it)

    def __post_init__(self) -> None:
        self._recent, self._prefills = _Samples(self.history), _Samples(self.prefill_history)

    def reset(self) -> None:
        """A new worker: its first steps get the warm-up allowance again. The fit stays: same model, same device."""
        self._seen = 0

    def record(self, elapsed_ns: int, work: StepWork) -> None:
        """A ticket of this work took elapsed_ns. A ticket without tokens (a resample, a LoRA load) is no step:
        it neither counts toward warm-up nor feeds the fit."""
        if not (work.prefill_tokens or work.decode_positions):
            return
        self._seen += 1
        if self._seen <= self.warmup:
            return  # warm-up steps say nothing about the model's steady step time
        (self._prefills if work.prefill_tokens else self._recent).add(work, elapsed_ns / NS)
        self._stale += 1
        if self._rates is None or self._stale >= self.refit_every or self._guessed[0 if work.prefill_tokens else 1]:
            self._refit()

    def expected_s(self, work: StepWork) -> float | None:
        """The time a ticket of this work is expected to take; None while nothing steady has been measured."""
        if self._rates is None:
            return None
        a, b, c = self._rates
        return a * work.forwards + b * work.prefill_tokens + c * work.decode_positions

    def limit_ns(self, work: StepWork = NO_WORK) -> int:
        """How long a ticket of this work may run before its worker counts as hung."""
        expected = self.expected_s(work)
        if self._seen < self.warmup or expected is None:
            return int(max(self.floor_s, self.first_steps_s) * NS)
        return int((self.floor_s + self.margin * expected) * NS)

    def _refit(self) -> None:
        """Fit seconds = a·forwards + b·prefill_tokens + c·decode_positions with every rate >= 0; a kind of work
        seen in fewer than MIN_SAMPLES steps gets the slowest recent time per token instead."""
        self._stale = 0
        samples = np.concatenate((self._recent.rows(), self._prefills.rows()))
        if not len(samples):
            self._rates = None
            return
        x, y = samples[:, :3], samples[:, 3]
        per_token = y / np.maximum(1.0, x[:, 1] + x[:, 2])  # seconds per token of each step
        slowest = float(per_token.max())
        prefills = len(self._prefills.rows())  # the prefill steps come last in samples
        slowest_prefill = float(per_token[-prefills:].max()) if prefills else slowest
        known = [True, prefills >= MIN_SAMPLES, int(np.count_nonzero(x[:, 2])) >= MIN_SAMPLES]
        rates = _nonnegative_fit(x.T @ x, x.T @ y, [j for j in range(3) if known[j]])
        self._rates = (rates[0], rates[1] if known[1] else slowest_prefill, rates[2] if known[2] else slowest)
        self._guessed = (not known[1], not known[2])


class _Samples:
    """The last n steps' (forwards, prefill tokens, decode positions, seconds), in a preallocated ring."""

    def __init__(self, n: int) -> None:
        self._rows = np.zeros((n, 4))
        self._count = 0

    def add(self, work: StepWork, seconds: float) -> None:
        self._rows[self._count % len(self._rows)] = (work.forwards, work.prefill_tokens, work.decode_positions, seconds)
        self._count += 1

    def rows(self) -> np.ndarray:
        return self._rows[: min(self._count, len(self._rows))]


def _nonnegative_fit(gram: np.ndarray, xty: np.ndarray, columns: list[int]) -> list[float]:
    """Least squares from the normal equations (gram = XᵀX, xty = Xᵀy) over `columns`, with no negative
    coefficient (a negative one leaves the fit and the rest is solved again). Columns are scaled to unit norm, so a
    rarely seen kind of work is not drowned, and a whisker of ridge keeps collinear ones (every decode step of
    the same batch) solvable: they then share the time, which predicts the steps seen."""
    rates = [0.0, 0.0, 0.0]
    active = list(columns)
    while active:
        g = gram[np.ix_(active, active)]
        norms = np.sqrt(np.diag(g))
        norms[norms == 0] = 1.0
        scaled = g / np.outer(norms, norms) + 1e-9 * np.eye(len(active))
        coef = (np.linalg.solve(scaled, xty[active] / norms) / norms).tolist()
        if min(coef) >= 0:
            for j, c in zip(active, coef):
                rates[j] = c
            break
        active = [j for j, c in zip(active, coef) if c >= 0]
    return rates

