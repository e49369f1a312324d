"""What a step needs from its surroundings: the device, the block pool, the plan builder."""

from __future__ import annotations

from dataclasses import dataclass

from metrale.ipc.plan import Device

from .kv_blocks import KvBlockPool
from .pipeline import SpecialTokens
from .step_builder import StepBuilder


@dataclass(slots=True)
class StepIo:
    """The scheduler's view of the outside world for one engine (the seed's `sched.io`). The lane calls the pool
    (`allocate` to reserve KV, `trim` to give an over-run's back) and the device (`resample`) directly."""

    device: Device
    pool: KvBlockPool
    builder: StepBuilder
    toks: SpecialTokens
    eos_ids: tuple[int, ...]
    max_model_len: int
    last_error: str | None = None  # the last device error, for health reports
    recover: bool = False  # a lost device requeues its rows (True) or fails them (False, the seed's way)
    device_lost: str | None = None  # set when the device died under recover; the engine requeues
    repicks: int = 0  # rows the device picked again (RepickOnly repairs: decode_lane._repick)
