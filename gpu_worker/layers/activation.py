"""Gated activations over a stacked [gate | up] projection: act(gate) * up, as transformers rounds it.

`hidden_act` names (transformers' ACT2FN): silu / swish, gelu_pytorch_tanh (GELU's tanh approximation, Gemma)
and gelu (the exact erf form). SiLU has a native CPU kernel that reads the stacked projection once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.gpu_worker.layers import cpu_kernels

SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh", "gelu")


class GatedActivation:
    """gate_up [T, 2n] -> act(gate_up[:, :n]) * gate_up[:, n:], [T, n]."""

    __slots__ = ("kind", "native")

    def __init__(self, name: str, *, native: bool = False):
        """ValueError for an activation not implemented here; native: the CPU kernel where it has one."""
        if name not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act {name!r} is not supported (supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
        self.kind = "silu" if name in ("silu", "swish") else name
        self.native = native and self.kind == "silu"

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The gated product (a fresh contiguous tensor; gate_up's first half may be overwritten)."""
        if self.native:
            return cpu_kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.kind == "silu":
            # silu in place on the projection's own buffer; the product is a fresh contiguous tensor.
            return torch.mul(F.silu(gate, inplace=True), up)
        if self.kind == "gelu_pytorch_tanh":
            return torch.mul(F.gelu(gate, approximate="tanh"), up)
        return torch.mul(F.gelu(gate), up)
