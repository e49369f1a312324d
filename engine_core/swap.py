"""Swap space: host blocks that hold a preempted sequence's KV, and the copies the next step must make.

Copies travel with the next plan built (StepBuilder takes them): first every swap-out (device → host),
then every swap-in (host → device), then the forward. So a device block freed by a swap-out may be
reused in the same step, and a host block is free again only once the plan carrying its swap-in is built. A
plan whose launch fails gives its copies back (put_back), so they ride the next plan instead of being lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class SwapSpace:
    """The host blocks (a fixed number, from the worker's swap space) and the queued copies."""

    num_blocks: int
    _free: list[int] = field(init=False)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    _release: list[int] = field(default_factory=list)  # host blocks freed once their swap-in is sent
    blocks_out: int = 0  # counters for stats and tests
    blocks_in: int = 0

    def __post_init__(self) -> None:
        self._free = list(range(self.num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """n host blocks, or None (nothing taken) when the space is too small."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def queue_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        self.swap_out.extend(zip(device_blocks, host_blocks))
        self.blocks_out += len(host_blocks)

    def queue_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        self.swap_in.extend(zip(host_blocks, device_blocks))
        self._release.extend(host_blocks)
        self.blocks_in += len(host_blocks)

    def queue_copy(self, source: int, target: int) -> None:
        """Copy device block source to device block target before the next plan's forward (a forked beam's partial
        block): a swap_in pair whose host block is -1 - source (ipc/plan.py)."""
        self.swap_in.append((-1 - source, target))

    def give_back(self, host_blocks: list[int]) -> None:
        """Host blocks no copy needs any more (a swapped request aborted)."""
        self._free.extend(host_blocks)

    def take_copies(self) -> tuple[np.ndarray, np.ndarray]:
        """The queued copies as int32 [S, 2] arrays for a plan; the swapped-in host blocks become free."""
        out = np.array(self.swap_out, dtype=np.int32).reshape(-1, 2)
        into = np.array(self.swap_in, dtype=np.int32).reshape(-1, 2)
        self.swap_out.clear()
        self.swap_in.clear()
        self._free.extend(self._release)
        self._release.clear()
        return out, into

    def put_back(self, swap_out: np.ndarray, swap_in: np.ndarray) -> None:
        """Copies taken for a plan that was never launched: queued again ahead of any queued since, and the
        swapped-in host blocks held again until a launched plan carries them (pass no swap_in for rows that
        will never run: their host blocks stay free)."""
        self.swap_out[:0] = [(int(d), int(h)) for d, h in swap_out]
        again = [(int(h), int(d)) for h, d in swap_in]
        self.swap_in[:0] = again
        held = {h for h, _ in again if h >= 0}  # a negative one is a device copy (queue_copy)
        self._free = [b for b in self._free if b not in held]
        self._release[:0] = [h for h, _ in again if h >= 0]

    def forget(self) -> None:
        """The worker (and its host copies) are gone: every host block is free, no copy is pending."""
        self.swap_out.clear()
        self.swap_in.clear()
        self._release.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))
