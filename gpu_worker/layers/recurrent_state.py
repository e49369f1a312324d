"""Per-sequence recurrent state (conv and SSM) in preallocated state slots, and a step's view of it.

A recurrent layer's state after a sequence's tokens cannot be rebuilt from the paged KV cache: each running
sequence owns a state slot (the engine core assigns it; the plan carries it per row, `StepPlan.state_slots`)
holding, per recurrent layer, the last conv_width inputs of its causal conv and its SSM state. The slots are
allocated once, like the KV blocks; a row whose tokens start at position 0 finds its slot zeroed first (the
runner resets it), so a slot freed by a finished or preempted sequence is reused without the engine having to
clear it. The SSM state is kept in float32 at least, whatever the model's dtype (it accumulates over the whole
sequence).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


def ssm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The SSM state's dtype for a model of this dtype: float32, or the model's if wider."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True, slots=True)
class StateShape:
    """What one state slot holds, per recurrent layer: the conv's last inputs and the SSM state."""

    num_layers: int  # recurrent layers (attention layers keep KV instead)
    conv_dim: int  # channels of the causal conv (x, B and C side by side)
    conv_width: int  # inputs the conv keeps between steps: its kernel size - 1
    num_heads: int
    head_dim: int
    state_size: int

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes of one slot: the conv inputs in the model's dtype, the SSM state in float32 (or wider)."""
        conv = self.conv_dim * self.conv_width * torch.empty((), dtype=dtype).element_size()
        ssm = self.num_heads * self.head_dim * self.state_size * torch.empty((), dtype=ssm_dtype(dtype)).element_size()
        return self.num_layers * (conv + ssm)


class RecurrentState:
    """Every slot's state, allocated once: conv [layers, slots, conv_dim, conv_width] (model dtype) and
    ssm [layers, slots, heads, head_dim, state_size] (ssm_dtype)."""

    def __init__(self, shape: StateShape, num_slots: int, *, dtype: torch.dtype, device: torch.device):
        """Allocate num_slots zeroed slots."""
        if num_slots < 1:
            raise ValueError(f"a recurrent model needs at least one state slot, got {num_slots}")
        self.shape = shape
        self.num_slots = num_slots
        self.conv = torch.zeros(
            (shape.num_layers, num_slots, shape.conv_dim, shape.conv_width), dtype=dtype, device=device
        )
        self.ssm = torch.zeros(
            (shape.num_layers, num_slots, shape.num_heads, shape.head_dim, shape.state_size),
            dtype=ssm_dtype(dtype), device=device,
        )

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the given slots (int64 [n]) in every layer: their sequences start at position 0."""
        self.conv.index_fill_(1, slots, 0)
        self.ssm.index_fill_(1, slots, 0)


@dataclass(slots=True)
class StatePrefill:
    """A multi-token chunk of one row: its tokens start:end of T, continuing the state in `slot`."""

    start: int
    end: int
    slot: int


@dataclass(slots=True)
class StateStep:
    """The step's rows as the recurrent layers see them, built once per step and shared by every layer.

    One-token rows (decodes) are updated together, one recurrence step each; multi-token chunks one by one,
    by a chunked scan that starts from the slot's state.
    """

    state: RecurrentState
    decode_token_idx: torch.Tensor | None  # int64 [Rd]: the decode rows' tokens in T; None when they are all of T
    decode_slots: torch.Tensor | None  # int64 [Rd]; None when there are no decode rows
    prefills: list[StatePrefill]


def build_state_step(
    state: RecurrentState, query_start: np.ndarray, positions: np.ndarray, state_slots: np.ndarray, *,
    put: Callable[[str, np.ndarray], torch.Tensor],
) -> StateStep:
    """Sort a step's rows into decode rows and chunks, and reset the slots of rows that start at position 0.

    put(name, array): the array as an int64 tensor on the device (the runner's reused staging buffers)."""
    starts = query_start[:-1]
    q_lens = np.diff(query_start)
    slots = state_slots
    fresh = slots[positions[starts] == 0]
    if len(fresh):
        state.reset(put("state_reset", fresh))
    decode = np.flatnonzero(q_lens == 1)
    token_idx = decode_slots = None
    if len(decode):
        decode_slots = put("state_decode_slots", slots[decode])
        if len(decode) != int(query_start[-1]):
            token_idx = put("state_decode_tokens", starts[decode])
    prefills = [
        StatePrefill(int(starts[r]), int(query_start[r + 1]), int(slots[r])) for r in np.flatnonzero(q_lens > 1)
    ]
    return StateStep(state, token_idx, decode_slots, prefills)
