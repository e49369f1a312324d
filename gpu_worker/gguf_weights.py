"""A GGUF file's tensors as Hugging Face checkpoint tensors: (name, tensor) pairs for the model's weight loaders.

Names come from gguf_names.py (llama.cpp's to transformers', and the Llama q/k row permutation undone). The file
stays memory-mapped read-only (gguf_metadata.open_gguf, one map per process) and nothing is read into memory up
front: a float tensor (F32, F16, BF16) comes as a torch view of the map in its stored dtype (`mapped` says so), so
a parameter of that dtype and shape can use the file's pages in place (loader.py); every other tensor type is
dequantized to float32 (the types with a row in layers/gguf_quant_types.py's table by its numpy decoder, bit for
bit gguf's own; the rest by gguf's). A value that is not finite is a GgufError naming the tensor.

A linear layer whose every part has a row in layers/gguf_quant_types.py's table (Q8_0, Q5_0, Q4_0, Q4_1, Q4_K,
Q5_1, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS) stays quantized: `gguf_layer_kinds` names the kernel each layer
runs on, and for a layer the model built with layers/gguf_linear.py's `GgufLinearMethod` (`wants_blocks`; also
the token embedding read in place, layers/gguf_embedding.py) its tensors come as the file stores them, uint8
rows of blocks tagged with their type (views of the map; q/k rows tagged with the order that undoes llama.cpp's
permutation, which the layer reads them in). For `Int4LinearMethod(codes=True)` (`wants_codes`: --quantization int4 of a 4-bit file) a Q4_0 / Q4_1 / Q4_K
tensor comes as `.qweight` (codes), `.scales` and `.zeros` instead of `.weight`, read off its blocks.
`release_pages` drops the map's pages from the process's resident set once the model is loaded.
"""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from metrale.gguf_metadata import GgufError, field, open_gguf
from metrale.gpu_worker.gguf_names import _NORM_PLUS_ONE, ROPE_TENSORS, checkpoint_tensors, hf_name, unpermute_rows
from metrale.gpu_worker.layers import gguf_quant_types
from metrale.gpu_worker.layers.gguf_linear import tagged


