"""Weight-only quantized linear methods (layers/linear_method.py's interface): int8 per channel, 4-bit grouped.

- `Int8LinearMethod`: symmetric int8 per output row (scale = row absmax / 127), multiplied by
  `torch._weight_int8pack_mm` (torch's own CPU kernel: int8 weights, bf16 or fp32 activations, fp32 sums).
- `Int4LinearMethod`: asymmetric 4-bit codes in groups of `INT4_GROUP` inputs (w = s * q + z per group, q in
  0..15), multiplied by `torch._weight_int4pack_mm_for_cpu` after `_convert_weight_to_int4pack_for_cpu`
  repacks them (torch's kernel computes w = (q - 8) * scale + zero, so zero = z + 8 s; scale and zero are
  held in the activations' dtype, which is the only rounding a bf16 model adds to the codes).

torch's two kernels are matrix-vector kernels: their time grows with every row (a 32-row step costs several
times the dense product). Steps of more than `KERNEL_MAX_ROWS` rows (prefill chunks, big batches) multiply
instead by the dequantized weight expanded into one scratch matrix shared by all layers, in the activations'
dtype (each weight rounded once), through oneDNN: exactly the dequantized reference's product.

Both stage the float weight as float32 while loading (the layer's weight loader fills it part by part, fused or
split, like a dense one) and quantize it once in process_weights_after_loading. `Int4LinearMethod(codes=True)`
instead loads 4-bit codes, scales and offsets as a GGUF stores them (gguf_weights.py decodes Q4_0, Q4_1 and
Q4_K blocks, which are groups of 32 of exactly this form), so a 4-bit GGUF keeps its own codes.

`reference=True` quantizes the same way and then multiplies by the dequantized weight (dense, float32 or the
model's dtype): the run quantized kernels are checked against. `linear_methods` picks a method per layer;
`quantize_tied_head` gives a tied LM head its own quantized copy of the embedding table (the lookup keeps the
table: it reads a few rows a step, the head reads all of them).
On a device without these kernels (a GPU) a quantized layer multiplies by its dequantized weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from metrale.config import QUANTIZATIONS
from metrale.gpu_worker.layers.linear_method import DenseLinearMethod, LinearMethod, set_weight_attrs

DENSE = "none"  # --quantization none: every layer dense, a GGUF's quantized tensors dequantized
REFERENCE = "-dequantized"  # int8-dequantized / int4-dequantized: the quantized weights, multiplied dense
INT4_GROUP = 32  # inputs per 4-bit group: GGUF's 4-bit blocks are groups of 32
KERNEL_MAX_ROWS = 16  # more rows than this: the expanded codes through oneDNN (see the module docstring)
_INNER_K_TILES = 8  # torch's int4 CPU packing
_scratch: dict[tuple, torch.Tensor] = {}


def _expansion_buffer(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [rows, cols] view of the one scratch matrix per dtype and device (grown to the largest layer)."""
    key = (dtype, device)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < rows * cols:
        with torch.inference_mode(False):  # a normal tensor: usable in place inside and outside inference mode
            buf = torch.empty(rows * cols, dtype=dtype, device=device)
        _scratch[key] = buf
    return buf[: rows * cols].view(rows, cols)


def _staged_weight(layer: nn.Module, rows: int, cols: int, device: torch.device, weight_loader) -> None:
    """Register the float32 weight the loader fills (quantized after loading)."""
    weight = nn.Parameter(torch.empty(rows, cols, dtype=torch.float32, device=device), requires_grad=False)
    set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=weight_loader)
    layer.register_parameter("weight", weight)


def _release(layer: nn.Module, name: str) -> None:
    """Replace a loaded parameter by an empty placeholder (its name stays; its memory goes)."""
    old = getattr(layer, name)
    setattr(layer, name, nn.Parameter(old.new_empty((0,) + tuple(old.shape[1:])), requires_grad=False))


