"""A linear layer whose weight may be several Hugging Face weights stacked (q/k/v, gate/up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class StackedLinear(nn.Module):
    """y = x @ W.T (+ b), where W's rows are the named parts in order; one matmul instead of several."""

    def __init__(
        self,
        in_features: int,
        parts: dict[str, int],
        *,
        bias: bool | dict[str, bool] = False,
        dtype: torch.dtype,
        device: torch.device,
    ):
        """parts maps each stacked HF weight's suffix to its number of output rows."""
        super().__init__()
        self.parts = dict(parts)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, rows in self.parts.items():
            self.offsets[name] = (start, rows)
            start += rows
        self.sizes = list(self.parts.values())
        self.weight = nn.Parameter(torch.empty(start, in_features, dtype=dtype, device=device), requires_grad=False)
        bias_parts = bias if isinstance(bias, dict) else {name: bias for name in self.parts}
        self.bias_parts = {name for name, on in bias_parts.items() if on}
        self.bias = None
        if self.bias_parts:
            # Parts without a bias in the checkpoint keep zeros there.
            self.bias = nn.Parameter(torch.zeros(start, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The stacked projection [.., sum(parts)]; split it with .split(self.sizes, -1)."""
        return F.linear(x, self.weight, self.bias)

    def load_part(self, part: str, kind: str, tensor: torch.Tensor) -> None:
        """Copy one HF weight ("weight" or "bias") into its rows."""
        start, rows = self.offsets[part]
        if kind == "bias":
            if part not in self.bias_parts:
                raise ValueError(f"unexpected bias for {part}")
            target = self.bias[start : start + rows]
        else:
            target = self.weight[start : start + rows]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"{part}.{kind}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)
