"""Plans for the ranks on other hosts: rank 0 broadcasts each plan it reads from the ring over the process group.

The ticket ring is shared memory on the engine core's host; a rank on another host has only TCP to it. So
rank 0 sends it every plan through torch.distributed (a gloo group of rank 0 and the off-host ranks): first a
fixed header (what follows, the StepKind and steps, the plan's counts), then the plan's arrays packed end to end in
PLAN_FIELDS order (ipc/ticket_layout.py, the ring's own field list: grammar bitmasks, drafts and state slots
too, so an off-host rank samples under the same masks as rank 0). While rank 0 waits for plans it sends an
idle header every KEEPALIVE_S, so a receiver's wait never runs into torch.distributed's timeout; a stop header
ends the receivers when rank 0 exits cleanly (and a rank 0 that dies takes them down through gloo's error).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from metrale.ipc.plan import StepKind, StepPlan
from metrale.ipc.ticket_layout import PLAN_FIELDS, region_lengths
from metrale.ipc.worker_group import KEEPALIVE_S  # noqa: F401 - how often rank 0 sends IDLE (worker.py)

from .errors import GroupLost

PLAN, IDLE, STOP = 1, 2, 3
_HEADER = 16  # int64s: message kind, StepKind, steps, the plan's twelve counts (ticket_layout.plan_counts), payload bytes
_ALIGN = 8
PLAN_COUNTS = ("T", "R", "B", "K", "H", "SO", "SI", "G", "W", "S", "BI", "PI")  # what counts_of gives, in order


def _layout(counts: tuple[int, ...]) -> tuple[list[tuple[int, int]], int]:
    """(byte offset, element count) of each plan field for these counts, and the payload's size."""
    lengths = region_lengths(*counts)
    at, out = 0, []
    for _, dtype, kind in PLAN_FIELDS:
        n = lengths[kind]
        out.append((at, n))
        at += -(-n * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
    return out, at


def counts_of(plan: StepPlan) -> tuple[int, ...]:
    """The plan's twelve counts (T, R, B, K, H, SO, SI, G, W, S, BI, PI), as the ring's control block holds them."""
    g, w = plan.grammar_bitmask.shape
    return (plan.num_tokens, plan.num_rows, plan.block_tables.shape[1], plan.ban_ids.shape[1], len(plan.hist_tokens),
            len(plan.swap_out), len(plan.swap_in), g, w, len(plan.state_slots), len(plan.bias_ids),
            len(plan.pinned_ids))


def pack(plan: StepPlan, counts: tuple[int, ...], raw: np.ndarray) -> None:
    """Write the plan's arrays end to end into raw (uint8, at least _layout(counts)'s size)."""
    layout, _ = _layout(counts)
    for (name, dtype, _), (at, n) in zip(PLAN_FIELDS, layout):
        raw[at : at + n * np.dtype(dtype).itemsize].view(dtype)[:] = getattr(plan, name).reshape(-1)


def unpack(counts: tuple[int, ...], raw: np.ndarray) -> StepPlan:
    """The plan pack wrote into raw, as views of it."""
    layout, _ = _layout(counts)
    t, r, b, k, h, so, si, g, w, s, _, _ = counts
    shapes = {"block_tables": (r, b), "ban_ids": (r, k), "swap_out": (so, 2), "swap_in": (si, 2), "grammar_bitmask": (g, w)}
    arrays = []
    for (name, dtype, _), (at, n) in zip(PLAN_FIELDS, layout):
        a = raw[at : at + n * np.dtype(dtype).itemsize].view(dtype)
        arrays.append(a.reshape(shapes[name]) if name in shapes else a)
    return StepPlan(*arrays)


class _Channel:
    """The header and a payload buffer that grows to the largest plan seen (reused every step)."""

    def __init__(self, pg: dist.ProcessGroup):
        """pg: the gloo group of rank 0 and the off-host ranks."""
        self.pg = pg
        self.header = torch.zeros(_HEADER, dtype=torch.int64)
        self.payload = torch.empty(1 << 16, dtype=torch.uint8)

    def _grow(self, nbytes: int) -> None:
        """Make the payload buffer hold nbytes."""
        if self.payload.numel() < nbytes:
            self.payload = torch.empty(max(nbytes, 2 * self.payload.numel()), dtype=torch.uint8)

    def _broadcast(self, t: torch.Tensor) -> None:
        """Broadcast t from rank 0 over the group; GroupLost when a member is gone."""
        try:
            dist.broadcast(t, src=0, group=self.pg)
        except Exception as exc:  # noqa: BLE001 - any failure means the group is broken
            raise GroupLost(f"plan broadcast failed: {exc}") from exc


class PlanSender(_Channel):
    """Rank 0's side."""

    def send(self, plan: StepPlan, kind: StepKind, steps: int) -> None:
        """Send one plan, its StepKind and its steps to every off-host rank."""
        counts = counts_of(plan)
        _, nbytes = _layout(counts)
        self._grow(nbytes)
        pack(plan, counts, self.payload.numpy())
        self.header[: 4 + len(counts)] = torch.tensor([PLAN, kind, steps, *counts, nbytes])
        self._broadcast(self.header)
        self._broadcast(self.payload[:nbytes])

    def idle(self) -> None:
        """Tell the receivers rank 0 lives and waits."""
        self.header[0] = IDLE
        self._broadcast(self.header)

    def stop(self) -> None:
        """Tell the receivers to exit (best effort: they may be gone already)."""
        self.header[0] = STOP
        try:
            self._broadcast(self.header)
        except GroupLost:
            pass


class PlanReceiver(_Channel):
    """An off-host rank's side."""

    def receive(self) -> tuple[StepPlan, StepKind, int] | None:
        """The next plan, its kind and its steps (views of the buffer, valid until the next receive); None: stop."""
        while True:
            self._broadcast(self.header)
            kind = int(self.header[0])
            if kind == STOP:
                return None
            if kind == PLAN:
                break
        n = len(PLAN_COUNTS)
        step_kind, steps, *counts = (int(v) for v in self.header[1 : 3 + n])
        nbytes = int(self.header[3 + n])
        self._grow(nbytes)
        self._broadcast(self.payload[:nbytes])
        return unpack(tuple(counts), self.payload.numpy()), StepKind(step_kind), steps
