"""OLMo 2: norms after attention and after the MLP (none before), q and k each normed over the whole
projection, and RMSNorm's weight applied in float32 before rounding."""

from __future__ import annotations

from torch import nn

from metrale.gpu_worker.layers.rope_scaling import RopeConfig
from metrale.gpu_worker.models.context import ModelContext
from metrale.gpu_worker.models.decoder import DecoderLM, DecoderShape, GatedMLP, NormStyle, SelfAttention

OLMO_NORM = NormStyle(scale_in_float32=True)


class Olmo2DecoderLayer(nn.Module):
    """h += post_attention_norm(attention(h)); h += post_feedforward_norm(mlp(h))."""

    def __init__(self, ctx: ModelContext, layer: int, shape: DecoderShape, cfg: dict):
        """Allocate the layer's attention (with its whole-projection q/k norms), MLP and two norms."""
        super().__init__()
        prefix = f"model.layers.{layer}"
        bias = bool(cfg.get("attention_bias", False))
        self.self_attn = SelfAttention(
            ctx, f"{prefix}.self_attn", layer, shape, window=ctx.facts.layer_windows[layer],
            qkv_bias=bias, o_bias=bias, qk_norm="full", norm=OLMO_NORM,
        )
        self.post_attention_layernorm = OLMO_NORM.make(ctx, shape.hidden_size, shape.rms_norm_eps)
        self.mlp = GatedMLP(ctx, f"{prefix}.mlp", shape.hidden_size, shape.intermediate_size, shape.hidden_act)
        self.post_feedforward_layernorm = OLMO_NORM.make(ctx, shape.hidden_size, shape.rms_norm_eps)

    def forward(self, h, delta, ropes, cache, meta):
        """Add the previous layer's delta into h, run this layer, return its own (post-normed) MLP output."""
        if delta is not None:
            h.add_(delta)
        h.add_(self.post_attention_layernorm(self.self_attn(h, ropes, cache, meta)))
        return self.post_feedforward_layernorm(self.mlp(h))


class Olmo2ForCausalLM(DecoderLM):
    """OLMo 2 checkpoints."""

    def __init__(self, ctx: ModelContext):
        """Build the decoder from config.json."""
        cfg = ctx.config
        shape = DecoderShape.from_config(cfg)
        super().__init__(
            ctx, shape, lambda i: Olmo2DecoderLayer(ctx, i, shape, cfg), norm=OLMO_NORM,
            rotaries=[RopeConfig.from_hf(cfg, shape.head_dim)],
        )
