"""The Llama family: Llama 2/3, Qwen2, Qwen3 and Mistral in one class.

The variants differ only in small switches read from config.json: biases on q/k/v (Qwen2), RMSNorm on
each head of q and k (Qwen3), an explicit head_dim, a sliding window (Mistral, Qwen's upper layers: a
model fact), rope scaling, tied embeddings. Pre-norm attention then pre-norm MLP, SiLU-gated.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from metrale.gpu_worker.layers.rope_scaling import RopeConfig
from metrale.gpu_worker.models.context import ModelContext
from metrale.gpu_worker.models.decoder import LLAMA_NORM, DecoderLM, DecoderShape, GatedMLP, SelfAttention


@dataclass(frozen=True, slots=True)
class LlamaSwitches:
    """Where the family's members differ, read from config.json."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_config(cls, arch: str, cfg: dict) -> LlamaSwitches:
        """The switches of architecture arch (transformers' rules for each member)."""
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            qkv_bias=True if arch == "Qwen2ForCausalLM" else (attention_bias and arch != "MistralForCausalLM"),
            o_bias=attention_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
            mlp_bias=bool(cfg.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
        )


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, each added to the residual stream."""

    def __init__(self, ctx: ModelContext, layer: int, shape: DecoderShape, sw: LlamaSwitches, mlp: nn.Module | None = None):
        """Allocate the layer's modules (mlp: another MLP in place of the gated one, e.g. a mixture of experts)."""
        super().__init__()
        prefix = f"model.layers.{layer}"
        self.input_layernorm = LLAMA_NORM.make(ctx, shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = SelfAttention(
            ctx, f"{prefix}.self_attn", layer, shape, window=ctx.facts.layer_windows[layer],
            qkv_bias=sw.qkv_bias, o_bias=sw.o_bias, qk_norm="head" if sw.qk_norm else None,
        )
        self.post_attention_layernorm = LLAMA_NORM.make(ctx, shape.hidden_size, shape.rms_norm_eps)
        self.mlp = mlp or GatedMLP(ctx, f"{prefix}.mlp", shape.hidden_size, shape.intermediate_size, shape.hidden_act, bias=sw.mlp_bias)

    def forward(self, h, delta, ropes, cache, meta):
        """Add the previous layer's output delta to the residual stream h (in place), run this layer,
        and return its own output, still to be added: each residual add is fused into the norm after it."""
        attn = self.self_attn(self.input_layernorm(h, delta), ropes, cache, meta)
        return self.mlp(self.post_attention_layernorm(h, attn))


class LlamaForCausalLM(DecoderLM):
    """Llama, Qwen2, Qwen3 and Mistral checkpoints."""

    def __init__(self, ctx: ModelContext):
        """Read the switches and build the decoder."""
        cfg = ctx.config
        shape = DecoderShape.from_config(cfg)
        sw = LlamaSwitches.from_config(ctx.facts.architecture, cfg)
        super().__init__(
            ctx, shape, lambda i: LlamaDecoderLayer(ctx, i, shape, sw), rotaries=[RopeConfig.from_hf(cfg, shape.head_dim)]
        )
