"""Phi-3 (and Phi-3.5 / Phi-4-mini, which keep its architecture name): a Llama decoder whose checkpoints store
q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`.

Those pre-fused tensors load with shard id None straight into the same stacked layers a split checkpoint
fills part by part; longrope (short and long factors, switched per row past the original length) and a
partial rotary are rotary settings (layers/rope_scaling.py), the sliding window a model fact.
"""

from __future__ import annotations

from metrale.gpu_worker.layers.rope_scaling import RopeConfig
from metrale.gpu_worker.models.context import ModelContext
from metrale.gpu_worker.models.decoder import DecoderLM, DecoderShape
from metrale.gpu_worker.models.llama import LlamaDecoderLayer, LlamaSwitches

_PHI3 = LlamaSwitches(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)


class Phi3ForCausalLM(DecoderLM):
    """Phi-3 checkpoints (pre-fused qkv_proj and gate_up_proj)."""

    def __init__(self, ctx: ModelContext):
        """Build the decoder from config.json."""
        cfg = ctx.config
        shape = DecoderShape.from_config(cfg)
        super().__init__(
            ctx, shape, lambda i: LlamaDecoderLayer(ctx, i, shape, _PHI3), rotaries=[RopeConfig.from_hf(cfg, shape.head_dim)]
        )
