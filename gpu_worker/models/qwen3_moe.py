"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a mixture-of-experts MLP in the sparse layers.

Routing: softmax in float32 over the experts, the top num_experts_per_tok, renormalised over them when
norm_topk_prob, the weights cast back to the logits' dtype. A layer is sparse unless it is listed in
mlp_only_layers or falls between decoder_sparse_step's strides (then it has a dense gated MLP).
Checkpoints store each expert's gate/up/down projections apart; they load into the stacked experts.
"""

from __future__ import annotations

from metrale.gpu_worker.layers.activation import GatedActivation
from metrale.gpu_worker.layers.moe import SparseMoeBlock, expert_target
from metrale.gpu_worker.layers.rope_scaling import RopeConfig
from metrale.gpu_worker.models.context import ModelContext
from metrale.gpu_worker.models.decoder import DecoderLM, DecoderShape, ShardId
from metrale.gpu_worker.models.llama import LlamaDecoderLayer, LlamaSwitches


def _is_sparse(cfg: dict, layer: int) -> bool:
    """transformers' rule for which layers route to experts."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    return layer not in (cfg.get("mlp_only_layers") or []) and experts > 0 and (layer + 1) % step == 0


class Qwen3MoeForCausalLM(DecoderLM):
    """Qwen3-MoE checkpoints."""

    def __init__(self, ctx: ModelContext):
        """Build the decoder from config.json."""
        cfg = ctx.config
        shape = DecoderShape.from_config(cfg)
        bias = bool(cfg.get("attention_bias", False))
        sw = LlamaSwitches(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)

        def moe() -> SparseMoeBlock:
            return SparseMoeBlock(
                int(cfg.get("num_experts") or cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]),
                shape.hidden_size, int(cfg["moe_intermediate_size"]),
                activation=GatedActivation(shape.hidden_act, native=ctx.native),
                renormalize=bool(cfg.get("norm_topk_prob", False)), weights_in_logits_dtype=True,
                dtype=ctx.dtype, device=ctx.device, group=ctx.group,
            )

        super().__init__(
            ctx, shape, lambda i: LlamaDecoderLayer(ctx, i, shape, sw, mlp=moe() if _is_sparse(cfg, i) else None),
            rotaries=[RopeConfig.from_hf(cfg, shape.head_dim)],
        )

    def checkpoint_target(self, name: str) -> tuple[str, ShardId] | None:
        """Expert tensors go to the stacked experts; the rest as in every decoder."""
        return expert_target(name) or super().checkpoint_target(name)
