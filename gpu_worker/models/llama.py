"""The Llama-family decoder in plain torch: Llama 2/3, Qwen2, Qwen3 and Mistral in one class.

The variants differ only in small switches read from config.json: biases on q/k/v (Qwen2), RMSNorm on
each head of q and k (Qwen3), an explicit head_dim, a sliding window (Mistral), rope scaling, tied
embeddings. The module tree mirrors Hugging Face's names, except that q/k/v and gate/up are stacked
into one matmul each (`load_weight` maps the checkpoint's names onto the stacked rows).

The forward runs a flat batch of T tokens (the StepPlan layout) against the paged KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metrale.gpu_worker.layers import cpu_kernels
from metrale.gpu_worker.layers.attention import AttentionMetadata, Window, paged_attention
from metrale.gpu_worker.layers.kv_cache import PagedKVCache
from metrale.gpu_worker.layers.linear import PackedWeight, StackedLinear, pack_weight
from metrale.gpu_worker.layers.norm import RMSNorm
from metrale.gpu_worker.layers.rotary import RopeConfig, RotaryEmbedding, StepRope

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The shape and switches of one checkpoint, read from its config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    layer_windows: tuple[Window, ...]  # per layer: sliding window in tokens, or None
    rope: RopeConfig

    @classmethod
    def from_hf(cls, config: dict) -> LlamaConfig:
        """Read a config.json dict; ValueError names what this model cannot serve."""
        arch = (config.get("architectures") or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{arch}: hidden_act {act!r} is not supported (only silu)")
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "Qwen2ForCausalLM" else (attention_bias and arch != "MistralForCausalLM"),
            o_bias=attention_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
            mlp_bias=bool(config.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            layer_windows=_layer_windows(arch, config),
            rope=RopeConfig.from_hf(config, head_dim),
        )

    @property
    def max_model_len(self) -> int:
        """The longest sequence the model serves."""
        return self.rope.max_model_len


def _layer_windows(arch: str, config: dict) -> tuple[Window, ...]:
    """Each layer's sliding window, following transformers' rules per architecture."""
    n = int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not config.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * n
    window = int(window)
    layer_types = config.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch == "MistralForCausalLM":
        return (window,) * n
    first = int(config.get("max_window_layers", n))  # Qwen: layers from max_window_layers on slide
    return tuple(window if i >= first else None for i in range(n))


class Attention(nn.Module):
    """Grouped-query self-attention with rotary embeddings over the paged cache."""

    def __init__(self, cfg: LlamaConfig, layer: int, *, dtype: torch.dtype, device: torch.device):
        """Allocate the stacked q/k/v, the output projection and (Qwen3) the per-head norms."""
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.layer_windows[layer]
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = StackedLinear(
            cfg.hidden_size,
            {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows},
            bias=cfg.qkv_bias,
            dtype=dtype,
            device=device,
        )
        self.o_proj = StackedLinear(q_rows, {"o_proj": cfg.hidden_size}, bias=cfg.o_bias, dtype=dtype, device=device)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)
        self._qk_norm_weight: torch.Tensor | None = None  # [heads + kv_heads, head_dim], built by prepare()

    def prepare(self) -> None:
        """After loading: pack the projections, stack the q/k norm weights (one norm over both)."""
        self.qkv_proj.pack()
        self.o_proj.pack()
        if self.q_norm is not None:
            self._qk_norm_weight = torch.cat(
                (
                    self.q_norm.weight.expand(self.num_heads, self.head_dim),
                    self.k_norm.weight.expand(self.num_kv_heads, self.head_dim),
                )
            )

    def forward(self, x, rope: StepRope, cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden].

        q and k sit side by side in the stacked projection, so they are normed (Qwen3) and rotated
        as one [T, heads + kv_heads, head_dim] tensor: the same per-head arithmetic, half the ops.
        """
        t = x.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk = qkv[:, : (heads + kv_heads) * head_dim].view(t, heads + kv_heads, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(t, kv_heads, head_dim)
        if self.q_norm is not None:
            if self._qk_norm_weight is None:
                self.prepare()
            qk = self._qk_norm_weight * F.rms_norm(qk, (head_dim,), eps=self.q_norm.eps)
        qk = rope.apply(qk)
        q, k = qk[:, :heads], qk[:, heads:]
        out = paged_attention(q, k, v, cache, self.layer, meta, scale=self.scale, window=self.window)
        return self.o_proj(out)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, cfg: LlamaConfig, *, dtype: torch.dtype, device: torch.device):
        """Allocate the stacked gate/up and the down projection."""
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = StackedLinear(
            cfg.hidden_size, {"gate_proj": inter, "up_proj": inter}, bias=cfg.mlp_bias, dtype=dtype, device=device
        )
        self.down_proj = StackedLinear(
            inter, {"down_proj": cfg.hidden_size}, bias=cfg.mlp_bias, dtype=dtype, device=device
        )
        self.inter = inter
        self.native = False  # silu * up in one native CPU pass (set by prepare)

    def prepare(self, *, native: bool = False) -> None:
        """After loading: pack the projections; with native, fuse silu * up into one kernel."""
        self.gate_up_proj.pack()
        self.down_proj.pack()
        self.native = native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        gate_up = self.gate_up_proj(x)
        if self.native:
            return self.down_proj(cpu_kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        # silu in place on the projection's own buffer; the product is a fresh contiguous tensor.
        return self.down_proj(torch.mul(F.silu(gate, inplace=True), up))


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, each added to the residual stream."""

    def __init__(self, cfg: LlamaConfig, layer: int, *, dtype: torch.dtype, device: torch.device):
        """Allocate the layer's modules."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = Attention(cfg, layer, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = MLP(cfg, dtype=dtype, device=device)

    def forward(self, h, delta, rope, cache, meta) -> torch.Tensor:
        """Add the previous layer's output delta to the residual stream h (in place), run this layer,
        and return its own output, still to be added: each residual add is fused into the norm after it."""
        attn = self.self_attn(self.input_layernorm(h, delta), rope, cache, meta)
        return self.mlp(self.post_attention_layernorm(h, attn))


class Backbone(nn.Module):
    """Embeddings, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: LlamaConfig, *, dtype: torch.dtype, device: torch.device):
        """Allocate the embedding table, the layers and the final norm."""
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype=dtype, device=device) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)


class LlamaForCausalLM(nn.Module):
    """The whole model: `forward` over a flat step, `compute_logits` for the rows that sample."""

    def __init__(self, cfg: LlamaConfig, *, dtype: torch.dtype, device: torch.device):
        """Allocate every parameter (uninitialised; the loader fills them) and the rotary table."""
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.model = Backbone(cfg, dtype=dtype, device=device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        self.lm_head.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg.rope, dtype=dtype, device=device)
        self.windows: set[Window] = set(cfg.layer_windows)
        self._lm_head_packed: PackedWeight | None = None
        self._native = False  # native CPU kernels (set by prepare)

    def prepare(self, *, native: bool = False) -> None:
        """After loading: put every projection in the platform's fastest layout (see layers/linear.py),
        and with native, switch the norms to the native CPU kernel (layers/cpu_kernels.py).

        An untied lm_head's plain weight is released once packed; a tied one stays (it is the embedding).
        """
        self._native = native
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.native = native
        for layer in self.model.layers:
            layer.self_attn.prepare()
            layer.mlp.prepare(native=native)
        self._lm_head_packed = pack_weight(self.lm_head.weight)
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        if self._lm_head_packed is not None and not tied:
            self.lm_head.weight = nn.Parameter(self.lm_head.weight.new_empty((0, self.config.hidden_size)), requires_grad=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        dynamic_seq_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] (before the final norm) for the step's tokens; fills the cache."""
        rope = self.rotary.for_step(positions, dynamic_seq_lens, self._native)
        h = self.model.embed_tokens(input_ids)
        delta = None
        for layer in self.model.layers:
            delta = layer(h, delta, rope, cache, meta)
        return h if delta is None else h.add_(delta)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, vocab] logits in the model's dtype for hidden states [S, hidden] (final norm, then lm_head).

        Not widened to float32 here: a greedy step only argmaxes them (exact in any dtype), and the
        sampler's other paths copy them into float32 scratch anyway (4 MB per step saved at batch 32).
        """
        h = self.model.norm(hidden)
        return self._lm_head_packed(h) if self._lm_head_packed is not None else self.lm_head(h)

    def tie_embeddings(self) -> None:
        """Make lm_head share the embedding table (tied checkpoints store only one of them)."""
        self.lm_head.weight = self.model.embed_tokens.weight

    def load_weight(self, name: str, tensor: torch.Tensor) -> str:
        """Copy one checkpoint tensor (HF name) into its parameter; return the parameter's HF name.

        ValueError for a name or shape the model does not have.
        """
        if name.endswith("rotary_emb.inv_freq"):
            return name  # some old checkpoints carry it; it is recomputed
        parts = name.split(".")
        if len(parts) >= 5 and parts[:2] == ["model", "layers"]:
            layer = self.model.layers[int(parts[2])]
            module_name, proj, kind = parts[3], parts[4], parts[-1]
            if module_name == "self_attn" and proj in ("q_proj", "k_proj", "v_proj"):
                layer.self_attn.qkv_proj.load_part(proj, kind, tensor)
                return name
            if module_name == "self_attn" and proj == "o_proj":
                layer.self_attn.o_proj.load_part(proj, kind, tensor)
                return name
            if module_name == "mlp" and proj in ("gate_proj", "up_proj"):
                layer.mlp.gate_up_proj.load_part(proj, kind, tensor)
                return name
            if module_name == "mlp" and proj == "down_proj":
                layer.mlp.down_proj.load_part(proj, kind, tensor)
                return name
        try:
            target = self.get_parameter(name)
        except AttributeError:
            raise ValueError(f"{self.config.architecture}: unexpected weight {name!r}") from None
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        return name

    def expected_weights(self) -> set[str]:
        """The HF names a complete checkpoint holds (lm_head.weight included; tied ones omit it)."""
        cfg = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            names |= {p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight")}
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                names.add(f"{p}self_attn.{proj}.weight")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names.add(f"{p}mlp.{proj}.weight")
            if cfg.qk_norm:
                names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        return names
