"""A GGUF file's tensors as Hugging Face checkpoint tensors: (name, tensor) pairs for the model's weight loaders.

Names come from gguf_names.py (llama.cpp's to transformers', and the Llama q/k row permutation undone). Every
tensor type the `gguf` package can dequantize loads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32
and more), dequantized to float32 in numpy; a value that is not finite is a GgufError naming the tensor.

A layer whose every part is stored in 4 bits as groups of 32 (Q4_0, Q4_1, Q4_K: each group is s * q + z with q in
0..15) can keep its codes: `gguf_layer_kinds` says which layers can, and for a layer the model built with
`Int4LinearMethod(codes=True)` its tensors come as `.qweight` (codes), `.scales` and `.zeros` instead of
`.weight`. The codes are read off the blocks by gguf's own dequantizer: a block with every code set to 0 gives
z, with every code 1 gives s + z.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from metrale.gguf_metadata import GgufError, open_gguf
from metrale.gpu_worker.gguf_names import ROPE_TENSORS, checkpoint_tensors, hf_name, unpermute_rows

# The byte range of the 4-bit codes inside one block of each 4-bit type (after its scales).
_CODE_BYTES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q4_K": (16, 144)}
_INT8_TYPES = ("Q8_0",)


def gguf_tensors(
    path: str | Path, config: dict, wants_codes: Callable[[str], bool] = lambda name: False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the GGUF file at path under its transformers name: dequantized to float32, or, where
    wants_codes(name) and the tensor is 4-bit, as its codes, scales and offsets (see the module docstring).

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
        if wants_codes(name) and tensor.tensor_type.name in _CODE_BYTES:
            parts = zip((".qweight", ".scales", ".zeros"), int4_codes(tensor))
            base = name.rsplit(".", 1)[0]
        else:
            parts = [("", _dequantized(tensor))]
            base = name
        for suffix, values in parts:
            if permuted and rows_heads:
                values = unpermute_rows(values, rows_heads)
            for hf, part in checkpoint_tensors(base + suffix, values, arch):
                yield hf, torch.from_numpy(part)


def gguf_layer_kinds(path: str | Path, layer_of: Callable[[str], str]) -> dict[str, str | None]:
    """What each linear layer's tensors are stored as: "int8" when all are Q8_0, "int4" when all are 4-bit
    groups of 32 (Q4_0, Q4_1, Q4_K), else None. layer_of maps a transformers tensor name to its layer's prefix
    (q/k/v_proj to the stacked qkv_proj ...)."""
    types: dict[str, set[str]] = {}
    for tensor in open_gguf(path).tensors:
        name = hf_name(tensor.name)
        if name is not None and name.endswith(".weight"):
            types.setdefault(layer_of(name), set()).add(tensor.tensor_type.name)
    return {layer: _kind(found) for layer, found in types.items()}


def _kind(types: Iterable[str]) -> str | None:
    """int8, int4 or None (dense) for the set of tensor types one layer's parts are stored as."""
    found = set(types)
    if found <= set(_INT8_TYPES):
        return "int8"
    if found <= set(_CODE_BYTES):
        return "int4"
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
    each group of 32 being scale * code + offset."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(tensor.tensor_type)
    _, size = GGML_QUANT_SIZES[qtype]
    lo, hi = _CODE_BYTES[qtype.name]
    raw = np.asarray(tensor.data)
    blocks = raw.reshape(raw.shape[0], -1, size)
    with_codes = []
    for code in (0x00, 0x11):  # every nibble 0, then every nibble 1
        b = blocks.copy()
        b[..., lo:hi] = code
        with_codes.append(dequantize(b.reshape(raw.shape), qtype))
    values = _dequantized(tensor)
    zero, scale = with_codes[0], with_codes[1] - with_codes[0]
    codes = np.rint((values - zero) / np.where(scale == 0, 1, scale)).clip(0, 15).astype(np.uint8)
    return codes, np.ascontiguousarray(scale[:, ::32]), np.ascontiguousarray(zero[:, ::32])
