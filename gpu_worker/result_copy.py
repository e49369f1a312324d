"""A step's sampled tokens (and logprobs) copied back to the host behind an event, so the host need not wait.

`ResultCopier.start` queues the copies of a step's outputs into host buffers (pinned on CUDA, so the copy is
truly asynchronous) and records an event after them; the `PendingResult` it returns is `ready()` when the
event has fired and `result()` waits for it and builds the StepResult. Meanwhile the host may queue the next
step — fed from this one's tokens on the device — so the device never idles while a result crosses. On a CPU
the copies are done when queued and the event is the completed no-op (device_event.py): the same path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from metrale.gpu_worker.device_event import new_event
from metrale.gpu_worker.sampler import SamplerOutput
from metrale.ipc.plan import StepKind, StepResult


@dataclass(slots=True)
class PendingResult:
    """One step's outputs on their way to the host; its StepResult once the event fires."""

    num_rows: int  # R
    rows: np.ndarray  # int64 [S]: the plan rows that sampled
    tokens: torch.Tensor | None  # int64 [S] host (None: no row sampled)
    logprobs: torch.Tensor | None  # float32 [S] host
    top_ids: torch.Tensor | None  # int64 [S, N] host
    top_logprobs: torch.Tensor | None  # float32 [S, N] host
    event: object  # a torch.cuda.Event, or device_event.DONE
    start: float  # perf_counter when the step began
    prompt: tuple | None = None  # host (float32 [P], int64 [P, N] | None, float32 [P, N] | None): prompt logprobs
    pooled: torch.Tensor | None = None  # host float32 [Q, hidden]: the pooled rows' vectors (embeddings)

    def ready(self) -> bool:
        """Whether the copies have landed (result() will not wait)."""
        return self.event.query()

    def picks(self) -> np.ndarray:
        """int32 [R]: each row's pick (-1 where a row did not sample), waiting for the copies first."""
        self.event.synchronize()
        tokens = np.full(self.num_rows, -1, dtype=np.int32)
        if self.tokens is not None:
            tokens[self.rows] = self.tokens.numpy()
        return tokens

    def result(self) -> StepResult:
        """The StepResult row for row (tokens -1 where a row did not sample), waiting for the copies first."""
        result = StepResult(tokens=self.picks())
        if self.logprobs is not None:
            result.logprobs = np.full(self.num_rows, np.nan, dtype=np.float32)
            result.logprobs[self.rows] = self.logprobs.numpy()
        if self.top_ids is not None:
            n = self.top_ids.shape[1]
            result.top_ids = np.full((self.num_rows, n), -1, dtype=np.int32)
            result.top_ids[self.rows] = self.top_ids.numpy()
            result.top_logprobs = np.full((self.num_rows, n), np.nan, dtype=np.float32)
            result.top_logprobs[self.rows] = self.top_logprobs.numpy()
        if self.prompt is not None:
            lp, ids, top = self.prompt
            result.prompt_logprobs = lp.numpy()
            if ids is not None:
                result.prompt_top_ids = ids.numpy().astype(np.int32)
                result.prompt_top_logprobs = top.numpy()
        if self.pooled is not None:
            result.pooled = self.pooled.numpy()
        # The host's wall time from the step's start: on a device that queues, it includes the wait here.
        result.timings = {"execute_s": time.perf_counter() - self.start}
        return result


