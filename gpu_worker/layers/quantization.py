"""Weight-only quantized linear methods (layers/linear_method.py's interface): int8 and 4-bit, in blocks of 32.

- `Int8LinearMethod`: int8 codes with one fp16 scale per block of 32 inputs, GGUF's Q8_0 (d = absmax / 127,
  w = d * q); a Q8_0 file's dequantized tensors give back its own codes and scales.
- `Int4LinearMethod`: 4-bit codes in groups of 32 inputs with a scale and an offset each (w = s * q + z, q in
  0..15), quantized from a float weight (min to max in 15 steps) or, with `codes=True`, loaded as a GGUF
  stores them (gguf_weights.py decodes Q4_0, Q4_1 and Q4_K blocks, which are groups of 32 of exactly this form).

On a CPU both multiply with cpu_quant.cpp's kernels, as llama.cpp does: each row of x is quantized to int8 per
block of 32 (`quantize_activations`), each block's dot product is exact in int32 and the blocks are summed in
float32 with their scales. Decode steps (a few rows) are bound by reading the weight, which is a half (int8) or
a quarter (4-bit) of bf16's bytes; more rows reuse each panel of the weight from cache for every row. On the amx
class, from WIDE_ROWS bf16 rows (prefill chunks, big batches) a layer is `wide`: the kernels dequantize the
weight to bf16 a panel pair at a time and multiply x unquantized with AMX's bf16 tiles, which outrun int8 dot
products there. The kernels take weights packed in their layout (`pack_int8`, `pack_int4`) once, in
process_weights_after_loading.

`reference=True` keeps the same integers and multiplies them dense: x quantized and dequantized by
`quantize_activations`, times the dequantized weight, in float32 (for a wide layer's many bf16 rows: x times
the weight rounded to bf16): the kernels' arithmetic up to the order of float32 sums, which is what they are
checked against. Without the kernels (no compiler, a GPU) a layer runs the
same dense product in the model's dtype.

Both stage the float weight as float32 while loading (the layer's weight loader fills it part by part, fused or
split, like a dense one) and quantize it once after loading. `linear_methods` picks a method per layer;
`quantize_tied_head` gives a tied LM head its own quantized copy of the embedding table (the lookup keeps the
table: it reads a few rows a step, the head reads all of them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from metrale.config import QUANTIZATIONS
from metrale.gpu_worker.layers import cpu_kernels, kernel_choice
from metrale.gpu_worker.layers.linear_method import DenseLinearMethod, LinearMethod, set_weight_attrs

DENSE = "none"  # --quantization none: every layer dense, a GGUF's quantized tensors dequantized
REFERENCE = "-dequantized"  # int8-dequantized / int4-dequantized: the same integers, multiplied dense
BLOCK = 32  # inputs per scale: GGUF's Q8_0 and 4-bit blocks, and the activations' blocks
INT4_GROUP = BLOCK
PANEL = 16  # output rows per panel of the kernels' layout (cpu_quant.cpp)
WIDE_ROWS = 16  # from this many bfloat16 rows on the amx class: the weight dequantized to bf16, AMX tiles


def _staged_weight(layer: nn.Module, rows: int, cols: int, device: torch.device, weight_loader) -> None:
    """Register the float32 weight the loader fills (quantized after loading)."""
    weight = nn.Parameter(torch.empty(rows, cols, dtype=torch.float32, device=device), requires_grad=False)
    set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=weight_loader)
    layer.register_parameter("weight", weight)


def _release(layer: nn.Module, name: str) -> None:
    """Replace a loaded parameter by an empty placeholder (its name stays; its memory goes)."""
    old = getattr(layer, name)
    setattr(layer, name, nn.Parameter(old.new_empty((0,) + tuple(old.shape[1:])), requires_grad=False))


@dataclass(frozen=True, slots=True)
class NativeProduct:
    """One native product x @ W.T over `rows` output rows: op(x, *args, rows) (and the wide flag where the op
    takes one). Held as data, not a closure, so the fused decode step (models/fused_decode.py) calls the same op
    on the same packed weight without a Python frame."""

    op: Any  # a torch OpOverload of a kernel class's namespace: the class dispatch chose for few rows
    args: tuple[torch.Tensor, ...]
    rows: int
    takes_wide: bool
    wide_op: Any = None  # the process's own op where `op` is another class's and the wide product is needed

    def __call__(self, x: torch.Tensor, wide: bool) -> torch.Tensor:
        """x [n, in] (contiguous, as _kernel_input makes it) times the weight: [n, rows] in x's dtype."""
        if self.takes_wide:
            return (self.wide_op if wide and self.wide_op is not None else self.op)(x, *self.args, self.rows, wide)
        return self.op(x, *self.args, self.rows)