class Int8LinearMethod(LinearMethod):
    """int8 weights, one scale per output row; torch._weight_int8pack_mm on a CPU."""

    def __init__(self, *, reference: bool = False):
        """reference: multiply by the dequantized weight instead (the kernel's check)."""
        self.reference = reference

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, *, dtype, device, weight_loader):
        """A float32 `weight` [rows, in] staged for quantization."""
        _staged_weight(layer, sum(output_partition_sizes), input_size_per_partition, device, weight_loader)
        layer.act_dtype = dtype

    def process_weights_after_loading(self, layer):
        """Quantize per row: q = round(w / s), s = absmax / 127 (a row of zeros gets s = 1)."""
        w = layer.weight.data
        scale = w.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        scale = scale.to(layer.act_dtype).float()  # quantize with the scale the kernel will hold
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        _release(layer, "weight")
        layer.qweight = q
        layer.qscale = scale.to(layer.act_dtype)
        layer.dense = None
        if self.reference or q.device.type != "cpu":
            layer.dense = DenseLinearMethod()
            _dense_from(layer, q.float() * scale[:, None])

    def apply(self, layer, x, bias=None):
        """x @ (q * s).T (+ bias), in x's dtype."""
        if layer.dense is not None:
            return layer.dense.apply(layer, x, bias)
        flat = x.reshape(-1, x.shape[-1])
        scale = layer.qscale if layer.qscale.dtype == x.dtype else layer.qscale.to(x.dtype)
        if flat.shape[0] > KERNEL_MAX_ROWS:
            q = layer.qweight
            w = _expansion_buffer(q.shape[0], q.shape[1], x.dtype, x.device)
            w.copy_(q).mul_(scale[:, None])  # q * s, rounded once (both exact in x's dtype)
            y = F.linear(flat, w)
        else:
            y = torch._weight_int8pack_mm(flat.contiguous(), layer.qweight, scale)
        if bias is not None:
            y = y.add_(bias)
        return y.view(*x.shape[:-1], y.shape[-1])


