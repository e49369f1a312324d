"""A stand-in model runner for the worker tests: no torch, instant steps, faults on request.

The worker subprocess imports it by name ("fake_runner:FakeRunner"), so tests put this folder on
its PYTHONPATH. Faults are chosen by the plan itself: a first input id of FAIL_TOKEN makes execute()
raise, HANG_TOKEN makes it block until the process is killed.
"""

from __future__ import annotations

import threading

import numpy as np

from metrale.gpu_worker.result_copy import Ready
from metrale.ipc.plan import ModelInfo, StepPlan, StepResult

FAIL_TOKEN = -7
HANG_TOKEN = -8
FACTORY = "fake_runner:FakeRunner"
AHEAD_FACTORY = "fake_runner:AheadRunner"
HOLD_TOKEN = -9  # an AheadRunner step whose first input id is this lands only once a later step is launched
BROKEN_FACTORY = "fake_runner:broken_runner"


LOGITS_KEPT = 2  # as the model runner: the settled step and the one launched ahead


def fake_logits(ordinal: int, last_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """The logits FakeRunner keeps for a step: row r is the step's ordinal everywhere, 1000 at its last input id."""
    out = np.full((len(last_ids), vocab_size), float(ordinal), dtype=np.float32)
    out[np.arange(len(last_ids)), np.asarray(last_ids) % vocab_size] = 1000.0
    return out


class FakeRunner:
    """Echoes each sampling row's last input id; logprobs[r] is the step's ordinal (1, 2, ...); keeps the last
    steps' logits (fake_logits) and picks again from them (resample)."""

    def __init__(self, vocab_size: int = 1000, name: str = "fake") -> None:
        self.info = ModelInfo(
            name=name,
            vocab_size=vocab_size,
            max_model_len=4096,
            eos_token_ids=(2,),
            num_kv_blocks=64,
            block_size=16,
            dtype="float32",
        )
        self.steps = 0
        self._logits: dict[int, np.ndarray] = {}

    @property
    def steps_executed(self) -> int:
        return self.steps

    def execute(self, plan: StepPlan) -> StepResult:
        """The echo result of one step, or the fault the plan asks for."""
        self.steps += 1
        first = int(plan.input_ids[0]) if plan.num_tokens else 0
        if first == FAIL_TOKEN:
            raise RuntimeError(f"injected failure at step {self.steps}")
        if first == HANG_TOKEN:
            threading.Event().wait()  # until the test kills us
        last = plan.query_start[1:] - 1
        tokens = np.where(plan.sample, plan.input_ids[last], -1).astype(np.int32)
        self._logits[self.steps - 1] = fake_logits(self.steps, plan.input_ids[last], self.info.vocab_size)
        self._logits.pop(self.steps - 1 - LOGITS_KEPT, None)
        return StepResult(tokens=tokens, logprobs=np.full(plan.num_rows, self.steps, dtype=np.float32))

    def resample(self, step: int, plan: StepPlan) -> Ready:
        """Step `step` (counted from 0) picked again from its kept logits: each sampling row's argmax once the plan's
        banned ids are out; logprobs[r] is that step's ordinal. KeyError once its logits are no longer kept."""
        logits = self._logits[step].copy()
        for r, ban in enumerate(plan.ban_ids):
            logits[r, ban[ban >= 0]] = -np.inf
        tokens = np.where(plan.sample, logits.argmax(axis=1), -1).astype(np.int32)
        return Ready(StepResult(tokens=tokens, logprobs=np.full(plan.num_rows, step + 1, dtype=np.float32)))

    def launch(self, plan: StepPlan) -> Ready:
        return Ready(self.execute(plan))

    def launch_burst(self, plan: StepPlan, steps: int) -> list:
        return [self.launch(plan) for _ in range(steps)]


class _Held:
    """A step's pending result; a held one (HOLD_TOKEN) lands only once a later step is launched, as on a device
    running behind the host. Its logprobs say how many steps had been launched when the worker wrote it."""

    def __init__(self, runner: AheadRunner, result: StepResult, hold: bool) -> None:
        self.runner, self.value, self.launched, self.hold = runner, result, runner.steps, hold

    def ready(self) -> bool:
        return not self.hold or self.runner.steps > self.launched

    def result(self) -> StepResult:
        self.value.logprobs = np.full(len(self.value.tokens), self.runner.steps, dtype=np.float32)
        return self.value


class AheadRunner(FakeRunner):
    """A FakeRunner that launches: each step's result is held (_Held) until a later step is launched."""

    def launch(self, plan: StepPlan) -> _Held:
        hold = plan.num_tokens > 0 and int(plan.input_ids[0]) == HOLD_TOKEN
        return _Held(self, self.execute(plan), hold)


def broken_runner(**kwargs) -> FakeRunner:
    """A factory that fails the way a model that cannot load does."""
    raise RuntimeError("cannot load the model: weights missing")
