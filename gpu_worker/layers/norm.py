"""RMSNorm in the forms the families use, each with transformers' rounding points.

- Llama (the default): normalise in float32, round to x's dtype, then scale by the weight in that dtype.
- `scale_in_float32` (OLMo 2): scale the float32 normalised x by the weight in float32, round once.
- `offset=1.0` (Gemma): the checkpoint stores w and the scale is (1 + w), in float32, rounded once.

In a float32 model every form is the Llama one (a float32 product rounds nowhere else), so the native CPU
kernel, which computes the Llama form, serves all of them there; in bfloat16 only the Llama form uses it.
The float32 scale of the other forms is folded once, after loading.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.gpu_worker.layers import cpu_kernels


class RMSNorm(nn.Module):
    """x / rms(x) * scale over the last dimension; `forward(x, delta)` first adds delta into x in place."""

    def __init__(
        self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device,
        offset: float = 0.0, scale_in_float32: bool = False, native: bool = False,
    ):
        """Allocate the weight (filled by the loader); native: use the CPU kernel where the form allows."""
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.float32_scale = scale_in_float32 or offset != 0.0
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset, dtype=dtype, device=device), requires_grad=False)
        self.llama_form = not self.float32_scale or dtype == torch.float32
        self.native = native and self.llama_form
        # What forward multiplies by: the weight's own storage (a plain tensor, so not a second parameter),
        # replaced by the folded float32 scale after loading where the form has one.
        self.scale: torch.Tensor = self.weight.data

    def process_weights_after_loading(self) -> None:
        """Fold the offset and the float32 cast into one scale tensor."""
        self.scale = self.weight.data.float() + self.offset if self.float32_scale else self.weight.data

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """Normalise and scale x (after x += delta, in place, when delta is given).

        torch's fused rms_norm upcasts reduced-precision input internally and rounds once at the end, which
        gives the same bits as HF's `x.float() ... .to(dtype)` in one op instead of five.
        """
        if self.native and x.is_contiguous() and (delta is None or delta.is_contiguous()):
            return cpu_kernels.rms_norm(x, self.scale, self.eps, delta)
        if delta is not None:
            x.add_(delta)
        if self.llama_form:
            return self.scale * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.scale).to(x.dtype)


class HeadNorm:
    """The q and k per-head norms (Qwen3, Gemma 3) applied as one over the stacked [T, heads + kv_heads, head_dim]
    view of q and k: the same per-head arithmetic as two norms, half the ops."""

    __slots__ = ("scale", "eps", "llama_form")

    def __init__(self, q_norm: RMSNorm, k_norm: RMSNorm, num_heads: int, num_kv_heads: int):
        """Stack the two norms' (loaded, processed) scales per head."""
        dim = q_norm.scale.shape[0]
        self.scale = torch.cat((q_norm.scale.expand(num_heads, dim), k_norm.scale.expand(num_kv_heads, dim)))
        self.eps = q_norm.eps
        self.llama_form = q_norm.llama_form

    def __call__(self, qk: torch.Tensor) -> torch.Tensor:
        """qk [T, heads + kv_heads, head_dim] normalised per head (a new tensor)."""
        dim = qk.shape[-1]
        if self.llama_form:
            return self.scale * F.rms_norm(qk, (dim,), eps=self.eps)
        return (F.rms_norm(qk.float(), (dim,), eps=self.eps) * self.scale).to(qk.dtype)
