"""Rotary position embeddings with Hugging Face's scaling types: default, linear, dynamic (NTK), llama3.

The frequencies are computed with the same float32 operations transformers uses, so cos/sin agree
with it to the bit. Llama uses the "rotate half" layout (the checkpoint's q/k rows are permuted for it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from metrale.gpu_worker.layers import cpu_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """The rotary settings read from config.json (old `rope_scaling` or new `rope_parameters` form)."""

    head_dim: int
    theta: float
    rope_type: str
    factor: float
    max_position_embeddings: int
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0

    @classmethod
    def from_hf(cls, config: dict, head_dim: int) -> RopeConfig:
        """Read the rope fields of a config.json dict; ValueError for a type we do not implement."""
        params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1.0):
            raise ValueError(f"partial_rotary_factor={partial} is not supported")
        max_pos = int(config["max_position_embeddings"])
        return cls(
            head_dim=head_dim,
            theta=float(params.get("rope_theta", config.get("rope_theta", 10000.0))),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            max_position_embeddings=max_pos,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", config.get("original_max_position_embeddings", max_pos))
            ),
        )

    @property
    def max_model_len(self) -> int:
        """The longest sequence the model serves (linear and dynamic stretch the context by factor, as vLLM)."""
        if self.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * self.factor)
        return self.max_position_embeddings


def _exponents(dim: int, device: torch.device) -> torch.Tensor:
    """arange(0, dim, 2) / dim in float32, as transformers computes it."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def inv_freq(cfg: RopeConfig, device: torch.device) -> torch.Tensor:
    """float32 [head_dim/2] inverse frequencies at the model's base length."""
    dim = cfg.head_dim
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


def dynamic_inv_freq(cfg: RopeConfig, seq_lens: torch.Tensor) -> torch.Tensor:
    """float32 [R, head_dim/2]: dynamic NTK frequencies for rows whose KV length is seq_lens.

    transformers recomputes them from the current sequence length (max position + 1) whenever it
    grows past the base length; per row, that length is the row's seq_len in this step.
    """
    dim = cfg.head_dim
    max_pos = cfg.max_position_embeddings
    seq = torch.clamp(seq_lens.to(torch.int64), min=max_pos)
    base = cfg.theta * ((cfg.factor * seq / max_pos) - (cfg.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base[:, None] ** _exponents(dim, seq_lens.device)[None, :])


class RotaryEmbedding:
    """cos/sin for a step's positions, from a table (or per row, for dynamic NTK past the base length).

    The sine is kept with its first half negated ("signed sine"): rotate_half(x) * sin equals
    swap_halves(x) * signed_sin bit for bit (a negation is exact), and swapping needs no negation op.
    """

    def __init__(self, cfg: RopeConfig, *, dtype: torch.dtype, device: torch.device):
        """Precompute the cos/signed-sin table over the model's whole context."""
        self.cfg = cfg
        self.dtype = dtype
        positions = torch.arange(cfg.max_model_len, device=device).float()
        freqs = positions[:, None] * inv_freq(cfg, device)[None, :]
        # Cast to the model dtype as transformers does before rotating; one [len, 2, head_dim]
        # table so a step gathers both with one index.
        self.table = _cos_signed_sin(freqs).to(dtype)

    def for_step(self, positions: torch.Tensor, dynamic_seq_lens: torch.Tensor | None, native: bool) -> "StepRope":
        """What every layer needs to rotate this step's q and k: the table rows by position for the
        native kernel (no per-step gather), else the gathered cos and signed sin."""
        if native and dynamic_seq_lens is None and positions.device.type == "cpu":
            return StepRope(None, None, self.table, positions)
        cos, sin = self.cos_sin(positions, dynamic_seq_lens)
        return StepRope(cos, sin, None, None)

    def cos_sin(
        self, positions: torch.Tensor, dynamic_seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] cos and signed sin for the tokens.

        dynamic_seq_lens (int [T], each token's row seq_len) is given only under dynamic NTK when some
        row is past the base length (the caller knows from the host-side plan, so no device sync here).
        """
        if dynamic_seq_lens is not None:
            freqs = positions.float()[:, None] * dynamic_inv_freq(self.cfg, dynamic_seq_lens)
            rows = _cos_signed_sin(freqs).to(self.dtype)
        else:
            rows = self.table[positions]
        return rows[:, 0:1, :], rows[:, 1:2, :]


@dataclass(frozen=True, slots=True)
class StepRope:
    """One step's rotation: cos and signed sin [T, 1, head_dim], or the table and positions (native)."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    table: torch.Tensor | None
    positions: torch.Tensor | None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated (in place on the native path, which x's producer allows)."""
        if self.table is not None:
            return cpu_kernels.rotary(x, self.table, self.positions)
        return apply_rotary(x, self.cos, self.sin)


def _cos_signed_sin(freqs: torch.Tensor) -> torch.Tensor:
    """float32 [N, 2, head_dim]: cos and signed sin of the angles freqs [N, head_dim/2] (HF's emb = cat(f, f))."""
    cos, sin = freqs.cos(), freqs.sin()
    return torch.stack((torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)), dim=1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by its tokens' angles: HF's x * cos + rotate_half(x) * sin.

    rotate_half(x) * sin = (-x2, x1) * (s, s) = (x2, x1) * (-s, s); the rounding points are HF's.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    out = x * cos
    return out.add_(swapped.mul_(signed_sin))
