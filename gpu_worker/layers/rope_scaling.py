"""Rotary frequencies for each of transformers' rope types: default, linear, dynamic (NTK), llama3, yarn, longrope.

`RopeConfig` holds one rotary's settings, read from model_facts.rope_parameters (the one parser of
config.json's rope fields); the functions here turn it into float32 inverse frequencies with the same float32
operations transformers uses (modeling_rope_utils), so cos/sin agree with it to the bit. How long the tables
are is not decided here: that is the model's max_model_len, a model fact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from metrale.model_facts import rope_parameters

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """One rotary's settings (a model has one, or one per layer type: Gemma 3's local and global)."""

    head_dim: int
    theta: float
    rope_type: str
    factor: float
    max_position_embeddings: int
    rotary_dim: int = 0  # rotated dimensions (partial rotary); 0 = head_dim
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    attention_factor: float = 1.0  # cos and sin are scaled by it (yarn, longrope)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # Per-dimension-pair divisors of the inverse frequencies (a GGUF's rope_freqs tensor that no llama3 settings
    # reproduce: metrale/gguf_rope.py), as llama.cpp applies them.
    freq_factors: tuple[float, ...] = ()

    @classmethod
    def from_hf(cls, config: dict, head_dim: int, layer_type: str | None = None) -> RopeConfig:
        """The rotary of a (decoder) config.json dict; ValueError for a type not implemented here."""
        params = rope_parameters(config, layer_type)
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        max_pos = int(config.get("max_position_embeddings") or 2048)
        original = int(params.get("original_max_position_embeddings") or max_pos)
        rotary_dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
        factor = params.get("factor")
        if factor is None and rope_type in ("yarn", "longrope"):
            factor = max_pos / original  # transformers' implicit factor
        factor = float(1.0 if factor is None else factor)
        return cls(
            head_dim=head_dim,
            theta=float(params["rope_theta"]),
            rope_type=rope_type,
            factor=factor,
            max_position_embeddings=max_pos,
            rotary_dim=rotary_dim,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
            attention_factor=_attention_factor(rope_type, params, factor, original),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
            long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
            freq_factors=tuple(float(f) for f in params.get("freq_factors") or ()),
        )

    @property
    def dim(self) -> int:
        """The rotated dimensions."""
        return self.rotary_dim or self.head_dim

    @property
    def seq_len_threshold(self) -> int | None:
        """The KV length past which a row's frequencies depend on its own length (dynamic, longrope), else None."""
        if self.rope_type == "dynamic":
            return self.max_position_embeddings
        if self.rope_type == "longrope":
            return self.original_max_position_embeddings
        return None


def _attention_factor(rope_type: str, params: dict, factor: float, original: int) -> float:
    """The cos/sin scale of yarn and longrope (the config's attention_factor, else the paper's default)."""
    given = params.get("attention_factor")
    if rope_type == "yarn":
        if given is not None:
            return float(given)
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        return _yarn_mscale(factor)
    if rope_type == "longrope":
        if given is not None:
            return float(given)
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched by scale."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _exponents(dim: int, device: torch.device) -> torch.Tensor:
    """arange(0, dim, 2) / dim in float32, as transformers computes it."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def inv_freq(cfg: RopeConfig, device: torch.device, *, long: bool = False) -> torch.Tensor:
    """float32 [dim/2] inverse frequencies at the model's base length (longrope: the short set, or the long one)."""
    dim = cfg.dim
    if cfg.rope_type == "yarn":
        return _yarn(cfg, device)
    if cfg.rope_type == "longrope":
        factors = cfg.long_factor if long else cfg.short_factor
        ext = torch.tensor(factors, dtype=torch.float32, device=device)
        return 1.0 / (ext * cfg.theta ** _exponents(dim, device))
    inv = 1.0 / (cfg.theta ** _exponents(dim, device))
    if cfg.rope_type == "linear":
        inv = inv / cfg.factor
    elif cfg.rope_type == "llama3":
        inv = _llama3(inv, cfg)
    elif cfg.rope_type == "dynamic":
        # At or below the base length dynamic NTK is the identity: base * 1 ** x == base.
        max_pos, factor = cfg.max_position_embeddings, cfg.factor
        base = cfg.theta * ((factor * max_pos / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        inv = 1.0 / (base ** _exponents(dim, device))
    if cfg.freq_factors:
        inv = inv / torch.tensor(cfg.freq_factors, dtype=torch.float32, device=device)
    return inv


def _llama3(inv: torch.Tensor, cfg: RopeConfig) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling (transformers' _compute_llama3_parameters)."""
    factor = cfg.factor
    old_context_len = cfg.original_max_position_embeddings
    low_freq_wavelen = old_context_len / cfg.low_freq_factor
    high_freq_wavelen = old_context_len / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv
    inv_llama = torch.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = (old_context_len / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_llama)


def _yarn(cfg: RopeConfig, device: torch.device) -> torch.Tensor:
    """YaRN's blend of interpolated and extrapolated frequencies (transformers' _compute_yarn_parameters)."""
    dim, base, factor = cfg.dim, cfg.theta, cfg.factor

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(cfg.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp.to(device=device, dtype=torch.float)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def dynamic_inv_freq(cfg: RopeConfig, seq_lens: torch.Tensor) -> torch.Tensor:
    """float32 [R, dim/2]: dynamic NTK frequencies for rows whose KV length is seq_lens.

    transformers recomputes them from the current sequence length (max position + 1) whenever it
    grows past the base length; per row, that length is the row's seq_len in this step.
    """
    dim = cfg.dim
    max_pos = cfg.max_position_embeddings
    seq = torch.clamp(seq_lens.to(torch.int64), min=max_pos)
    base = cfg.theta * ((cfg.factor * seq / max_pos) - (cfg.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base[:, None] ** _exponents(dim, seq_lens.device)[None, :])
