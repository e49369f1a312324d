"""Tiny random checkpoints made by transformers itself: its own config class and model, saved with save_pretrained.

For the architectures metrale does not build with gpu_worker/tiny_model.py (Gemma 2/3, Phi-3, OLMo 2, the
MoE families), the checkpoint's names, fusions and config fields are then exactly what transformers writes.
The weights are re-drawn (seeded) so that every block's output is O(1) and the logits are peaked, as
tiny_model.py does: transformers' own init (std 0.02) leaves the top tokens a rounding error apart, which
would make greedy parity a coin toss. The tokenizer and stop ids are tiny_model's.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import torch

from metrale.gpu_worker.tiny_model import BOS, EOS, PAD, SPECIAL_TOKENS, TOKENIZER_VOCAB_SIZE, write_tokenizer

HIDDEN = 64
_LOGIT_STD = 8.0

# kind -> (transformers config class, its arguments beyond the shared tiny shape)
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
    "phi3": ("Phi3Config", dict(sliding_window=None)),
    "olmo2": ("Olmo2Config", dict()),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    # Mamba 2 layers around one attention layer; 8-token scan chunks, so prompts cross chunk boundaries.
    "bamba": (
        "BambaConfig",
        dict(
            num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
            mamba_chunk_size=8,
        ),
    ),
}

_SHARED = dict(
    vocab_size=TOKENIZER_VOCAB_SIZE,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=SPECIAL_TOKENS.index(PAD),
    bos_token_id=SPECIAL_TOKENS.index(BOS),
    eos_token_id=SPECIAL_TOKENS.index(EOS),
)


def make_hf_model(out_dir: str | pathlib.Path, kind: str, *, seed: int = 0, tokenizer=None, **overrides) -> pathlib.Path:
    """Save a random transformers model of `kind` (KINDS), with overrides of its config, into out_dir."""
    import transformers

    config_class, extra = KINDS[kind]
    config = getattr(transformers, config_class)(**{**_SHARED, **extra, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config)
    _redraw(model, seed, gemma_norms=kind.startswith("gemma"))
    out = pathlib.Path(out_dir)
    model.save_pretrained(out)
    write_tokenizer(out, tokenizer, model_max_length=config.max_position_embeddings)
    return out


@torch.no_grad()
def _redraw(model, seed: int, *, gemma_norms: bool) -> None:
    """Re-draw every parameter: norms near 1 (Gemma's stored w near 0: its scale is 1 + w), biases small,
    matrices with std 1/sqrt(fan_in) (q, k and the router twice that), the LM head for logits of std 8; a Mamba
    layer's decays spread from fast to slow and its time steps near softplus(-1)."""
    gen = torch.Generator().manual_seed(seed)
    tied = model.config.tie_word_embeddings
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("A_log"):  # decays exp(-dt * A) from fast to slow: some heads remember far back
            p.copy_(torch.linspace(math.log(0.05), 0.0, p.shape[0]))
        elif name.endswith("dt_bias"):  # time steps near softplus(-1)
            p.copy_(-1.0 + 0.1 * noise)
        elif p.dim() == 1:
            base = (0.0 if gemma_norms else 1.0) if "norm" in name else 0.0
            p.copy_(base + 0.1 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise * (_LOGIT_STD / math.sqrt(HIDDEN) if tied else 1.0))
        elif "lm_head" in name:
            p.copy_(noise * _LOGIT_STD / math.sqrt(HIDDEN))
        else:
            boost = 2.0 if any(s in name for s in ("q_proj", "k_proj", "qkv_proj", "mlp.gate.", "router")) else 1.0
            p.copy_(noise * boost / math.sqrt(p.shape[-1]))
