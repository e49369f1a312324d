"""A point in the device's stream the host can ask about or wait for: a CUDA event, or one already done.

On CUDA the step's work is queued and the host goes on; an event recorded after a copy says when that copy
has landed. Elsewhere (a CPU) every op has finished when it returns, so the event is a completed no-op and the
same code path runs, and is tested, on a CPU.
"""

from __future__ import annotations

import torch


class DoneEvent:
    """An event that has always fired: what a device that computes inline records."""

    __slots__ = ()

    def record(self) -> None:
        """Nothing to mark: the work before it is done."""

    def query(self) -> bool:
        """Always True."""
        return True

    def synchronize(self) -> None:
        """Returns at once."""


DONE = DoneEvent()


def new_event(device: torch.device):
    """An event for the device's current stream: a CUDA event on CUDA (no timing), else DONE."""
    if device.type == "cuda":
        return torch.cuda.Event(enable_timing=False)
    return DONE
