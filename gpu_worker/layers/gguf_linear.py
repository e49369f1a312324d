"""A GGUF layer multiplied as its file stores it: each part's blocks kept in their own type.

`GgufLinearMethod` takes the file's blocks (gguf_weights.py yields them raw, as uint8 rows tagged with their
type's name) part by part, fused or split, through the layer's own weight loader, so a stacked layer whose
parts differ in type (a Q4_K_M file's Q4_K q/k beside its Q6_K v) keeps each in its own. The loader places
each part's rows (a column of each row's index goes through it, not the blocks: `_stage`), so a row is read
where the file's map holds it; only a part the loader cuts by columns (a row-parallel rank's share) is copied.
After loading, each run of rows whose types share a kernel (gguf_quant_types.TYPES) is written once into that
kernel's layout and multiplied by it: one product per run, the runs' outputs side by side. The common types go
from their stored blocks straight to the layout in C (gguf_repack.from_stored); the rest, and every type
without the C library, through gguf_quant_types' decoded form. No type is dequantized to floats.

`reference=True` (or no kernels: a GPU, no compiler) multiplies the dequantized weight dense instead, with x
quantized per block as the kernels do (quantization.py's _dense_product): the kernels' arithmetic up to the
order of float32 sums, which is what the tests check them against.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from metrale.gguf_reader import GgufError
from metrale.gpu_worker.layers import gguf_quant_types as qt
from metrale.gpu_worker.layers import gguf_repack
from metrale.gpu_worker.layers.linear_method import LinearMethod, set_weight_attrs
from metrale.gpu_worker.layers.quantization import NativeProduct, _dense_product, _goes_wide, _kernel, _kernel_input, _wide, native_product

GGUF_TYPE = "gguf_type"  # the attribute naming a raw tensor's GGUF type (gguf_weights.py sets it)
GGUF_TENSOR = "gguf_tensor"  # and the one naming the file's tensor it comes from
GGUF_ROWS = "gguf_rows"  # and the stored row each of its rows is (int64), or None: in order (q/k: llama.cpp's permutation)


@dataclass(slots=True)
class _Part:
    """One loaded part of a layer, of one type: which of the layer's rows it filled (`index`: 1 + the row of
    `source` each holds, 0 for a row it did not fill) and the rows of stored blocks themselves (a view of the
    file's map, or a copy), kept until the layer is packed."""

    name: str
    index: np.ndarray  # int64 [rows]
    source: torch.Tensor  # uint8 [n, bytes per row], rows contiguous
    tensor: str  # the file's name for the tensor (for errors), "" where not known


@dataclass(slots=True)
class _Run:
    """Consecutive output rows of one kernel: its product (a NativeProduct on a CPU, Triton's on CUDA)."""

    rows: int
    product: Callable[[torch.Tensor, bool], torch.Tensor]


class GgufLinearMethod(LinearMethod):
    """A layer holding a GGUF file's blocks per part (see the module docstring)."""

    def __init__(self, *, reference: bool = False):
        """reference: multiply the dequantized weight dense in float32 (the kernels' check)."""
        self.reference = reference

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, *, dtype, device, weight_loader):
        """A placeholder `weight` whose loader stages each part's raw blocks by type."""
        layer.act_dtype = dtype
        layer.in_features = input_size_per_partition
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), 0, dtype=torch.uint8, device=device), requires_grad=False)
        set_weight_attrs(weight, output_dim=0, input_dim=None, weight_loader=partial(_stage, layer, weight_loader))
        layer.register_parameter("weight", weight)
        layer.gguf_staged = []

    def process_weights_after_loading(self, layer):
        """Pack each run of rows of one kernel into its layout (or the dequantized weight), then drop the blocks."""
        spans = _spans(layer)
        layer.gguf_types = [t for t, _, _ in spans]
        layer.out_features = layer.weight.shape[0]
        device = layer.weight.device
        runs = _by_kernel(spans)
        ops = {kernel: None if self.reference else _kernel(f"{kernel}_linear", device) for kernel, _ in runs}
        layer.wide = _goes_wide(device)
        if not self.reference and device.type == "cuda" and (triton_runs := _triton_runs(_checked_segments(layer), device)):
            layer.gguf_runs = triton_runs
        elif any(op is None for op in ops.values()):
            _check_finite(layer)
            weight = torch.cat([qt.dequantize(b) for _, b in _segments(layer)]).to(device)
            layer.dequantized = weight if self.reference else weight.to(layer.act_dtype)
            layer.gguf_runs = None
        else:
            layer.gguf_runs = [_run(layer, kernel, parts) for kernel, parts in runs]
        single = layer.gguf_runs is not None and len(layer.gguf_runs) == 1
        layer.gguf_single = layer.gguf_runs[0].product if single else None
        layer.gguf_staged = []
        layer.weight = nn.Parameter(layer.weight.new_empty((0, 0)), requires_grad=False)

    def apply(self, layer, x, bias=None):
        """x @ W.T (+ bias) in x's dtype, one product per run of rows (on the amx class, from WIDE_ROWS bf16 rows,
        every run through its weight dequantized to bf16 and AMX tiles: quantization.py's `wide`)."""
        if layer.gguf_single is not None and bias is None and x.dim() == 2 and x.is_contiguous():
            return layer.gguf_single(x, layer.wide and _wide(x))  # the common case, without the general path's ops
        flat = x.reshape(-1, x.shape[-1])
        if layer.gguf_runs is None:
            y = _dense_product(flat, layer.dequantized, layer.wide)
        else:
            xin = _kernel_input(flat)
            wide = layer.wide and _wide(xin)
            ys = [run.product(xin, wide) for run in layer.gguf_runs]
            y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
        if bias is not None:
            y = y.add_(bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def native_products(self, layer):
        """Each run's native product, or None for the dense or Triton forms."""
        runs = layer.gguf_runs
        if runs is None or not all(isinstance(run.product, NativeProduct) for run in runs):
            return None
        return [run.product for run in runs], layer.wide


def _stage(layer: nn.Module, weight_loader, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Note where the layer's own loader puts a raw tensor's rows (this rank's, at its part's place): a column of
    1 + each row's index goes through it, and the rows stay where they are (the file's map), unless the loader
    cuts them by columns (a row-parallel rank's share: then their blocks go through it into a copy)."""
    name = getattr(loaded, GGUF_TYPE, None)
    if name not in qt.TYPES:
        raise ValueError(f"a GGUF-typed layer takes its file's blocks of a known type (got {name or loaded.dtype})")
    t = qt.TYPES[name]
    if layer.in_features % t.block:
        raise ValueError(f"{layer.in_features} inputs are not whole {name} blocks of {t.block}")
    rows, width = param.shape[0], layer.in_features // t.block * t.nbytes
    order = getattr(loaded, GGUF_ROWS, None)
    index = torch.zeros(rows, 1, dtype=torch.int64)
    if order is None:
        ids = torch.arange(1, loaded.shape[0] + 1, dtype=torch.int64).view(-1, 1)
    else:
        ids = torch.from_numpy(order + 1).view(-1, 1)  # (the stored rows stay in the map, read in this order)
    _through(weight_loader, index, ids, None, shard_id)
    source = loaded
    if loaded.shape[1] != width or loaded.stride(1) != 1:
        source = torch.zeros(rows, width, dtype=torch.uint8)
        _through(weight_loader, source, loaded if order is None else loaded[torch.from_numpy(order)], 1, shard_id)
        index = torch.where(index > 0, torch.arange(1, rows + 1).view(-1, 1), 0)
    layer.gguf_staged.append(_Part(name, index.view(-1).numpy(), source, getattr(loaded, GGUF_TENSOR, "")))


def _through(weight_loader, target: torch.Tensor, source: torch.Tensor, input_dim: int | None, shard_id) -> None:
    """The layer's loader copying source into target as it would into its weight."""
    staged = nn.Parameter(target, requires_grad=False)
    set_weight_attrs(staged, output_dim=0, input_dim=input_dim)
    weight_loader(staged, source, shard_id)


def _spans(layer: nn.Module) -> list[tuple[str, int, int]]:
    """The layer's rows as consecutive spans [start, end) of one type each: rows no part filled (a padded
    vocabulary's) join the span before them as zero blocks (a zero scale: zero weights)."""
    staged = layer.gguf_staged
    if not staged:
        raise ValueError("a GGUF-typed layer got no blocks")
    names = list(dict.fromkeys(p.name for p in staged))
    owner = np.zeros(layer.weight.shape[0], dtype=np.int64)  # 1 + the type's index; 0: no part filled
    for part in staged:
        mine = part.index > 0
        taken = owner[mine]
        if taken.any():
            raise ValueError(f"rows loaded twice, as {names[int(taken.max()) - 1]} and {part.name}")
        owner[mine] = names.index(part.name) + 1
    filled_at = np.flatnonzero(owner)
    # An unfilled row takes the type of the filled row before it (the first filled row's, at the top).
    if len(filled_at) < len(owner):
        before = np.searchsorted(filled_at, np.arange(len(owner)), side="right").clip(min=1) - 1
        owner = owner[filled_at[before]]
    edges = [0, *(np.flatnonzero(owner[1:] != owner[:-1]) + 1).tolist(), len(owner)]
    return [(names[int(owner[start]) - 1], start, end) for start, end in zip(edges[:-1], edges[1:])]


def _addresses(layer: nn.Module, name: str, start: int, end: int) -> np.ndarray:
    """int64 [end - start]: the address of each row's stored blocks (0 where no part of this type filled it)."""
    out = np.zeros(end - start, dtype=np.int64)
    for part in layer.gguf_staged:
        if part.name != name:
            continue
        index = part.index[start:end]
        mine = index > 0
        out[mine] = part.source.data_ptr() + (index[mine] - 1) * part.source.stride(0)
    return out


def _rows(layer: nn.Module, name: str, start: int, end: int) -> np.ndarray:
    """uint8 [end - start, bytes per row]: the rows' stored blocks, copied (zero where no part filled a row)."""
    t = qt.TYPES[name]
    out = np.zeros((end - start, layer.in_features // t.block * t.nbytes), dtype=np.uint8)
    for part in layer.gguf_staged:
        if part.name != name:
            continue
        index = part.index[start:end]
        mine = np.nonzero(index > 0)[0]
        out[mine] = part.source.numpy()[index[mine] - 1]
    return out


def _segments(layer: nn.Module) -> list[tuple[str, qt.Blocks]]:
    """The layer's spans of one type each, decoded to the common form."""
    return [(name, qt.decode(name, _rows(layer, name, start, end))) for name, start, end in _spans(layer)]


def _checked_segments(layer: nn.Module) -> list[tuple[str, qt.Blocks]]:
    """_segments, after _check_finite."""
    _check_finite(layer)
    return _segments(layer)


def _check_finite(layer: nn.Module, types: set[str] | None = None) -> None:
    """GgufError naming the first staged tensor (of these types; None: any) holding a block whose fp16 scale is
    not finite (gguf_weights.py leaves the check of a GGUF-typed layer's blocks to it: the C packing makes it in
    its own pass, this for every other path)."""
    for part in layer.gguf_staged:
        if (types is None or part.name in types) and not qt.finite(part.name, part.source.numpy()):
            raise GgufError(f"tensor {part.tensor or '?'}: holds values that are not finite (corrupt file?)")


def _by_kernel(spans: list[tuple[str, int, int]]) -> list[tuple[str, list[tuple[str, int, int]]]]:
    """Consecutive spans grouped by their type's kernel."""
    runs: list[tuple[str, list]] = []
    for span in spans:
        kernel = qt.TYPES[span[0]].kernel
        if runs and runs[-1][0] == kernel:
            runs[-1][1].append(span)
        else:
            runs.append((kernel, [span]))
    return runs


# On CUDA the Triton products (a quarter to a half of bf16's bytes on the device) still run slower than the dense
# dequantized weight (scripts/bench_gguf_cuda.py, docs/performance.md), so they are taken only when asked for:
# METRALE_GGUF_CUDA=triton keeps the file's blocks on the device (for a model whose bf16 weights do not fit).
GGUF_CUDA_ENV = "METRALE_GGUF_CUDA"  # dense (default) | triton


def _triton_runs(segments: list[tuple[str, qt.Blocks]], device: torch.device) -> list[_Run] | None:
    """One Triton product per segment, its blocks dequantized in registers (triton_gguf.py), when
    METRALE_GGUF_CUDA=triton; None otherwise, or where triton does not import (the dense weight then)."""
    choice = os.environ.get(GGUF_CUDA_ENV, "dense").strip().lower() or "dense"
    if choice not in ("dense", "triton"):
        raise ValueError(f"{GGUF_CUDA_ENV} must be dense or triton (got {choice!r})")
    if choice != "triton":
        return None
    try:
        from metrale.gpu_worker.layers import triton_gguf
    except ImportError:
        return None
    return [_Run(b.codes.shape[0], partial(triton_gguf.product, triton_gguf.pack_for_triton(b, device))) for _, b in segments]


def _run(layer: nn.Module, kernel: str, spans: list[tuple[str, int, int]]) -> _Run:
    """One product over spans stacked by rows, packed for its kernel (from the stored blocks where gguf_repack
    decodes their types, else through the common form), on the class dispatch measured fastest for its shape."""
    cols = layer.in_features
    rows = sum(end - start for _, start, end in spans)
    try:
        packed = gguf_repack.from_stored(kernel, [(name, _addresses(layer, name, start, end)) for name, start, end in spans], cols)
    except gguf_repack.NonFiniteScales:
        _check_finite(layer)  # names the tensor
        raise GgufError(f"a tensor of {kernel} layer rows holds values that are not finite (corrupt file?)") from None
    if packed is None:
        _check_finite(layer, {name for name, _, _ in spans})
        parts = [(name, qt.decode(name, _rows(layer, name, start, end))) for name, start, end in spans]
        if kernel == "int8":
            packed = qt.pack_int8_parts(parts)
        elif kernel == "int4":
            packed = qt.int4_pack(parts)
        elif kernel == "int5":
            packed = qt.pack_int5(parts)
        else:
            packed = qt.pack_kq8(qt.merged([b for _, b in parts]))
    return _Run(rows, native_product(f"{kernel}_linear", tuple(packed), rows, cols, True, layer.wide))


def load_tied_head(head: nn.Module, raw: torch.Tensor, method: GgufLinearMethod, dtype: torch.dtype) -> None:
    """Give a tied LM head (loaded as dense, sharing the embedding table) its own copy of the table's blocks
    as the file stores them (raw, tagged with its type), answering in dtype (the model's: the table it shares
    may be the file's blocks themselves, layers/gguf_embedding.py)."""
    head.quant_method = method
    head.shares_weight = False
    head.packed = None
    method.create_weights(
        head, raw_columns(raw), [head.rows_per_rank], dtype=dtype, device=head.weight.device,
        weight_loader=head.weight_loader,
    )
    head.weight.weight_loader(head.weight, raw)
    method.process_weights_after_loading(head)


def raw_columns(raw: torch.Tensor) -> int:
    """The input features of a raw tensor of GGUF blocks."""
    t = qt.TYPES[getattr(raw, GGUF_TYPE)]
    return raw.shape[1] // t.nbytes * t.block


def tagged(values: np.ndarray, name: str, tensor_name: str = "", rows: np.ndarray | None = None) -> torch.Tensor:
    """A raw tensor of GGUF blocks tagged with its type's name (what GgufLinearMethod's loader takes), the file's
    name for it (for errors) and, where its rows are not in the order the model reads them, the stored row each
    of its rows is (GGUF_ROWS)."""
    with warnings.catch_warnings():  # the file's read-only pages: the loader only reads them, into its staging rows
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(np.ascontiguousarray(values))
    setattr(tensor, GGUF_TYPE, name)
    setattr(tensor, GGUF_TENSOR, tensor_name)
    setattr(tensor, GGUF_ROWS, rows)
    return tensor

