"""RMSNorm, computed as Hugging Face's Llama does (in float32, the weight applied in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device):
        """Allocate the weight (filled by the loader)."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise in float32 (as HF does, so bf16 rounds at the same points), then scale."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
