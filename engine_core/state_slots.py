"""The recurrent state slots: which running sequence holds which of the device's state slots.

A model with recurrent layers (ModelInfo.num_state_slots > 0) keeps each sequence's conv and SSM state in a
preallocated slot on the device. The scheduler takes a slot (Sequence.state_slot) when a sequence starts running
and gives it back when it leaves the running batch (retired, preempted, requeued); the step builder writes each
row's slot into the plan. The device resets a slot whenever a row starts at position 0, so a slot given back needs no
clearing, and a preempted sequence simply recomputes from position 0 in whatever slot it gets next. A slot is
given back only once no step in flight holds its sequence (retirement waits for them), so the device never runs
two sequences in one slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field



class StateSlotsExhausted(RuntimeError):
    """More sequences running than the device has state slots: the scheduler's cap was not applied."""


@dataclass(slots=True)
class StateSlots:
    """A pool of num_slots state slots (0: the model keeps no recurrent state, and nothing is tracked)."""

    num_slots: int = 0
    _free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._free = list(range(self.num_slots - 1, -1, -1))

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A free slot for a sequence that starts running (-1 without recurrent state)."""
        if not self.num_slots:
            return -1
        if not self._free:
            raise StateSlotsExhausted(f"all {self.num_slots} state slots are held by running sequences")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        """A slot a sequence held as it leaves the running batch (-1: none)."""
        if slot >= 0:
            self._free.append(slot)
