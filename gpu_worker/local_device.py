"""LocalDevice: the model runner in-process, behind the Device protocol (offline use and tests).

Steps run in launch order on one background thread; torch releases the GIL while it computes, so
the engine core can commit step t on the calling thread while step t+1 runs — the same overlap the
worker process gives, without the process. As the worker does, the thread launches step t+1 as soon as it is
queued, before t's tokens have reached the host (ModelRunner.launch: on CUDA the copy runs behind an event),
and publishes t when they have. threaded=False runs each step inside launch().
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from metrale.gpu_worker.errors import PlanError
from metrale.gpu_worker.model_runner import ModelRunner
from metrale.gpu_worker.result_copy import launch_ticket
from metrale.ipc.plan import DeviceError, ModelInfo, StepKind, StepPlan, StepResult, Ticket, check_ticket

_WAIT_SLICE_S = 0.1  # await_result wakes this often to notice a dead or closed device
_AHEAD_POLL_S = 0.0002  # with a step in flight, the thread looks for the next one this often (the GIL released)
_STOP = None  # the queue item that ends the thread


@dataclass(slots=True)
class _Launched:
    """A step the thread has queued on the device: its pending results, or the error its launch raised."""

    seq: int
    pending: list | None
    burst: bool
    error: BaseException | None = None

    def ready(self) -> bool:
        """Whether its outcome can be published without waiting."""
        return self.pending is None or all(p.ready() for p in self.pending)


@dataclass(slots=True)
class _Outcome:
    """A finished step: its result, or the exception it raised."""

    result: StepResult | list[StepResult] | None = None  # a list for a burst
    error: BaseException | None = None


class LocalDevice:
    """A Device whose steps run on a ModelRunner in this process."""

    burst_limit = 1 << 16  # no ring to size: a burst's steps are bounded by the engine alone

    def __init__(self, runner: ModelRunner, threaded: bool = True):
        """Wrap runner; with threaded, start the one thread that executes launched steps in order."""
        self.runner = runner
        self.threaded = threaded
        self._next_seq = 0
        self._runner_step: dict[int, int] = {}  # ticket seq -> runner step index (for resample)
        self._outcomes: dict[int, _Outcome] = {}  # finished steps not yet awaited
        self._finished = 0  # steps finish in launch order: seqs below this have finished
        self._done = threading.Condition()
        self._closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._serve, name="metrale-local-device", daemon=True)
            self._thread.start()

    def launch(self, plan: StepPlan, kind: StepKind = StepKind.STEP, steps: int = 1) -> Ticket:
        """Queue the ticket (or, unthreaded, run it now) and return it; a BURST (ModelRunner.execute_burst) and a
        VERIFY are awaited with await_burst."""
        if self._closed:
            raise DeviceError("the device is closed")
        check_ticket(kind, steps, self.burst_limit)
        seq = self._next_seq
        self._next_seq += 1
        if self.threaded:
            self._queue.put((seq, plan, kind, steps))
        else:
            self._run(seq, plan, kind, steps)
        return Ticket(slot=0, seq=seq)

    def await_result(self, ticket: Ticket) -> StepResult:
        """Wait for the ticket's step; DeviceError if it failed, or the device closed or died first."""
        return self._await(ticket)

    def await_burst(self, ticket: Ticket) -> list[StepResult]:
        """Wait for a ticket launched with steps > 1: one result per step."""
        return self._await(ticket)

    def _await(self, ticket: Ticket):
        """The ticket's outcome (a result, or a burst's list of them); DeviceError as await_result."""
        with self._done:
            while ticket.seq not in self._outcomes:
                if ticket.seq >= self._next_seq:
                    raise DeviceError(f"step {ticket.seq} was never launched")
                if ticket.seq < self._finished:
                    raise DeviceError(f"step {ticket.seq} was already awaited")
                if self._closed:
                    raise DeviceError("the device was closed before the step finished")
                if self._thread is not None and not self._thread.is_alive():
                    raise DeviceError("the device thread is gone")
                self._done.wait(_WAIT_SLICE_S)
            outcome = self._outcomes.pop(ticket.seq)
        if outcome.error is not None:
            raise DeviceError(f"step {ticket.seq} failed: {outcome.error!r}") from outcome.error
        return outcome.result

    def resample(self, ticket: Ticket, plan: StepPlan) -> StepResult:
        """The ticket's (settled) step picked again by the runner's sampler from the logits it kept, under plan's
        sampling arrays (Device.resample), once every launched step has run; DeviceError when they are gone."""
        step = self._runner_step.get(ticket.seq)
        if step is None:
            raise DeviceError(f"step {ticket.seq} has no logits (not run, or failed)")
        self._quiet()
        try:
            return self.runner.resample(step, plan).result()
        except (KeyError, PlanError) as exc:
            raise DeviceError(str(exc)) from exc

    def _quiet(self) -> None:
        """Wait until every launched step has run: the runner is then this thread's to call."""
        with self._done:
            while self._finished < self._next_seq and not self._closed:
                self._done.wait(_WAIT_SLICE_S)

    def load_lora(self, slot: int, path: str) -> None:
        """Load (or, path "", empty) a LoRA slot of the runner once every launched step has run; DeviceError naming
        what is wrong."""
        self._quiet()
        try:
            self.runner.load_lora(slot, path)
        except ValueError as exc:
            raise DeviceError(str(exc)) from None

    def model(self) -> ModelInfo:
        """The runner's model facts."""
        return self.runner.info

    def close(self) -> None:
        """Stop the thread after the step it is running; queued steps are abandoned."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            # Drop what is queued so the thread reaches the stop item without running it.
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._queue.put(_STOP)
            self._thread.join()
        with self._done:
            self._done.notify_all()

    def __enter__(self) -> LocalDevice:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve(self) -> None:
        """The device thread: launch queued steps in order until the stop item; with one in flight, launch the
        next as soon as it comes, then publish the one in flight."""
        inflight: _Launched | None = None
        while True:
            if inflight is None:
                item = self._queue.get()
            else:
                try:
                    item = self._queue.get(timeout=_AHEAD_POLL_S)
                except queue.Empty:
                    if inflight.ready():
                        self._finish(inflight)
                        inflight = None
                    continue
            if item is _STOP:
                if inflight is not None:
                    self._finish(inflight)
                return
            launched = self._start(*item)
            if inflight is not None:
                self._finish(inflight)
            inflight = launched
            if inflight.ready():
                self._finish(inflight)
                inflight = None

    def _run(self, seq: int, plan: StepPlan, kind: StepKind, steps: int) -> None:
        """Execute one ticket and publish its outcome."""
        self._finish(self._start(seq, plan, kind, steps))

    def _start(self, seq: int, plan: StepPlan, kind: StepKind, steps: int) -> _Launched:
        """Queue one ticket's steps on the runner."""
        burst = kind != StepKind.STEP  # a BURST's steps, a VERIFY's picks: awaited with await_burst
        try:
            pending = launch_ticket(self.runner, plan, kind, steps)
            self._runner_step[seq] = self.runner.steps_executed - 1
            self._runner_step.pop(seq - 4, None)  # the runner keeps only the last few steps' logits
            return _Launched(seq, pending, burst)
        except Exception as exc:  # a failed step is reported to its awaiter, never kills the thread
            return _Launched(seq, None, burst, exc)

    def _finish(self, launched: _Launched) -> None:
        """Wait for a launched step's results (their copies) and publish its outcome."""
        outcome = _Outcome(error=launched.error)
        if launched.pending is not None:
            try:
                results = [p.result() for p in launched.pending]
                outcome.result = results if launched.burst else results[0]
            except Exception as exc:  # noqa: BLE001 - as a failed launch
                outcome.error = exc
        with self._done:
            self._outcomes[launched.seq] = outcome
            self._finished = launched.seq + 1
            self._done.notify_all()
