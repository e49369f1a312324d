"""What every decoder-only family here shares: its shape, the self-attention block, the gated MLP, and
`DecoderLM`, the model interface the runner drives.

A family's file (models/llama.py, gemma.py, ...) defines its decoder layer from these blocks and a
`DecoderLM` subclass whose constructor reads the family's switches; `DecoderLM` does the rest:

- `forward(input_ids, positions, cache, meta, token_seq_lens=None)` runs a flat step (the StepPlan layout:
  T tokens of R rows) and returns the hidden states before the final norm; each layer returns its output
  as a delta whose residual add is fused into the next norm.
- `compute_logits(hidden)`: final norm, LM head (and a family's final soft-cap), in the model's dtype.
- `load_weights(iterable of (name, tensor))`: each checkpoint name maps to a parameter and a shard
  (`stacked_params`: q/k/v_proj -> qkv_proj "q"/"k"/"v", gate/up_proj -> gate_up_proj 0/1; a family adds its
  own with `checkpoint_target`), whose own `weight_loader` copies it (pre-fused and split checkpoints alike);
  then every parameter must have been loaded, each weight processed once (packing, folded norms).
- For the runner: `kv_shape` (the KV cache it needs: its attention layers'), `state_shape` (the state slots
  a model with recurrent layers needs, else None), `windows`, `dtype`, `uses_native_decode` /
  `uses_masked_decode` (what the step's attention metadata must hold) and `rope_seq_len_threshold`; `lora_active`,
  which LoraSlots (layers/lora.py) sets for a step with adapter tokens, keeps the fused decode step off it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from metrale.gpu_worker.layers.activation import GatedActivation
from metrale.gpu_worker.layers.attention import Attention
from metrale.gpu_worker.layers.attention_metadata import AttentionMetadata, Window
from metrale.gpu_worker.layers.kv_cache import PagedKVCache
from metrale.gpu_worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from metrale.gpu_worker.layers.norm import HeadNorm, RMSNorm
from metrale.gpu_worker.layers.recurrent_state import StateShape, StateStep
from metrale.gpu_worker.layers.rope_scaling import RopeConfig
from metrale.gpu_worker.layers.rotary import RotaryEmbedding, StepRope
from metrale.gpu_worker.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from metrale.gpu_worker.models.context import ModelContext
from metrale.gpu_worker.models.fused_decode import FusedDecode

ShardId = str | int | tuple | None


@dataclass(frozen=True, slots=True)
class KvShape:
    """The paged KV cache a model needs: per layer, kv_heads x head_dim per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """The config.json fields every decoder family states alike."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    hidden_act: str

    @classmethod
    def from_config(cls, cfg: dict, *, default_act: str = "silu", tie_default: bool = False) -> DecoderShape:
        """Read the shape of a (decoder) config.json dict."""
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tie_default)),
            hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or default_act),
        )


@dataclass(frozen=True, slots=True)
class NormStyle:
    """Which RMSNorm form a family uses (layers/norm.py)."""

    offset: float = 0.0
    scale_in_float32: bool = False

    def make(self, ctx: ModelContext, dim: int, eps: float) -> RMSNorm:
        """An RMSNorm of this form over dim."""
        return RMSNorm(
            dim, eps, dtype=ctx.dtype, device=ctx.device, offset=self.offset,
            scale_in_float32=self.scale_in_float32, native=ctx.native,
        )


LLAMA_NORM = NormStyle()


class SelfAttention(nn.Module):
    """q/k/v in one projection, optional q/k norms, rotary, paged attention, output projection."""

    def __init__(
        self,
        ctx: ModelContext,
        prefix: str,
        layer: int,
        shape: DecoderShape,
        *,
        window: Window,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: str | None = None,  # "head": per head (Qwen3, Gemma 3); "full": over the projection (OLMo 2)
        norm: NormStyle = LLAMA_NORM,
        scale: float | None = None,
        softcap: float | None = None,
        rope_index: int = 0,
    ):
        """Allocate the projections and norms; the attention layer picks its backend (softcap may need torch)."""
        super().__init__()
        group = ctx.group
        self.qkv_proj = QKVParallelLinear(
            shape.hidden_size, shape.head_dim, shape.num_heads, shape.num_kv_heads, bias=qkv_bias,
            dtype=ctx.dtype, device=ctx.device, quant_method=ctx.linear_method(f"{prefix}.qkv_proj"), group=group,
        )
        self.o_proj = RowParallelLinear(
            shape.num_heads * shape.head_dim, shape.hidden_size, bias=o_bias, dtype=ctx.dtype, device=ctx.device,
            quant_method=ctx.linear_method(f"{prefix}.o_proj"), group=group,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm = norm.make(ctx, shape.head_dim, shape.rms_norm_eps)
            self.k_norm = norm.make(ctx, shape.head_dim, shape.rms_norm_eps)
        elif qk_norm == "full":
            # Over the whole projection: under tensor parallelism each rank gathers the group's q and k, norms
            # them whole (the checkpoint's full weights) and keeps its own heads (vLLM's OLMo 2 does the same).
            self.group, self.kv_replicas = group, self.qkv_proj.kv_replicas
            self.q_norm = norm.make(ctx, shape.num_heads * shape.head_dim, shape.rms_norm_eps)
            self.k_norm = norm.make(ctx, shape.num_kv_heads * shape.head_dim, shape.rms_norm_eps)
        elif qk_norm is not None:
            raise ValueError(f"unknown qk_norm {qk_norm!r}")
        self.head_norm: HeadNorm | None = None  # q and k norms stacked (after loading)
        self.rope_index = rope_index
        self.attn = Attention(
            layer, self.num_heads, self.num_kv_heads, shape.head_dim, scale=shape.head_dim**-0.5 if scale is None else scale,
            window=window, softcap=softcap, backend=ctx.attention,
        )

    def process_weights_after_loading(self) -> None:
        """Stack the per-head q/k norms into one (its norms are processed before it)."""
        if self.qk_norm == "head":
            self.head_norm = HeadNorm(self.q_norm, self.k_norm, self.num_heads, self.num_kv_heads)

    def forward(self, x: torch.Tensor, ropes: list[StepRope], cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden].

        q and k sit side by side in the stacked projection, so they are normed per head and rotated as one
        [T, heads + kv_heads, head_dim] tensor: the same per-head arithmetic, half the ops.
        """
        t = x.shape[0]
        heads, kv_heads, head_dim, q_size, kv_size = self.num_heads, self.num_kv_heads, self.head_dim, self.q_size, self.kv_size
        qkv = self.qkv_proj(x)
        rope = ropes[self.rope_index]
        v = qkv[:, q_size + kv_size :].view(t, kv_heads, head_dim)
        if self.qk_norm == "full":
            q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
            if self.group.size > 1:
                q, k = self._norm_whole(q, k)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
            q = rope.apply(q.reshape(t, heads, head_dim))
            k = rope.apply(k.reshape(t, kv_heads, head_dim))
        else:
            qk = qkv[:, : q_size + kv_size].view(t, heads + kv_heads, head_dim)
            if self.head_norm is not None:
                qk = self.head_norm(qk)
            qk = rope.apply(qk)
            q, k = qk[:, :heads], qk[:, heads:]
        return self.o_proj(self.attn(q, k, v, cache, meta))


    def _norm_whole(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's q and k [T, its size] normed over the whole group's projection (gathered, normed, cut)."""
        group, t = self.group, q.shape[0]
        q_all = self.q_norm(group.all_gather(q.contiguous(), dim=-1))
        k_all = group.all_gather(k.contiguous(), dim=-1)
        if self.kv_replicas > 1:  # each KV head is held by kv_replicas ranks: keep one copy of each
            k_all = k_all.view(t, group.size, -1)[:, :: self.kv_replicas].reshape(t, -1)
        k_all = self.k_norm(k_all)
        kv_rank = group.rank // self.kv_replicas
        return q_all[:, group.rank * self.q_size : (group.rank + 1) * self.q_size], \
            k_all[:, kv_rank * self.kv_size : (kv_rank + 1) * self.kv_size]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, ctx: ModelContext, prefix: str, hidden_size: int, intermediate_size: int, act: str, *, bias: bool = False):
        """Allocate the stacked gate/up and the down projection."""
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias, dtype=ctx.dtype, device=ctx.device,
            quant_method=ctx.linear_method(f"{prefix}.gate_up_proj"), group=ctx.group,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, dtype=ctx.dtype, device=ctx.device,
            quant_method=ctx.linear_method(f"{prefix}.down_proj"), group=ctx.group,
        )
        self.act = GatedActivation(act, native=ctx.native)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Backbone(nn.Module):
    """Embeddings, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, embed_tokens: VocabParallelEmbedding, layers: list[nn.Module], norm: RMSNorm):
        """Hold the parts under their HF names."""
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class DecoderLM(nn.Module):
    """A decoder-only language model over the paged KV cache (see the module docstring for the interface)."""

    # What each state slot holds (layers/recurrent_state.py) when the model has recurrent layers; the runner
    # then allocates the slots and hands forward each step's `state`.
    state_shape: StateShape | None = None
    # Set by LoraSlots (layers/lora.py) for a step with adapter tokens: the linear layers add their products, so
    # the fused decode step, which has none, must not serve it.
    lora_active: bool = False

    # (parameter suffix, checkpoint suffix, shard id): split checkpoint weights stacked into one parameter.
    stacked_params: tuple[tuple[str, str, ShardId], ...] = (
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )

    def __init__(
        self,
        ctx: ModelContext,
        shape: DecoderShape,
        make_layer: Callable[[int], nn.Module],
        *,
        norm: NormStyle = LLAMA_NORM,
        rotaries: list[RopeConfig],
        embed_scale: float | None = None,
        final_softcap: float | None = None,
    ):
        """Build the embedding, the layers (make_layer(i)), the final norm, the LM head and the rotary tables.

        Every attention layer's attention must be a SelfAttention reachable as `layer.self_attn`, whose
        Attention's layer index is its place among the attention layers (its KV cache layer).
        """
        super().__init__()
        self.ctx = ctx
        self.shape = shape
        self.dtype = ctx.dtype
        self.architecture = ctx.facts.architecture
        embed = VocabParallelEmbedding(shape.vocab_size, shape.hidden_size, dtype=ctx.dtype, device=ctx.device, group=ctx.group)
        self.model = Backbone(embed, [make_layer(i) for i in range(shape.num_layers)], norm.make(ctx, shape.hidden_size, shape.rms_norm_eps))
        self.lm_head = ParallelLMHead(
            shape.vocab_size, shape.hidden_size, dtype=ctx.dtype, device=ctx.device,
            quant_method=None if shape.tie_word_embeddings else ctx.linear_method("lm_head"), group=ctx.group,
        )
        if shape.tie_word_embeddings:
            self.lm_head.tie(embed)
        self.rotaries = [RotaryEmbedding(r, ctx.facts.max_model_len, dtype=ctx.dtype, device=ctx.device) for r in rotaries]
        thresholds = [r.seq_len_threshold for r in self.rotaries if r.seq_len_threshold is not None]
        self.rope_seq_len_threshold: int | None = min(thresholds) if thresholds else None
        # Gemma scales the embeddings by sqrt(hidden), rounded to float32 and then to the model's dtype, as
        # transformers rounds it.
        self.embed_scale = None
        if embed_scale is not None:
            self.embed_scale = torch.tensor(embed_scale, dtype=torch.float32, device=ctx.device).to(ctx.dtype)
        self.final_softcap = final_softcap
        self.windows: set[Window] = set(ctx.facts.layer_windows)
        attns = [layer.self_attn.attn for layer in self.model.layers if hasattr(layer, "self_attn")]
        self.uses_native_decode = any(a.backend.native_decode for a in attns)
        self.uses_masked_decode = any(not a.backend.native_decode for a in attns)
        self.uses_transposed_keys = any(a.backend.transposed_keys for a in attns)
        self.uses_varlen_prefill = any(a.backend.varlen_prefill for a in attns)
        self.uses_row_prefill = any(not a.backend.varlen_prefill for a in attns)
        self.attention_backends = {a.backend.name for a in attns}
        # Decode graphs (graph_runner.py) need a forward whose work depends on device tensors only: no
        # recurrent state slots, no layer that reads the step's data on the host (a mixture of experts' loop);
        # a CUDA capture also needs every attention backend to read lengths from tensors (no host-built shapes).
        self.graph_safe = self.state_shape is None and not any(getattr(m, "host_dependent", False) for m in self.modules())
        self.graph_capturable = self.graph_safe and all(a.backend.graph_safe for a in attns)
        # A hybrid's recurrent layers keep no KV: the cache holds its attention layers only.
        self.kv_shape = KvShape(len(attns), attns[0].num_kv_heads, attns[0].head_dim) if attns else KvShape(0, 1, 1)
        self.fused_decode: FusedDecode | None = None  # the layers as one native call (after loading, where they allow)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        token_seq_lens: torch.Tensor | None = None,
        state: StateStep | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] (before the final norm) for the step's tokens; fills the cache.

        token_seq_lens: each token's row seq_len, given only when some row is past rope_seq_len_threshold.
        state: the step's state slots, for a model with recurrent layers (`state_shape` not None).
        """
        ropes = [r.for_step(positions, token_seq_lens, self.ctx.native) for r in self.rotaries]
        h = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        fused = self.fused_decode
        if fused is not None and not self.lora_active and fused.serves(meta, ropes[0]):
            return h.add_(fused(h, ropes[0], cache, meta))
        delta = None
        for layer in self.model.layers:
            delta = layer(h, delta, ropes, cache, meta)
        return h if delta is None else h.add_(delta)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, vocab] logits in the model's dtype for hidden states [S, hidden] (final norm, then lm_head).

        Not widened to float32 here: a greedy step only argmaxes them (exact in any dtype), and the
        sampler's other paths copy them into float32 scratch anyway (4 MB per step saved at batch 32).
        """
        logits = self.lm_head(self.model.norm(hidden))
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    # ---- loading -------------------------------------------------------------------------------

    def checkpoint_target(self, name: str) -> tuple[str, ShardId] | None:
        """The parameter and shard a checkpoint tensor loads into, or None to skip it (a family may add names)."""
        if name.endswith("rotary_emb.inv_freq"):
            return None  # some old checkpoints carry it; it is recomputed
        if name == "lm_head.weight" and self.lm_head.shares_weight:
            return None  # tied: the embedding table is the head
        for param_suffix, ckpt_suffix, shard in self.stacked_params:
            if ckpt_suffix in name:
                return name.replace(ckpt_suffix, param_suffix), shard
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a checkpoint's tensors, then process every weight once.

        ValueError naming the tensor for a name or shape the model does not have, and for a checkpoint
        that leaves some parameter unloaded. An untied checkpoint without lm_head.weight ties it.
        """
        params = dict(self.named_parameters())
        loaded: dict[str, set] = {}
        for name, tensor in weights:
            target = self.checkpoint_target(name)
            if target is None:
                continue
            param_name, shard = target
            param = params.get(param_name)
            if param is None:
                raise ValueError(f"{self.architecture}: unexpected weight {name!r}")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                if tensor.is_floating_point() and param.is_floating_point():
                    tensor = tensor.to(param.dtype)
                loader(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            done = loaded.setdefault(param_name, set())
            done |= set(_shards(param)) if shard is None else {shard}
        if "lm_head.weight" in params and "lm_head.weight" not in loaded:
            self.lm_head.tie(self.model.embed_tokens)
            loaded["lm_head.weight"] = {None}
        missing = [n for n, p in params.items() if not set(_shards(p)) <= loaded.get(n, set())]
        if missing:
            raise ValueError(f"{self.ctx.facts.path}: checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
        self.process_weights_after_loading()
        self.eval()

    def process_weights_after_loading(self) -> None:
        """Every module's own processing, children before their parents (a block may read its parts'); then
        the fused decode step over the processed weights, where every layer allows it."""
        for module in reversed(list(self.modules())):
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
        self.fused_decode = FusedDecode.build(self)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a whole tensor into a parameter of the same shape (norms and other unsharded weights)."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.data.copy_(loaded)


def _shards(param: nn.Parameter) -> list:
    """The shard ids a parameter is loaded as (stacked parts, experts), or [None] for a whole tensor."""
    return list(getattr(param, "shard_ids", None) or [None])
