"""A GGUF file's tensors as Hugging Face checkpoint tensors: (name, tensor) pairs for the model's weight loaders.

Names come from gguf_names.py (llama.cpp's to transformers', and the Llama q/k row permutation undone). Every
tensor type the `gguf` package can dequantize loads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32
and more), dequantized to float32 in numpy; a value that is not finite is a GgufError naming the tensor.

A linear layer whose every part has a row in layers/gguf_quant_types.py's table (Q8_0, Q5_0, Q4_0, Q4_1, Q4_K,
Q5_1, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS) stays quantized: `gguf_layer_kinds` names the kernel each layer
runs on, and for a layer the model built with layers/gguf_linear.py's `GgufLinearMethod` (`wants_blocks`) its
tensors come as the file stores them, uint8 rows of blocks tagged with their type. For
`Int4LinearMethod(codes=True)` (`wants_codes`: --quantization int4 of a 4-bit file) a Q4_0 / Q4_1 / Q4_K
tensor comes as `.qweight` (codes), `.scales` and `.zeros` instead of `.weight`, read off its blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from metrale.gguf_metadata import GgufError, field, open_gguf
from metrale.gpu_worker.gguf_names import ROPE_TENSORS, checkpoint_tensors, hf_name, unpermute_rows
from metrale.gpu_worker.layers import gguf_quant_types
from metrale.gpu_worker.layers.gguf_linear import tagged


def gguf_tensors(
    path: str | Path, config: dict, wants_codes: Callable[[str], bool] = lambda name: False,
    wants_blocks: Callable[[str], bool] = lambda name: False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the GGUF file at path under its transformers name: dequantized to float32; where
    wants_blocks(name) and its type has a table row, its raw blocks tagged with the type; where wants_codes(name)
    and the tensor is 4-bit, its codes, scales and offsets (see the module docstring).

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
        if wants_blocks(name) and qtype is not None:
            if not gguf_quant_types.finite(qtype.name, np.asarray(tensor.data)):
                raise GgufError(f"tensor {tensor.name}: holds values that are not finite (corrupt file?)")
            parts = [("", np.asarray(tensor.data))]
            base = name
        elif wants_codes(name) and qtype is not None and qtype.kernel == "int4":
            parts = zip((".qweight", ".scales", ".zeros"), int4_codes(tensor))
            base = name.rsplit(".", 1)[0]
        else:
            parts = [("", _dequantized(tensor))]
            base = name
        for suffix, values in parts:
            if permuted and rows_heads:
                values = unpermute_rows(values, rows_heads)
            for hf, part in checkpoint_tensors(base + suffix, values, arch):
                yield hf, tagged(part, qtype.name) if part.dtype == np.uint8 and not suffix else torch.from_numpy(part)


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
    """The raw blocks of the tensor stored under transformers name `name` (tagged with its type), or None when
    it is absent or its type has no table row (a tied LM head's copy of the embedding)."""
    reader = open_gguf(path)
    arch = field(reader, "general.architecture", "llama")
    for tensor in reader.tensors:
        if hf_name(tensor.name, arch) == name and tensor.tensor_type.name in gguf_quant_types.TYPES:
            return tagged(np.array(tensor.data), tensor.tensor_type.name)
    return None


def _dequantized(tensor) -> np.ndarray:
    """A tensor as float32 [rows, cols] (a fresh array); GgufError naming it when it cannot be, or holds NaN/inf."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        values = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
    except (NotImplementedError, ValueError) as e:
        raise GgufError(f"tensor {tensor.name}: cannot dequantize {tensor.tensor_type.name} ({e})") from None
    values = np.array(values, dtype=np.float32)  # a copy: an F32 tensor is a read-only view of the file
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