class Int4LinearMethod(LinearMethod):
    """4-bit codes in groups of INT4_GROUP inputs with a scale and an offset each; torch's int4 CPU kernel."""

    def __init__(self, *, codes: bool = False, reference: bool = False):
        """codes: load a GGUF's codes (qweight, scales, zeros) rather than a float weight; reference: as Int8's."""
        self.codes = codes
        self.reference = reference

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, *, dtype, device, weight_loader):
        """A staged float32 weight, or the codes [rows, in] (uint8, 0..15) and per-group scales and offsets."""
        rows, cols = sum(output_partition_sizes), input_size_per_partition
        if cols % INT4_GROUP:
            raise ValueError(f"int4: {cols} input features is not a whole number of groups of {INT4_GROUP}")
        layer.act_dtype = dtype
        if not self.codes:
            _staged_weight(layer, rows, cols, device, weight_loader)
            return
        for name, shape, kind in (
            ("qweight", (rows, cols), torch.uint8),
            ("scales", (rows, cols // INT4_GROUP), torch.float32),
            ("zeros", (rows, cols // INT4_GROUP), torch.float32),
        ):
            param = nn.Parameter(torch.empty(shape, dtype=kind, device=device), requires_grad=False)
            set_weight_attrs(param, output_dim=0, input_dim=1, weight_loader=weight_loader)
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer):
        """Quantize a staged weight per group (min/max over 15 steps), then pack for the kernel."""
        if self.codes:
            q, s, z = layer.qweight.data, layer.scales.data, layer.zeros.data
            for name in ("qweight", "scales", "zeros"):
                _release(layer, name)
        else:
            q, s, z = quantize_int4(layer.weight.data, layer.act_dtype)
            _release(layer, "weight")
        layer.dense = None
        rows, cols = q.shape
        if self.reference or q.device.type != "cpu" or rows % 16:
            layer.dense = DenseLinearMethod()
            _dense_from(layer, dequantize_int4(q, s, z))
            return
        layer.packed_codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), _INNER_K_TILES)
        layer.codes, layer.group_scales, layer.group_zeros = q, s.to(layer.act_dtype), (z + 8 * s).to(layer.act_dtype)
        # [groups, rows, 2]: (scale, zero) with w = (q - 8) * scale + zero.
        layer.scales_zeros = torch.stack((s, z + 8 * s), dim=-1).transpose(0, 1).contiguous().to(layer.act_dtype)

    def apply(self, layer, x, bias=None):
        """x @ W.T (+ bias) with W the groups' s * q + z, in x's dtype."""
        if layer.dense is not None:
            return layer.dense.apply(layer, x, bias)
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > KERNEL_MAX_ROWS:
            q, (rows, groups) = layer.codes, layer.group_scales.shape
            w = _expansion_buffer(rows, q.shape[1], x.dtype, x.device)
            g = w.view(rows, groups, INT4_GROUP)
            g.copy_(q.view(rows, groups, INT4_GROUP)).sub_(8)
            # (q - 8) * scale + zero as the kernel holds them, rounded once.
            torch.addcmul(layer.group_zeros.to(x.dtype)[..., None], g, layer.group_scales.to(x.dtype)[..., None], out=g)
            y = F.linear(flat, w)
        else:
            sz = layer.scales_zeros if layer.scales_zeros.dtype == x.dtype else layer.scales_zeros.to(x.dtype)
            y = torch._weight_int4pack_mm_for_cpu(flat.contiguous(), layer.packed_codes, INT4_GROUP, sz)
        if bias is not None:
            y = y.add_(bias)
        return y.view(*x.shape[:-1], y.shape[-1])


def quantize_int4(w: torch.Tensor, held: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [rows, cols], scales, offsets [rows, cols / INT4_GROUP]) with w ~ s * q + z per group (min
    to max in 15 steps); s and the kernel's zero (z + 8 s) are exact in `held`, the dtype the kernel keeps them in."""
    rows, cols = w.shape
    g = w.float().view(rows, cols // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    s = (hi - lo) / 15.0
    s = torch.where(s > 0, s, torch.ones_like(s)).to(held).float()
    z = (lo + 8 * s).to(held).float() - 8 * s
    q = torch.round((g - z[..., None]) / s[..., None]).clamp_(0, 15).to(torch.uint8).view(rows, cols)
    return q, s, z


def dequantize_int4(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The float32 weight s * q + z of 4-bit codes."""
    rows, cols = q.shape
    g = q.float().view(rows, cols // INT4_GROUP, INT4_GROUP)
    return (g * s[..., None] + z[..., None]).view(rows, cols)


def _dense_from(layer: nn.Module, weight: torch.Tensor) -> None:
    """Give the layer a dense weight (the dequantized one) and let the dense method prepare it."""
    layer.weight = nn.Parameter(weight.to(layer.act_dtype), requires_grad=False)
    layer.dense.process_weights_after_loading(layer)


def quantize_tied_head(head: nn.Module, table: torch.Tensor, method: LinearMethod) -> None:
    """Multiply a tied LM head (already loaded and processed as dense) through `method` applied to a copy of
    the embedding table [vocab rows, hidden]; its dense packed copy is dropped."""
    head.quant_method = method
    head.shares_weight = False
    head.packed = None
    method.create_weights(
        head, table.shape[1], [table.shape[0]], dtype=table.dtype, device=table.device, weight_loader=head.weight_loader
    )
    head.weight.data.copy_(table)
    method.process_weights_after_loading(head)


def parse_quantization(name: str | None) -> tuple[str | None, bool]:
    """(kind, reference) of a --quantization value: None (as the checkpoint is), "none", "int8", "int4",
    "int8-dequantized", "int4-dequantized"; ValueError for anything else."""
    if name is not None and name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (got {name!r})")
    if name is None or name == DENSE:
        return name, False
    return (name[: -len(REFERENCE)], True) if name.endswith(REFERENCE) else (name, False)


def linear_methods(quantization: str | None, file_kinds: Callable[[str], str | None] | None = None) -> Callable[[str], LinearMethod]:
    """The linear method for each layer prefix.

    quantization (parse_quantization's values): int8 / int4 quantize every layer; "none" keeps every layer
    dense; None follows the checkpoint: file_kinds(prefix) says what a GGUF stores for that layer ("int8" for
    Q8_0, "int4" for its 4-bit codes, None for anything else), and a Hugging Face checkpoint is dense.
    """
    kind, reference = parse_quantization(quantization)

    def method(prefix: str) -> LinearMethod:
        """The method for one layer (a tied LM head asks as "lm_head" with the embedding's stored kind)."""
        stored = file_kinds(prefix) if file_kinds is not None else None
        chosen = stored if kind is None else (None if kind == DENSE else kind)
        if chosen == "int8":
            return Int8LinearMethod(reference=reference)
        if chosen == "int4":
            return Int4LinearMethod(codes=stored == "int4" and kind in (None, "int4"), reference=reference)
        return DenseLinearMethod()

    return method
