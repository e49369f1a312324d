"""What a step needs from its surroundings: the device, the block pool, the plan builder.

Effects on KV and logits are values passed to one `apply` (as in the seed), so tests can fake and count them
(tests/engine_harness.py counts them by wrapping StepIo.apply; the engine keeps no counters of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from metrale.ipc.plan import Device, Ticket

from .kv_blocks import KvBlockPool
from .pipeline import SpecialTokens
from .sequence import Sequence
from .step_builder import StepBuilder


@dataclass(frozen=True, slots=True)
class ReserveKv:
    """Make room for seq's next `tokens` KV positions (from num_computed), maybe new blocks."""

    seq: Sequence
    tokens: int = 1


@dataclass(frozen=True, slots=True)
class Rollback:
    """Give back an over-run's reservation: the blocks beyond seq's num_computed tokens."""

    seq: Sequence


@dataclass(frozen=True, slots=True)
class ReadLogits:
    """Bring a settled step's logits to the host for host sampling."""

    ticket: Ticket


Effect = ReserveKv | Rollback | ReadLogits


@dataclass(slots=True)
class StepIo:
    """The scheduler's view of the outside world for one engine (the seed's `sched.io`)."""

    device: Device
    pool: KvBlockPool
    builder: StepBuilder
    toks: SpecialTokens
    eos_ids: tuple[int, ...]
    max_model_len: int
    last_error: str | None = None  # the last device error, for health reports
    recover: bool = False  # a lost device requeues its rows (True) or fails them (False, the seed's way)
    device_lost: str | None = None  # set when the device died under recover; the engine requeues
    host_repicks: int = 0  # rows whose token the host picked again (RepickOnly repairs: host_sampler.repick)

    def apply(self, effect: Effect) -> bool | np.ndarray:
        """Carry out one effect. ReserveKv answers False when the pool is dry."""
        if isinstance(effect, ReserveKv):
            return self.pool.allocate(effect.seq, effect.seq.num_computed + effect.tokens)
        if isinstance(effect, Rollback):
            self.pool.trim(effect.seq, effect.seq.num_computed)
            return True
        return self.device.read_logits(effect.ticket)
