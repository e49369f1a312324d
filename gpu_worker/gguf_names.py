"""llama.cpp's tensor names as transformers' names, and the q/k row permutation llama.cpp's converter applies.

llama.cpp's converter permutes the rows of a Llama q/k projection so that its rotary embedding can rotate adjacent
pairs; ours (like transformers') rotates the two halves of each head, so those rows are permuted back, exactly as
transformers' GGUF loader does (Qwen files are written unpermuted). gguf_export.py uses the same tables the other
way round.
"""

from __future__ import annotations

import re

import numpy as np

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


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, rows (2i, 2i+1) go back to (i, i + head_dim/2)."""
    per_head = rows.shape[0] // heads
    return np.ascontiguousarray(rows.reshape(heads, per_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2)).reshape(rows.shape)
