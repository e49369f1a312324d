"""llama.cpp's tensor names as transformers' names, per architecture, and the tensor transforms llama.cpp's converter
applies that a loader must undo.

What the converter (convert_hf_to_gguf.py) does that is undone here:
- Llama (and Mistral, Mixtral, written as `llama`) q/k rows are permuted so that llama.cpp's rotary can rotate
  adjacent pairs; ours (like transformers') rotates the two halves of each head, so those rows are permuted back,
  as transformers' GGUF loader does. Every other family here is written unpermuted (llama.cpp's NEOX rotary).
- Gemma's norms (scale 1 + w) are stored as 1 + w; the loader subtracts 1 again (transformers' Gemma2TensorProcessor).
- Mixture-of-experts tensors are stored stacked, `blk.N.ffn_{gate,up,down}_exps` [n_expert, rows, cols]; they are
  split back into one tensor per expert under transformers' per-expert names.
- The per-dimension rotary factors (`rope_freqs`, Phi-3's `rope_factors_long/short`) are rope settings, read by
  metrale.gguf_metadata into the config, not weights.

The names differ by family: `post_attention_layernorm` is llama.cpp's `ffn_norm` in Llama but its
`post_attention_norm` in Gemma and OLMo 2; Phi-3's fused `ffn_up` is gate and up together. gguf_export.py uses
the same tables the other way round.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

# Tensors that hold rope settings (read by gguf_metadata), not weights.
ROPE_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})

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
    "ffn_gate_inp": "mlp.gate",  # the router (Mixtral's block_sparse_moe.gate loads as mlp.gate too)
    # Stacked experts: split per expert by checkpoint_tensors.
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_GEMMA = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Each family's names where they differ from Llama's (None: llama.cpp's name has no meaning there).
_FAMILY = {
    "gemma2": _GEMMA,
    "gemma3": _GEMMA,
    "olmo2": {
        "attn_norm": None,
        "ffn_norm": None,
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# Families whose norms llama.cpp stores as 1 + w.
_NORM_PLUS_ONE = ("gemma2", "gemma3")
_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")
# Mixtral files written before llama.cpp stacked experts (still read by llama.cpp): blk.N.ffn_gate.E.weight.
_ONE_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
_STACKED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.weight")


def block_names(arch: str) -> dict[str, str]:
    """llama.cpp's per-block tensor names -> transformers' (after `model.layers.N.`) for the GGUF architecture arch."""
    table = {**_BLOCK, **_FAMILY.get(arch, {})}
    return {k: v for k, v in table.items() if v is not None}


def top_names() -> dict[str, str]:
    """llama.cpp's names of the tensors outside the blocks -> transformers'."""
    return dict(_TOP)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """transformers' name of a llama.cpp tensor name in a file of GGUF architecture arch, or None for a tensor
    this family does not have. Stacked experts get a name ending `.experts.gate_proj.weight` (split by
    checkpoint_tensors)."""
    m = _NAME.fullmatch(gguf_name)
    if m is None:
        one = _ONE_EXPERT.fullmatch(gguf_name)
        return f"model.layers.{one[1]}.mlp.experts.{one[3]}.{one[2]}_proj.weight" if one else None
    block, base, kind = m.groups()
    if block is None:
        return f"{_TOP[base]}.{kind}" if base in _TOP else None
    table = block_names(arch)
    return f"model.layers.{block}.{table[base]}.{kind}" if base in table else None


def checkpoint_tensors(name: str, values: np.ndarray, arch: str) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint tensors one GGUF tensor (already under its transformers name, q/k rows unpermuted) stands for:
    itself, a Gemma norm less the 1 the converter added, or each expert's slice of a stacked expert tensor."""
    if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
        yield name, values - np.float32(1.0)
        return
    m = _STACKED_EXPERTS.fullmatch(name)
    if m is None:
        yield name, values
        return
    prefix, proj = m.groups()
    for e in range(values.shape[0]):
        yield f"{prefix}.{e}.{proj}.weight", values[e]


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, rows (2i, 2i+1) go back to (i, i + head_dim/2)."""
    per_head = rows.shape[0] // heads
    return np.ascontiguousarray(rows.reshape(heads, per_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2)).reshape(rows.shape)
