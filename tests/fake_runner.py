"""A stand-in model runner for the worker tests: no torch, instant steps, faults on request.

The worker subprocess imports it by name ("fake_runner:FakeRunner"), so tests put this folder on
its PYTHONPATH. Faults are chosen by the plan itself: a first input id of FAIL_TOKEN makes execute()
raise, HANG_TOKEN makes it block until the process is killed.
"""

from __future__ import annotations

import threading

import numpy as np

from metrale.ipc.plan import ModelInfo, StepPlan, StepResult

FAIL_TOKEN = -7
HANG_TOKEN = -8
FACTORY = "fake_runner:FakeRunner"
BROKEN_FACTORY = "fake_runner:broken_runner"


LOGITS_KEPT = 2  # as the model runner: the settled step and the one launched ahead


def fake_logits(ordinal: int, last_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """The logits FakeRunner keeps for a step: row r is the step's ordinal everywhere, 1000 at its last input id."""
    out = np.full((len(last_ids), vocab_size), float(ordinal), dtype=np.float32)
    out[np.arange(len(last_ids)), np.asarray(last_ids) % vocab_size] = 1000.0
    return out


class FakeRunner:
    """Echoes each sampling row's last input id; logprobs[r] is the step's ordinal (1, 2, ...); keeps the last
    steps' logits (fake_logits)."""

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

    def read_logits(self, step: int) -> np.ndarray:
        """The logits of step (counted from 0); KeyError once they are no longer kept."""
        return self._logits[step]


def broken_runner(**kwargs) -> FakeRunner:
    """A factory that fails the way a model that cannot load does."""
    raise RuntimeError("cannot load the model: weights missing")
