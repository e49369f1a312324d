"""A GGUF file's tensors as Hugging Face checkpoint tensors: (name, tensor) pairs for the model's weight loaders.

Names are mapped from llama.cpp's (`blk.N.attn_q.weight`) to transformers' (`model.layers.N.self_attn.q_proj.weight`)
with one short table. llama.cpp's converter permutes the rows of a Llama q/k projection so that its rotary
embedding can rotate adjacent pairs; ours (like transformers') rotates the two halves of each head, so those rows
are permuted back, exactly as transformers' GGUF loader does (Qwen files are written unpermuted). Every tensor
type the `gguf` package can dequantize loads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32 and
more), dequantized to float32 in numpy; a value that is not finite is a GgufError naming the tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from metrale.gguf_metadata import GgufError, open_gguf

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """transformers' name of a llama.cpp tensor name, or None for a tensor this model family does not have."""
    m = _NAME.fullmatch(gguf_name)
    if m is None:
        return None
    block, base, kind = m.groups()
    if block is None:
        return f"{_TOP[base]}.{kind}" if base in _TOP else None
    return f"model.layers.{block}.{_BLOCK[base]}.{kind}" if base in _BLOCK else None


def gguf_tensors(path: str | Path, config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the GGUF file at path, dequantized to float32, under its transformers name.

    config is the file's config dict (metrale.gguf_metadata.hf_config); GgufError names the tensor at fault.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = open_gguf(path)
    permuted = config.get("gguf", {}).get("architecture") == "llama"
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise GgufError(f"tensor {tensor.name}: not a tensor of a {config['architectures'][0]} (unknown name)")
        try:
            values = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
        except (NotImplementedError, ValueError) as e:
            raise GgufError(f"tensor {tensor.name}: cannot dequantize {tensor.tensor_type.name} ({e})") from None
        values = np.array(values, dtype=np.float32)  # a copy: an F32 tensor is a read-only view of the file
        if not np.isfinite(values).all():
            raise GgufError(f"tensor {tensor.name}: holds values that are not finite (corrupt file?)")
        if permuted and ".self_attn.q_proj." in name:
            values = unpermute_rows(values, heads)
        elif permuted and ".self_attn.k_proj." in name:
            values = unpermute_rows(values, kv_heads)
        yield name, torch.from_numpy(values)


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, rows (2i, 2i+1) go back to (i, i + head_dim/2)."""
    per_head = rows.shape[0] // heads
    return np.ascontiguousarray(rows.reshape(heads, per_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2)).reshape(rows.shape)
