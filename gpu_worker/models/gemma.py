"""The Gemma family: Gemma 2 and Gemma 3 (text).

Both: RMSNorm scaling by (1 + w) in float32, a norm before and after each of attention and the MLP (the
post-norms' outputs are what the residual adds), GELU-tanh gating, embeddings scaled by sqrt(hidden), tied
LM head, query scale query_pre_attn_scalar^-0.5, sliding and global layers alternating (the windows are
model facts). Gemma 2 soft-caps the attention logits (those layers attend on the torch path) and the final
logits; Gemma 3 norms q and k per head and gives sliding and global layers their own rotary (local base
frequency, and the global one's scaling).
"""

from __future__ import annotations

from torch import nn

from metrale.gpu_worker.layers.rope_scaling import RopeConfig
from metrale.gpu_worker.models.context import ModelContext
from metrale.gpu_worker.models.decoder import DecoderLM, DecoderShape, GatedMLP, NormStyle, SelfAttention

GEMMA_NORM = NormStyle(offset=1.0)
_GLOBAL, _LOCAL = 0, 1  # rotary indices: full-attention layers, sliding layers (Gemma 3)


class GemmaDecoderLayer(nn.Module):
    """input norm -> attention -> post-attention norm, + residual; pre-MLP norm -> MLP -> post-MLP norm, + residual."""

    def __init__(self, ctx: ModelContext, layer: int, shape: DecoderShape, cfg: dict, *, qk_norm: bool, rope_index: int):
        """Allocate the layer's four norms, attention and MLP."""
        super().__init__()
        prefix = f"model.layers.{layer}"
        make = lambda: GEMMA_NORM.make(ctx, shape.hidden_size, shape.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = make(), make()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = make(), make()
        bias = bool(cfg.get("attention_bias", False))
        self.self_attn = SelfAttention(
            ctx, f"{prefix}.self_attn", layer, shape, window=ctx.facts.layer_windows[layer], qkv_bias=bias, o_bias=bias,
            qk_norm="head" if qk_norm else None, norm=GEMMA_NORM,
            scale=float(cfg.get("query_pre_attn_scalar") or shape.head_dim) ** -0.5,
            softcap=cfg.get("attn_logit_softcapping"), rope_index=rope_index,
        )
        self.mlp = GatedMLP(ctx, f"{prefix}.mlp", shape.hidden_size, shape.intermediate_size, shape.hidden_act)

    def forward(self, h, delta, ropes, cache, meta):
        """Add the previous layer's delta into h, run this layer, return its own (post-normed) MLP output."""
        attn = self.post_attention_layernorm(self.self_attn(self.input_layernorm(h, delta), ropes, cache, meta))
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h, attn)))


def _shape(cfg: dict) -> DecoderShape:
    """Gemma's shape: GELU-tanh and tied embeddings unless config.json says otherwise."""
    return DecoderShape.from_config(cfg, default_act="gelu_pytorch_tanh", tie_default=True)


class Gemma2ForCausalLM(DecoderLM):
    """Gemma 2: soft-capped attention and final logits."""

    def __init__(self, ctx: ModelContext):
        """Build the decoder from config.json."""
        cfg = ctx.config
        shape = _shape(cfg)
        super().__init__(
            ctx, shape, lambda i: GemmaDecoderLayer(ctx, i, shape, cfg, qk_norm=False, rope_index=0),
            norm=GEMMA_NORM, rotaries=[RopeConfig.from_hf(cfg, shape.head_dim)],
            embed_scale=shape.hidden_size**0.5, final_softcap=cfg.get("final_logit_softcapping"),
        )


class Gemma3ForCausalLM(DecoderLM):
    """Gemma 3's text decoder: per-head q/k norms, a local and a global rotary."""

    def __init__(self, ctx: ModelContext):
        """Build the decoder from config.json; a layer's type (sliding or full) picks its rotary."""
        cfg = ctx.config
        shape = _shape(cfg)
        types = cfg.get("layer_types") or [
            "sliding_attention" if w is not None else "full_attention" for w in ctx.facts.layer_windows
        ]
        rotaries = [
            RopeConfig.from_hf(cfg, shape.head_dim, "full_attention"),
            RopeConfig.from_hf(cfg, shape.head_dim, "sliding_attention"),
        ]
        super().__init__(
            ctx, shape,
            lambda i: GemmaDecoderLayer(
                ctx, i, shape, cfg, qk_norm=True, rope_index=_LOCAL if types[i] == "sliding_attention" else _GLOBAL
            ),
            norm=GEMMA_NORM, rotaries=rotaries,
            embed_scale=shape.hidden_size**0.5, final_softcap=cfg.get("final_logit_softcapping"),
        )