def gguf_tensors(
    path: str | Path, config: dict, wants_codes: Callable[[str], bool] = lambda name: False,
    wants_blocks: Callable[[str], bool] = lambda name: False, checks_blocks: Callable[[str], bool] = lambda name: False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the GGUF file at path under its transformers name: a float tensor as stored (a view of the
    map), any other dequantized to float32; where wants_blocks(name) and its type has a table row, its raw blocks
    tagged with the type; where wants_codes(name) and the tensor is 4-bit, its codes, scales and offsets (see
    the module docstring). Raw blocks are checked for non-finite scales here, except where checks_blocks(name):
    the layer taking them checks (layers/gguf_linear.py, in its packing's own pass).

    config is the file's config dict (metrale.gguf_metadata.hf_config); GgufError names the tensor at fault.
    """
    reader = open_gguf(path)
    arch = config.get("gguf", {}).get("architecture", "llama")
    permuted = arch == "llama"
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    for tensor in reader.tensors:
        if tensor.name in ROPE_TENSORS:
            continue  # rope settings, in the config already (gguf_metadata)
        name = hf_name(tensor.name, arch)
        if name is None:
            raise GgufError(f"tensor {tensor.name}: not a tensor of a {config['architectures'][0]} (unknown name)")
        rows_heads = heads if ".self_attn.q_proj." in name else kv_heads if ".self_attn.k_proj." in name else 0
        qtype = gguf_quant_types.TYPES.get(tensor.tensor_type.name)
        bf16 = raw = False
        if wants_blocks(name) and qtype is not None:
            raw = True
            if not checks_blocks(name) and not gguf_quant_types.finite(qtype.name, np.asarray(tensor.data)):
                raise GgufError(f"tensor {tensor.name}: holds values that are not finite (corrupt file?)")
            parts = [("", np.asarray(tensor.data))]
            base = name
        elif wants_codes(name) and qtype is not None and qtype.kernel == "int4":
            parts = zip((".qweight", ".scales", ".zeros"), int4_codes(tensor))
            base = name.rsplit(".", 1)[0]
        else:
            values = _stored_floats(tensor)
            if values is None:
                values = _dequantized(tensor)
            elif tensor.tensor_type.name == "BF16":
                bf16 = not _bf16_widened(name, arch)
                values = values if bf16 else _bf16_to_f32(values)
            parts = [("", values)]
            base = name
        for suffix, values in parts:
            order = None
            if permuted and rows_heads and raw:
                order = unpermute_rows(np.arange(len(values)), rows_heads)  # the layer reads the stored rows so
            elif permuted and rows_heads:
                values = unpermute_rows(values, rows_heads)
            for hf, part in checkpoint_tensors(base + suffix, values, arch):
                if part.dtype == np.uint8 and not suffix:
                    yield hf, tagged(part, qtype.name, tensor.name, order)
                else:
                    yield hf, _torch(part, bf16)


def _torch(values: np.ndarray, bf16: bool) -> torch.Tensor:
    """values as a torch tensor sharing their memory (the map's read-only pages: loaders only read them, and
    loader.py's in-place use never writes them); bf16: values are bfloat16 bits (uint16)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's note on a non-writable array
        tensor = torch.from_numpy(values)
    return tensor.view(torch.bfloat16) if bf16 else tensor


def mapped(tensor: torch.Tensor, path: str | Path) -> bool:
    """True when tensor's memory lies inside the GGUF file's map (a view of its stored bytes)."""
    data = open_gguf(path).data
    start = data.ctypes.data
    return tensor.device.type == "cpu" and start <= tensor.data_ptr() < start + data.nbytes


def release_pages(path: str | Path) -> int:
    """Drop the map's pages from this process's resident set once the model is loaded (every page was read to
    check or repack it; the model reads few of them in place, and those fault back in from the page cache on
    their first use, as an mmap'd llama.cpp's do). The bytes released (0 where madvise is not available)."""
    data = open_gguf(path).data
    mm = getattr(data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    mm.madvise(mmap.MADV_DONTNEED, 0, len(mm))
    return len(mm)


def gguf_layer_kinds(path: str | Path, layer_of: Callable[[str], str]) -> dict[str, str | None]:
    """The kernel each linear layer's stored blocks run on (gguf_quant_types.kernel_of: "int8", "int4" or "kq8")
    when every part's type has a row in the table, else None (dense). layer_of maps a transformers tensor name
    to its layer's prefix (q/k/v_proj to the stacked qkv_proj ...)."""
    types: dict[str, set[str]] = {}
    reader = open_gguf(path)
    arch = field(reader, "general.architecture", "llama")  # names differ by family (Phi-3's fused attn_qkv ...)
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is not None and name.endswith(".weight"):
            types.setdefault(layer_of(name), set()).add(tensor.tensor_type.name)
    return {layer: _kind(found) for layer, found in types.items()}


def _kind(types: Iterable[str]) -> str | None:
    """The kernel for the set of tensor types one layer's parts are stored as; None (dense) when one lacks a row."""
    found = sorted(types)
    if not all(t in gguf_quant_types.TYPES for t in found):
        return None
    return gguf_quant_types.kernel_of(found)


def gguf_blocks(path: str | Path, name: str) -> torch.Tensor | None:
    """The raw blocks of the tensor stored under transformers name `name` (tagged with its type; a view of the
    map), or None when it is absent or its type has no table row (a tied LM head's copy of the embedding)."""
    reader = open_gguf(path)
    arch = field(reader, "general.architecture", "llama")
    for tensor in reader.tensors:
        if hf_name(tensor.name, arch) == name and tensor.tensor_type.name in gguf_quant_types.TYPES:
            return tagged(np.asarray(tensor.data), tensor.tensor_type.name, tensor.name)
    return None


_FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _stored_floats(tensor) -> np.ndarray | None:
    """A float tensor's values as stored (a read-only view of the map; BF16 as its uint16 bits), or None for a
    quantized type; GgufError naming it when one is not finite."""
    dtype = _FLOATS.get(tensor.tensor_type.name)
    if dtype is None:
        return None
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    values = np.asarray(tensor.data).view(dtype).reshape(shape)
    if dtype is np.uint16:
        finite = not ((values & 0x7F80) == 0x7F80).any()  # exponent all ones: inf or NaN
    else:
        finite = bool(np.isfinite(values).all())
    if not finite:
        raise GgufError(f"tensor {tensor.name}: holds values that are not finite (corrupt file?)")
    return values


def _bf16_widened(name: str, arch: str) -> bool:
    """True for a BF16 tensor gguf_names.checkpoint_tensors computes with (a Gemma norm less one): as float32."""
    return arch in _NORM_PLUS_ONE and name.endswith("norm.weight")


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) as float32 values (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _dequantized(tensor) -> np.ndarray:
    """A quantized tensor as float32 [rows, cols] (a fresh array): by its table row's decoder where it has one,
    else gguf's; GgufError naming it when it cannot be, or holds NaN/inf."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    name = tensor.tensor_type.name
    try:
        if name in gguf_quant_types.TYPES:
            raw = np.asarray(tensor.data)
            values = gguf_quant_types.dequantize(gguf_quant_types.decode(name, raw.reshape(-1, raw.shape[-1]))).numpy()
            values = values.reshape(tuple(int(n) for n in reversed(tensor.shape.tolist())))
        else:
            values = np.array(dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type)), dtype=np.float32)
    except (NotImplementedError, ValueError) as e:
        raise GgufError(f"tensor {tensor.name}: cannot dequantize {name} ({e})") from None
    if not np.isfinite(values).all():
        raise GgufError(f"tensor {tensor.name}: holds values that are not finite (corrupt file?)")
    return values


def int4_codes(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 / Q4_K tensor as (codes uint8 [rows, cols], scales, offsets float32 [rows, cols / 32]),
    each group of 32 being scale * code + offset, read off its blocks (gguf_quant_types)."""
    name = tensor.tensor_type.name
    blocks = gguf_quant_types.decode(name, np.asarray(tensor.data))
    q, s, z = gguf_quant_types.as_int4(blocks, gguf_quant_types.TYPES[name].code_bias)
    return q.numpy(), s.numpy(), z.numpy()
