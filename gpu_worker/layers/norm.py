"""RMSNorm, computed as Hugging Face's Llama does (in float32, the weight applied in the input dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.gpu_worker.layers import cpu_kernels


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device):
        """Allocate the weight (filled by the loader)."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.native = False  # use the native CPU kernel (set by the model's prepare())

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """Normalise in float32, round to x's dtype, then scale: HF's rounding points, bit for bit.

        With delta, x += delta first, in place (the residual add before the norm, fused when native).
        torch's fused rms_norm upcasts reduced-precision input internally and rounds once at the end,
        which gives the same bits as HF's `x.float() ... .to(dtype)` in one op instead of five.
        """
        if self.native and x.is_contiguous() and (delta is None or delta.is_contiguous()):
            return cpu_kernels.rms_norm(x, self.weight, self.eps, delta)
        if delta is not None:
            x.add_(delta)
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
