"""How a linear layer stores its weight and multiplies by it: the quantization-method seam (vLLM's shape).

Every linear layer (layers/linear.py) and the LM head (layers/vocab_embedding.py) holds one `LinearMethod`
and never touches its weight storage itself. A method is three calls:

- `create_weights(layer, input_size_per_partition, output_partition_sizes, dtype=, device=, weight_loader=)`
  registers the layer's parameters (`layer.register_parameter`). The sizes are this rank's: input features,
  and the output rows of each stacked part (q/k/v, gate/up; one entry for a plain layer). Each parameter
  carries three attributes the layer's weight loader reads: `output_dim` (the dimension that runs over
  output rows, or None), `input_dim` (over input features, or None) and `weight_loader` (pass the one given).
  Dimensions may be packed or grouped (two 4-bit values a byte, one scale per 32 inputs): the loader takes
  each shard's length from the parameter's own shape, in proportion, so any layout with whole rows and whole
  groups per shard loads fused, split and sharded checkpoints alike. A parameter that is loaded whole (a
  per-tensor scale) sets both dims to None.
- `process_weights_after_loading(layer)` runs once, after every weight is in: repack, quantize, or build
  whatever `apply` reads. It may replace or release the parameters.
- `apply(layer, x, bias)` returns x @ W.T (+ bias) for x [..., input_size_per_partition], in x's dtype.

`DenseLinearMethod` is the unquantized path: a plain [out, in] weight. In bfloat16 on a CPU with the native
kernels it stays plain, one layout for every kernel that reads it: the native GEMV for one or two rows (a
decode step's few rows are bound by reading the weight, which it streams faster than oneDNN's AMX kernel)
and oneDNN's matmul for more (on the plain weight about as fast as on a packed one at a decode batch's
rows), after `gemv_serves` checks the GEMV against F.linear
on a probe. Otherwise (float32, no native kernels) it is repacked once into oneDNN's blocked layout (an
unpacked weight is reordered on every call, which for a decode step's few rows costs as much as the product
itself), after `pack_weight` checks the packed product against F.linear on a probe; anything it cannot pack
keeps F.linear. A model asks its
`ModelContext.linear_method(prefix)` for each layer's method (prefix: the layer's checkpoint name, e.g.
"model.layers.3.self_attn.qkv_proj"), so a quantized checkpoint chooses per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from metrale.gpu_worker.layers import cpu_kernels

WeightLoader = Callable[..., None]  # weight_loader(param, loaded_weight, shard_id=None)

# oneDNN picks its blocking for this many rows; the packed weight serves any row count, and this
# hint keeps bfloat16 results identical to F.linear from 1 row to a full prefill chunk (measured).
PACK_ROWS_HINT = 256
_PROBE_ROWS = 3


class LinearMethod:
    """The interface: how a linear layer holds its weight and computes x @ W.T (+ b)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        *,
        dtype: torch.dtype,
        device: torch.device,
        weight_loader: WeightLoader,
    ) -> None:
        """Register the layer's weight parameters (see the module docstring for their attributes)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded parameters into what apply reads (once, after loading)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias) for x [..., in]: [..., out] in x's dtype."""
        raise NotImplementedError

    def native_products(self, layer: nn.Module):
        """(products, wide) when apply is a row-stacking of native products (quantization.NativeProduct) that the
        fused decode step may call itself, with `wide` the layer's flag for the wide bf16 product; None when it
        is not (the dense method, whose weight the step takes directly, answers None too)."""
        return None


class DenseLinearMethod(LinearMethod):
    """An unquantized [out, in] weight in the model's dtype, packed for oneDNN where that is faithful."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, *, dtype, device, weight_loader):
        """One `weight` parameter [sum(output_partition_sizes), input_size_per_partition]."""
        rows = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(rows, input_size_per_partition, dtype=dtype, device=device), requires_grad=False)
        set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=weight_loader)
        layer.register_parameter("weight", weight)
        layer.packed = None
        layer.native_gemv = False

    def process_weights_after_loading(self, layer):
        """Keep a bfloat16 weight plain for the native GEMV where it checks out; else pack it for oneDNN and
        release the plain one (an empty placeholder keeps its name), unless the layer shares it (a tied LM
        head's weight is the embedding table)."""
        layer.native_gemv = gemv_serves(layer.weight, getattr(layer, "bias", None))
        if layer.native_gemv:
            return
        layer.packed = pack_weight(layer.weight, getattr(layer, "bias", None))
        if layer.packed is not None and not getattr(layer, "shares_weight", False):
            layer.weight = nn.Parameter(layer.weight.new_empty((0, layer.weight.shape[1])), requires_grad=False)

    def apply(self, layer, x, bias=None):
        """The packed product where there is one, else F.linear."""
        if layer.native_gemv and x.dim() == 2:
            return cpu_kernels.linear(x, layer.weight, bias)
        packed = layer.packed
        if packed is not None:
            return packed(x, bias)
        return F.linear(x, layer.weight, bias)


def dense_method(prefix: str) -> LinearMethod:
    """The method for an unquantized checkpoint: dense for every layer."""
    return DenseLinearMethod()


def set_weight_attrs(param: nn.Parameter, **attrs) -> None:
    """Tag a parameter with what its loader needs (output_dim, input_dim, weight_loader, ...)."""
    for name, value in attrs.items():
        setattr(param, name, value)


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


def gemv_serves(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """True when the weight stays plain for the native GEMV: bfloat16 on a CPU with the kernels loaded, and
    the GEMV's product on a probe within one bfloat16 rounding of F.linear's (it sums in another order)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[0] == 0:
        return False
    if not cpu_kernels.loaded() or not weight.is_contiguous():
        return False
    with torch.inference_mode():
        probe = torch.linspace(-1, 1, 2 * weight.shape[1], dtype=torch.float32).view(2, -1).to(weight.dtype)  # rows it takes
        want, got = F.linear(probe, weight, bias).float(), cpu_kernels.linear(probe, weight, bias).float()
    tol = 2.0**-7 * want.abs() + 1e-6 * float(want.abs().max())
    return got.shape == want.shape and bool(((got - want).abs() <= tol).all())


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight | None:
    """The weight packed for oneDNN, or None where that is not available or not faithful here.

    CPU only; float32 and (where the CPU has the instructions) bfloat16. The packed product must
    match F.linear on a probe (bit for bit in bfloat16, to float32 rounding otherwise).
    """
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[0] == 0:
        return None
    if not torch.backends.mkldnn.is_available():
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