def native_product(name: str, args: tuple[torch.Tensor, ...], rows: int, cols: int, takes_wide: bool, wide: bool) -> NativeProduct:
    """Op `name` over a packed weight of rows x cols, on the class dispatch measured fastest for that shape
    (kernel_choice.product_class); where that is not the process's class and the layer goes wide, the
    process's op keeps the wide product."""
    tail = (rows, False) if takes_wide else (rows,)
    cls = kernel_choice.product_class(name, (*args, *tail), rows, cols)
    op = getattr(cpu_kernels.ops(cls), name).default
    wide_op = getattr(cpu_kernels.ops(), name).default if takes_wide and wide and cls != cpu_kernels.isa() else None
    return NativeProduct(op, tuple(args), rows, takes_wide, wide_op)


class Int8LinearMethod(LinearMethod):
    """int8 weights with one fp16 scale per block of 32 inputs (Q8_0); cpu_quant.cpp's int8 product on a CPU."""

    def __init__(self, *, reference: bool = False):
        """reference: multiply the same integers dense in float32 instead (the kernel's check)."""
        self.reference = reference

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, *, dtype, device, weight_loader):
        """A float32 `weight` [rows, in] staged for quantization."""
        _staged_weight(layer, sum(output_partition_sizes), input_size_per_partition, device, weight_loader)
        layer.act_dtype = dtype

    def process_weights_after_loading(self, layer):
        """Quantize per block (quantize_int8), then pack for the kernel, or keep the dequantized weight."""
        q, d = quantize_int8(layer.weight.data)
        _release(layer, "weight")
        layer.qweight, layer.qscale = q, d
        layer.out_features = q.shape[0]
        layer.int8_op = None if self.reference else _kernel("int8_linear", q.device)
        layer.wide = _goes_wide(q.device)
        if layer.int8_op is not None:
            layer.packed_codes, layer.packed_scales = pack_int8(q, d)
            packed = (layer.packed_codes, layer.packed_scales)
            layer.native = native_product("int8_linear", packed, layer.out_features, q.shape[1], True, layer.wide)
        else:
            layer.dequantized = dequantize_int8(q, d).to(torch.float32 if self.reference else layer.act_dtype)

    def apply(self, layer, x, bias=None):
        """x @ (q * d).T (+ bias) with x quantized per block (quantize_activations), in x's dtype."""
        flat = x.reshape(-1, x.shape[-1])
        if layer.int8_op is not None:
            y = layer.native(_kernel_input(flat), layer.wide and _wide(flat))
        else:
            y = _dense_product(flat, layer.dequantized, layer.wide)
        if bias is not None:
            y = y.add_(bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def native_products(self, layer):
        """The one native product, or None for the dense reference."""
        return ([layer.native], layer.wide) if layer.int8_op is not None else None


class Int4LinearMethod(LinearMethod):
    """4-bit codes in groups of INT4_GROUP inputs with a scale and an offset each; cpu_quant.cpp's 4-bit product."""

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
        """Quantize a staged weight per group (min/max over 15 steps), then pack for the kernel, or keep the
        dequantized weight."""
        if self.codes:
            q, s, z = layer.qweight.data, layer.scales.data, layer.zeros.data
            for name in ("qweight", "scales", "zeros"):
                _release(layer, name)
        else:
            q, s, z = quantize_int4(layer.weight.data)
            _release(layer, "weight")
        layer.out_features = q.shape[0]
        layer.int4_op = None if self.reference else _kernel("int4_linear", q.device)
        layer.wide = _goes_wide(q.device)
        if layer.int4_op is not None:
            layer.packed_codes, layer.packed_scales, layer.packed_zeros = pack_int4(q, s, z)
            packed = (layer.packed_codes, layer.packed_scales, layer.packed_zeros)
            layer.native = native_product("int4_linear", packed, layer.out_features, q.shape[1], True, layer.wide)
        else:
            layer.dequantized = dequantize_int4(q, s, z).to(torch.float32 if self.reference else layer.act_dtype)

    def apply(self, layer, x, bias=None):
        """x @ W.T (+ bias) with W the groups' s * q + z and x quantized per block, in x's dtype."""
        flat = x.reshape(-1, x.shape[-1])
        if layer.int4_op is not None:
            y = layer.native(_kernel_input(flat), layer.wide and _wide(flat))
        else:
            y = _dense_product(flat, layer.dequantized, layer.wide)
        if bias is not None:
            y = y.add_(bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def native_products(self, layer):
        """The one native product, or None for the dense reference."""
        return ([layer.native], layer.wide) if layer.int4_op is not None else None


def _kernel(name: str, device: torch.device):
    """The process's native op `name` (native_product then picks the class per weight shape); None off the CPU
    or where its unit did not load."""
    if device.type != "cpu" or not cpu_kernels.available() or not cpu_kernels.has(name):
        return None
    return getattr(cpu_kernels.ops(), name).default


def _goes_wide(device: torch.device) -> bool:
    """True when this process's kernels multiply many bf16 rows by the weight dequantized to bf16 (the amx
    class: its bf16 tiles outrun int8 products at a prefill's rows); the reference then does the same."""
    return device.type == "cpu" and cpu_kernels.choice() != "torch" and cpu_kernels.isa() == "amx"


def _wide(x: torch.Tensor) -> bool:
    """True for the rows that take the dequantized bf16 product on a class that has it."""
    return x.dtype == torch.bfloat16 and x.shape[0] >= WIDE_ROWS


def _kernel_input(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels take it: contiguous float32, bfloat16 or float16."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()
    return x.contiguous()


def _dense_product(x: torch.Tensor, weight: torch.Tensor, wide: bool = False) -> torch.Tensor:
    """The kernels' product done dense: x [rows, in] quantized and dequantized per block, times the dequantized
    weight, in the weight's dtype (float32 for the reference); in x's dtype. With `wide` and rows that take the
    wide product, as the kernel does it: x as it is, times the weight rounded to bf16."""
    if wide and _wide(x):
        return F.linear(x.to(weight.dtype), weight.bfloat16().to(weight.dtype)).to(x.dtype)
    codes, scales = quantize_activations(x)
    xq = codes.view(*scales.shape, BLOCK).to(weight.dtype) * scales.to(weight.dtype)[..., None]
    return F.linear(xq.flatten(-2)[:, : weight.shape[1]], weight).to(x.dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [rows, padded in], scales float32 [rows, blocks]) of x [rows, in] in blocks of BLOCK inputs,
    zeros past the end: d = absmax / 127, code = round(x * (1 / d)) half to even (0 where d is 0). The kernels
    quantize exactly so (the tests check)."""
    rows, cols = x.shape
    blocks = -(-cols // BLOCK)
    g = F.pad(x.float(), (0, blocks * BLOCK - cols)).view(rows, blocks, BLOCK)
    d = g.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    codes = torch.round(g * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(rows, blocks * BLOCK), d


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [rows, cols], scales float16 [rows, blocks]) of w in blocks of BLOCK inputs by Q8_0's rule:
    d = absmax / 127 in fp16, code = round(w / d). A Q8_0 file's dequantized values give back its own codes and
    scales. A block too small for an fp16 scale quantizes to zeros."""
    rows, cols = w.shape
    blocks = -(-cols // BLOCK)
    g = F.pad(w.float(), (0, blocks * BLOCK - cols)).view(rows, blocks, BLOCK)
    d = (g.abs().amax(dim=-1) / 127.0).clamp_(max=torch.finfo(torch.float16).max).half()
    df = d.float()[..., None]
    q = torch.where(df > 0, torch.round(g / torch.where(df > 0, df, 1.0)).clamp_(-127, 127), 0.0).to(torch.int8)
    return q.view(rows, blocks * BLOCK)[:, :cols].contiguous(), d


def dequantize_int8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The float32 weight d * q of int8 codes [rows, cols] and their block scales [rows, blocks]."""
    rows, cols = q.shape
    g = F.pad(q.float(), (0, d.shape[1] * BLOCK - cols)).view(rows, -1, BLOCK)
    return (g * d.float()[..., None]).view(rows, -1)[:, :cols]


def pack_int8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu_quant.cpp's layout of int8 codes [rows, cols] with fp16 block scales [rows, blocks]: codes [panels,
    blocks * 8, 16, 4] (zero rows and inputs pad them), the scales' bits as int16 [panels, blocks, 16]."""
    rows, blocks = d.shape
    panels = -(-rows // PANEL)
    codes = q.new_zeros(panels * PANEL, blocks * BLOCK)
    codes[:rows, : q.shape[1]] = q
    codes = codes.view(panels, PANEL, blocks * BLOCK // 4, 4).transpose(1, 2).contiguous()
    return codes, _per_panel(d, panels).view(torch.int16)


def pack_int4(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cpu_quant.cpp's layout of 4-bit codes [rows, cols] (cols a multiple of BLOCK) with their groups' scales
    and offsets: codes [panels, cols / 8, 16, 4], each byte one input's code (low nibble) and the code of the
    input four later (high); scales and offsets [panels, blocks, 16], as fp16 bits (int16) where every one is
    exact in fp16 (Q4_0, Q4_1, quantize_int4's; a quarter fewer bytes to read), else float32 (Q4_K)."""
    rows, cols = q.shape
    panels = -(-rows // PANEL)
    codes = q.new_zeros(panels * PANEL, cols)
    codes[:rows] = q
    pairs = codes.view(panels, PANEL, cols // 8, 2, 4)
    packed = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).transpose(1, 2).contiguous()
    s, z = s.float(), z.float()
    if torch.equal(s.half().float(), s) and torch.equal(z.half().float(), z):
        return packed, _per_panel(s.half(), panels).view(torch.int16), _per_panel(z.half(), panels).view(torch.int16)
    return packed, _per_panel(s, panels), _per_panel(z, panels)


def _per_panel(t: torch.Tensor, panels: int) -> torch.Tensor:
    """Per-block values [rows, blocks] as [panels, blocks, 16] (zero rows pad the last panel)."""
    padded = t.new_zeros(panels * PANEL, t.shape[1])
    padded[: t.shape[0]] = t
    return padded.view(panels, PANEL, -1).transpose(1, 2).contiguous()


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [rows, cols], scales, offsets float32 [rows, cols / INT4_GROUP]) with w ~ s * q + z per
    group, min to max in 15 steps, s and z exact in fp16 (what the kernels read): z is the group's minimum
    rounded down and s the step that still reaches its maximum, rounded up, so every weight lies within half a
    step of its code's value."""
    rows, cols = w.shape
    g = w.float().view(rows, cols // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    z = _fp16_toward(lo, -torch.inf)
    s = _fp16_toward((hi - z) / 15.0, torch.inf)
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((g - z[..., None]) / s[..., None]).clamp_(0, 15).to(torch.uint8).view(rows, cols)
    return q, s, z


def _fp16_toward(v: torch.Tensor, direction: float) -> torch.Tensor:
    """float32 v rounded to the nearest fp16 on the side of direction (-inf or inf), as float32."""
    h = v.clamp(-65504.0, 65504.0).half()
    off = (h.float() < v) if direction > 0 else (h.float() > v)
    return torch.where(off, torch.nextafter(h, torch.full_like(h, direction)), h).float()


def dequantize_int4(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The float32 weight s * q + z of 4-bit codes."""
    rows, cols = q.shape
    g = q.float().view(rows, cols // INT4_GROUP, INT4_GROUP)
    return (g * s[..., None] + z[..., None]).view(rows, cols)


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
    dense; None follows the checkpoint: file_kinds(prefix) names the kernel a GGUF layer's stored blocks run on
    ("int8", "int4", "int5", "kq8": gguf_weights.gguf_layer_kinds; None for float tensors), and such a layer
    keeps its blocks (gguf_linear.GgufLinearMethod); a Hugging Face checkpoint is dense. int4 of a 4-bit GGUF
    layer takes its codes as stored.
    """
    from metrale.gpu_worker.layers.gguf_linear import GgufLinearMethod

    kind, reference = parse_quantization(quantization)

    def method(prefix: str) -> LinearMethod:
        """The method for one layer (a tied LM head asks as "lm_head" with the embedding's stored kind)."""
        stored = file_kinds(prefix) if file_kinds is not None else None
        if kind is None and stored is not None:
            return GgufLinearMethod()
        chosen = None if kind in (None, DENSE) else kind
        if chosen == "int8":
            return Int8LinearMethod(reference=reference)
        if chosen == "int4":
            return Int4LinearMethod(codes=stored == "int4", reference=reference)
        return DenseLinearMethod()

    return method
