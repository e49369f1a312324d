"""A linear layer whose weight may be several Hugging Face weights stacked (q/k/v, gate/up).

On a CPU with oneDNN the weight is repacked once, after loading, into the blocked layout oneDNN's
matmul reads (AMX tiles for bfloat16): an unpacked weight is reordered on every call, which for a
decode step's few rows costs as much as the product itself. `pack_weight` checks the packed product
against F.linear on a probe before it is used, and anything it cannot pack keeps the plain path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks its blocking for this many rows; the packed weight serves any row count, and this
# hint keeps bfloat16 results identical to F.linear from 1 row to a full prefill chunk (measured).
PACK_ROWS_HINT = 256
_PROBE_ROWS = 3


class PackedWeight:
    """A weight in oneDNN's layout and the op that multiplies by it: y = x @ W.T (+ b)."""

    __slots__ = ("packed", "out_features")

    def __init__(self, packed: torch.Tensor, out_features: int):
        """Wrap an already packed weight (see pack_weight)."""
        self.packed = packed
        self.out_features = out_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The product for x [..., in_features] (made contiguous if it is not)."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight | None:
    """The weight packed for oneDNN, or None where that is not available or not faithful here.

    CPU only; float32 and (where the CPU has the instructions) bfloat16. The packed product must
    match F.linear on a probe (bit for bit in bfloat16, to float32 rounding otherwise).
    """
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
    elif weight.dtype != torch.float32:
        return None
    try:
        with torch.inference_mode():
            packed = PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT), weight.shape[0])
            probe = torch.linspace(-1, 1, _PROBE_ROWS * weight.shape[1], dtype=torch.float32)
            probe = probe.view(_PROBE_ROWS, -1).to(weight.dtype)
            want, got = F.linear(probe, weight, bias).float(), packed(probe, bias).float()
    except (RuntimeError, AttributeError):  # an op this build of torch lacks, or a layout it refuses
        return None
    tol = 0.0 if weight.dtype == torch.bfloat16 else 1e-4 * (1.0 + float(want.abs().max()))
    if got.shape != want.shape or float((got - want).abs().max()) > tol:
        return None
    return packed


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
        self.packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The stacked projection [.., sum(parts)]; split it with .split(self.sizes, -1)."""
        if self.packed is not None:
            return self.packed(x, self.bias)
        return F.linear(x, self.weight, self.bias)

    def pack(self) -> bool:
        """Switch to the packed weight where the platform has one (after loading); True if it did.

        The plain weight is then released (an empty placeholder keeps the parameter's name), so the
        model is not held twice in memory; load every part before packing.
        """
        self.packed = pack_weight(self.weight, self.bias)
        if self.packed is not None:
            self.weight = nn.Parameter(self.weight.new_empty((0, self.weight.shape[1])), requires_grad=False)
        return self.packed is not None

    def load_part(self, part: str, kind: str, tensor: torch.Tensor) -> None:
        """Copy one HF weight ("weight" or "bias") into its rows."""
        if self.packed is not None:
            raise ValueError(f"{part}.{kind}: the layer's weight is already packed; load before packing")
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