class ResultCopier:
    """Starts the copies of steps' outputs to the host, each behind its own event."""

    def __init__(self, device: torch.device):
        """Host buffers pinned on CUDA (page-locked memory is what an asynchronous copy needs)."""
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"

    def start(self, num_rows: int, rows: np.ndarray, out: SamplerOutput | None, start: float,
              prompt: tuple | None = None, pooled: torch.Tensor | None = None) -> PendingResult:
        """Queue the copies of out (None: no row sampled), of the prompt logprobs (device tensors: logprobs [P],
        top ids and logprobs [P, N] or None; None: none asked) and of the pooled vectors (float32 [Q, hidden];
        None: no row pooled), and mark their end with an event."""
        event = new_event(self.device)
        host_prompt = None if prompt is None else tuple(self._copy(t) for t in prompt)
        host_pooled = self._copy(pooled)
        if out is None:
            event.record()
            return PendingResult(num_rows, rows, None, None, None, None, event, start, host_prompt, host_pooled)
        pending = PendingResult(
            num_rows, rows, self._copy(out.tokens), self._copy(out.logprobs, torch.float32), self._copy(out.top_ids),
            self._copy(out.top_logprobs, torch.float32), event, start, host_prompt, host_pooled,
        )
        event.record()
        return pending

    def start_verify(self, num_rows: int, of_row: np.ndarray, within: np.ndarray, out: SamplerOutput,
                     accepted: torch.Tensor, start: float) -> list[PickIndex]:
        """Queue the copies of a verify step's picks (out: one per position, pick within[i] of row of_row[i]) and of
        each row's accepted count, behind one event; one pending result per pick index, as a burst's steps."""
        event = new_event(self.device)
        flat = PendingResult(
            len(of_row), np.arange(len(of_row)), self._copy(out.tokens), self._copy(out.logprobs, torch.float32),
            self._copy(out.top_ids), self._copy(out.top_logprobs, torch.float32), event, start,
        )
        picks = VerifyPicks(flat, self._copy(accepted), num_rows, of_row, within)
        event.record()
        return [PickIndex(picks, j) for j in range(int(within.max(initial=0)) + 1)]

    def _copy(self, t: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """A host tensor the device tensor t is being copied into (converted to dtype first, on the device)."""
        if t is None:
            return None
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        # A fresh buffer per step: the pinned ones come from torch's caching host allocator, which reuses a
        # block only once the copies recorded on it are done; the kept tokens may be overwritten by the next step.
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pinned)
        return host.copy_(t, non_blocking=self.pinned)


@dataclass(slots=True)
class VerifyPicks:
    """A verify step's picks on their way to the host: each row keeps its first accepted[r] picks (the device's
    acceptance); results() splits them by pick index, as a burst's steps."""

    flat: PendingResult  # one "row" per pick
    accepted: torch.Tensor  # int64 [R] host: each row's kept picks
    num_rows: int  # R
    of_row: np.ndarray  # int64 [P]: each pick's row
    within: np.ndarray  # int64 [P]: its index in its row
    _results: list[StepResult] | None = None

    def ready(self) -> bool:
        """Whether the copies have landed."""
        return self.flat.ready()

    def results(self) -> list[StepResult]:
        """One StepResult per pick index (tokens -1, logprobs NaN where a row kept fewer), made once."""
        if self._results is None:
            flat = self.flat.result()
            keep = self.within < self.accepted.numpy()[self.of_row]
            j, row = self.within[keep], self.of_row[keep]
            steps, r = int(self.within.max(initial=0)) + 1, self.num_rows
            tokens = np.full((steps, r), -1, dtype=np.int32)
            tokens[j, row] = flat.tokens[keep]
            results = [StepResult(tokens=tokens[k], timings=flat.timings) for k in range(steps)]
            if flat.logprobs is not None:
                lp = np.full((steps, r), np.nan, dtype=np.float32)
                lp[j, row] = flat.logprobs[keep]
                for k, result in enumerate(results):
                    result.logprobs = lp[k]
            if flat.top_ids is not None:
                n = flat.top_ids.shape[1]
                ids = np.full((steps, r, n), -1, dtype=np.int32)
                ids[j, row] = flat.top_ids[keep]
                top = np.full((steps, r, n), np.nan, dtype=np.float32)
                top[j, row] = flat.top_logprobs[keep]
                for k, result in enumerate(results):
                    result.top_ids, result.top_logprobs = ids[k], top[k]
            self._results = results
        return self._results


@dataclass(slots=True)
class PickIndex:
    """Pick index j of a verify step: a burst step's pending result."""

    picks: VerifyPicks
    j: int

    def ready(self) -> bool:
        return self.picks.ready()

    def result(self) -> StepResult:
        return self.picks.results()[self.j]


@dataclass(slots=True)
class Ready:
    """A result already on the host: a step a runner ran to completion."""

    value: StepResult

    def ready(self) -> bool:
        """Always."""
        return True

    def result(self) -> StepResult:
        """The result."""
        return self.value


def launch_ticket(runner, plan, kind: StepKind, steps: int) -> list:
    """Queue one ticket's plan on the runner as its kind says: a BURST's decode steps, a VERIFY's picks (one pending
    result per pick index; nothing is fed from it: the host commits its picks), or one STEP; their pending results
    in order."""
    if kind == StepKind.VERIFY:
        return runner.launch_verify(plan)
    return runner.launch_burst(plan, steps) if kind == StepKind.BURST else [runner.launch(plan)]


def run_ticket(runner, plan, kind: StepKind, steps: int) -> list[StepResult]:
    """One ticket's plan run to its results (launch_ticket, then wait for every copy)."""
    return [pending.result() for pending in launch_ticket(runner, plan, kind, steps)]
