"""Mixtral: Mistral's attention with a mixture-of-experts MLP in every layer.

Routing: softmax in float32, the top num_experts_per_tok, always renormalised over them, the weights kept in
float32. Its checkpoints call the MLP `block_sparse_moe` and an expert's projections w1 (gate), w3 (up) and w2
(down); they load into the same stacked experts as transformers' names do.
"""

from __future__ import annotations

from metrale.gpu_worker.layers.activation import GatedActivation
from metrale.gpu_worker.layers.moe import SparseMoeBlock, expert_target
from metrale.gpu_worker.layers.rope_scaling import RopeConfig
from metrale.gpu_worker.models.context import ModelContext
from metrale.gpu_worker.models.decoder import DecoderLM, DecoderShape, ShardId
from metrale.gpu_worker.models.llama import LlamaDecoderLayer, LlamaSwitches

_MIXTRAL = LlamaSwitches(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)


class MixtralForCausalLM(DecoderLM):
    """Mixtral checkpoints."""

    def __init__(self, ctx: ModelContext):
        """Build the decoder from config.json."""
        cfg = ctx.config
        shape = DecoderShape.from_config(cfg)

        def moe() -> SparseMoeBlock:
            return SparseMoeBlock(
                int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]), shape.hidden_size, shape.intermediate_size,
                activation=GatedActivation(shape.hidden_act, native=ctx.native),
                renormalize=True, weights_in_logits_dtype=False, dtype=ctx.dtype, device=ctx.device, group=ctx.group,
            )

        super().__init__(
            ctx, shape, lambda i: LlamaDecoderLayer(ctx, i, shape, _MIXTRAL, mlp=moe()),
            rotaries=[RopeConfig.from_hf(cfg, shape.head_dim)],
        )

    def checkpoint_target(self, name: str) -> tuple[str, ShardId] | None:
        """The original names (block_sparse_moe, w1/w2/w3) and transformers' (mlp, stacked) both load."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return expert_target(name) or super().checkpoint_target(name)
