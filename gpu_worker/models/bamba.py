"""Bamba: a hybrid of Mamba 2 layers and Llama attention layers, each followed by a SiLU-gated MLP.

The layers listed in config.json's attn_layer_indices are pre-norm attention (rotary over half of each head,
config.json's partial_rotary_factor); every other layer is a pre-norm Mamba 2 mixer (layers/mamba_mixer.py)
whose conv and SSM state live in the sequence's state slot. Attention layers keep paged KV as usual, so the
model needs both. Checkpoint names: `feed_forward` for the MLP, `pre_ff_layernorm` before it,
`model.final_layernorm` for the final norm.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from metrale.gpu_worker.layers.mamba_mixer import Mamba2Mixer
from metrale.gpu_worker.layers.rope_scaling import RopeConfig
from metrale.gpu_worker.models.context import ModelContext
from metrale.gpu_worker.models.decoder import LLAMA_NORM, DecoderLM, DecoderShape, GatedMLP, SelfAttention


class BambaAttentionLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP (KV cache layer `kv_layer`)."""

    def __init__(self, ctx: ModelContext, layer: int, kv_layer: int, shape: DecoderShape, cfg: dict):
        super().__init__()
        prefix = f"model.layers.{layer}"
        bias = bool(cfg.get("attention_bias", False))
        self.input_layernorm = LLAMA_NORM.make(ctx, shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = SelfAttention(
            ctx, f"{prefix}.self_attn", kv_layer, shape, window=ctx.facts.layer_windows[layer], qkv_bias=bias, o_bias=bias,
        )
        self.pre_ff_layernorm = LLAMA_NORM.make(ctx, shape.hidden_size, shape.rms_norm_eps)
        self.feed_forward = _mlp(ctx, prefix, shape, cfg)

    def forward(self, h, delta, ropes, cache, meta, state):
        """Add the previous layer's delta into h, run this layer, return its own output (still to be added)."""
        attn = self.self_attn(self.input_layernorm(h, delta), ropes, cache, meta)
        return self.feed_forward(self.pre_ff_layernorm(h, attn))


class BambaMambaLayer(nn.Module):
    """Pre-norm Mamba 2 mixer then pre-norm MLP (state layer `state_layer` of each slot)."""

    def __init__(self, ctx: ModelContext, layer: int, state_layer: int, shape: DecoderShape, cfg: dict):
        super().__init__()
        prefix = f"model.layers.{layer}"
        heads = int(cfg["mamba_n_heads"])
        expand = int(cfg.get("mamba_expand", 2))
        head_dim = cfg.get("mamba_d_head")
        head_dim = expand * shape.hidden_size // heads if head_dim in (None, "auto") else int(head_dim)
        limit = cfg.get("time_step_limit") or (0.0, math.inf)
        self.input_layernorm = LLAMA_NORM.make(ctx, shape.hidden_size, shape.rms_norm_eps)
        self.mamba = Mamba2Mixer(
            ctx, f"{prefix}.mamba", state_layer, hidden_size=shape.hidden_size, num_heads=heads, head_dim=head_dim,
            state_size=int(cfg.get("mamba_d_state", 256)), n_groups=int(cfg.get("mamba_n_groups", 1)),
            conv_kernel=int(cfg.get("mamba_d_conv", 4)), chunk_size=int(cfg.get("mamba_chunk_size", 256)),
            eps=shape.rms_norm_eps, conv_bias=bool(cfg.get("mamba_conv_bias", True)),
            proj_bias=bool(cfg.get("mamba_proj_bias", False)), time_step_limit=(_number(limit[0]), _number(limit[1])),
        )
        self.pre_ff_layernorm = LLAMA_NORM.make(ctx, shape.hidden_size, shape.rms_norm_eps)
        self.feed_forward = _mlp(ctx, prefix, shape, cfg)

    def forward(self, h, delta, ropes, cache, meta, state):
        """As BambaAttentionLayer.forward, with the mixer in place of attention."""
        mixed = self.mamba(self.input_layernorm(h, delta), state)
        return self.feed_forward(self.pre_ff_layernorm(h, mixed))


def _number(value) -> float:
    """A float of config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _mlp(ctx: ModelContext, prefix: str, shape: DecoderShape, cfg: dict) -> GatedMLP:
    return GatedMLP(
        ctx, f"{prefix}.feed_forward", shape.hidden_size, shape.intermediate_size, shape.hidden_act,
        bias=bool(cfg.get("mlp_bias", False)),
    )


class BambaForCausalLM(DecoderLM):
    """Bamba checkpoints (BambaForCausalLM)."""

    def __init__(self, ctx: ModelContext):
        """Place attention and Mamba layers as attn_layer_indices says; the state slots hold the Mamba layers'."""
        cfg = ctx.config
        shape = DecoderShape.from_config(cfg)
        attention = set(cfg.get("attn_layer_indices") or ())
        kinds = ["attention" if i in attention else "mamba" for i in range(shape.num_layers)]
        index = {i: kinds[:i].count(kinds[i]) for i in range(shape.num_layers)}  # place among layers of its kind

        def make_layer(i: int) -> nn.Module:
            cls = BambaAttentionLayer if kinds[i] == "attention" else BambaMambaLayer
            return cls(ctx, i, index[i], shape, cfg)

        super().__init__(ctx, shape, make_layer, rotaries=[RopeConfig.from_hf(cfg, shape.head_dim)])
        mixers = [layer.mamba for layer in self.model.layers if isinstance(layer, BambaMambaLayer)]
        self.state_shape = mixers[0].state_shape(len(mixers)) if mixers else None

    @torch.inference_mode()
    def forward(self, input_ids, positions, cache, meta, token_seq_lens=None, state=None):
        """Hidden states [T, hidden] before the final norm; fills the KV cache and advances the state slots."""
        ropes = [r.for_step(positions, token_seq_lens, self.ctx.native) for r in self.rotaries]
        h = self.model.embed_tokens(input_ids)
        delta = None
        for layer in self.model.layers:
            delta = layer(h, delta, ropes, cache, meta, state)
        return h.add_(delta)

    def checkpoint_target(self, name: str):
        """The final norm is `model.final_layernorm` in Bamba checkpoints."""
        if name.startswith("model.final_layernorm."):
            name = "model.norm." + name.removeprefix("model.final_layernorm.")
        return super().checkpoint_target(name)
