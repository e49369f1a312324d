"""Rotary position embeddings: cos/sin tables over the model's context and their application to q and k.

The frequencies come from layers/rope_scaling.py (every transformers rope type, to the bit); the table
is as long as the model's max_model_len (a model fact, given by the model). Llama's "rotate half" layout
(the checkpoint's q/k rows are permuted for it); with a partial rotary only the first dims rotate.

Two types make a token's angles depend on its row's length: dynamic NTK (frequencies recomputed past the
base length) and longrope (the long factors once the row is past the original length; transformers picks
them per forward from the longest position, which per row is the row's KV length). For those the runner
hands each token's row seq_len, only in steps where some row is past the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale.gpu_worker.layers import cpu_kernels
from metrale.gpu_worker.layers.rope_scaling import RopeConfig, dynamic_inv_freq, inv_freq


class RotaryEmbedding:
    """cos/sin for a step's positions, from a table (or per row, for dynamic NTK past the base length).

    The sine is kept with its first half negated ("signed sine"): rotate_half(x) * sin equals
    swap_halves(x) * signed_sin bit for bit (a negation is exact), and swapping needs no negation op.
    """

    def __init__(self, cfg: RopeConfig, max_len: int, *, dtype: torch.dtype, device: torch.device):
        """Precompute the cos/signed-sin table over positions [0, max_len) (longrope: the short table, then
        the long one, so a token's row is position + max_len * long)."""
        self.cfg = cfg
        self.dtype = dtype
        self.max_len = max_len
        self.rotary_dim = cfg.dim
        self.partial = cfg.dim < cfg.head_dim
        self.seq_len_threshold = cfg.seq_len_threshold
        positions = torch.arange(max_len, device=device).float()
        sets = [inv_freq(cfg, device)]
        if cfg.rope_type == "longrope":
            sets.append(inv_freq(cfg, device, long=True))
        # Cast to the model dtype as transformers does before rotating; one [len, 2, dim] table so a step
        # gathers both with one index.
        tables = [_cos_signed_sin(positions[:, None] * inv[None, :], cfg.attention_factor) for inv in sets]
        self.table = torch.cat(tables).to(dtype)

    def for_step(self, positions: torch.Tensor, token_seq_lens: torch.Tensor | None, native: bool) -> StepRope:
        """What every layer needs to rotate this step's q and k: the table and the rows by position for the
        native kernel (no per-step gather), else the gathered cos and signed sin.

        token_seq_lens (int [T], each token's row seq_len) is given only when some row is past
        seq_len_threshold (the caller knows from the host-side plan, so no device sync here).
        """
        index = positions
        if token_seq_lens is not None and self.seq_len_threshold is not None:
            if self.cfg.rope_type == "dynamic":
                cos, sin = self.cos_sin(positions, token_seq_lens)
                return StepRope(cos, sin, None, None, self.rotary_dim if self.partial else 0)
            index = positions + self.max_len * (token_seq_lens > self.seq_len_threshold)
        if native and not self.partial and positions.device.type == "cpu":
            return StepRope(None, None, self.table, index, 0)
        rows = self.table[index]
        return StepRope(rows[:, 0:1, :], rows[:, 1:2, :], None, None, self.rotary_dim if self.partial else 0)

    def cos_sin(
        self, positions: torch.Tensor, dynamic_seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, dim] cos and signed sin for the tokens (short factors, for longrope); dynamic_seq_lens: the
        dynamic NTK frequencies of each token's row length."""
        if dynamic_seq_lens is not None:
            freqs = positions.float()[:, None] * dynamic_inv_freq(self.cfg, dynamic_seq_lens)
            rows = _cos_signed_sin(freqs, self.cfg.attention_factor).to(self.dtype)
        else:
            rows = self.table[positions]
        return rows[:, 0:1, :], rows[:, 1:2, :]


@dataclass(frozen=True, slots=True)
class StepRope:
    """One step's rotation: cos and signed sin [T, 1, dim], or the table and its rows (native)."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    table: torch.Tensor | None
    positions: torch.Tensor | None
    partial_dim: int  # rotate only the first partial_dim dims; 0 = all

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated (in place on the native and partial paths, which x's producer allows)."""
        if self.table is not None:
            return cpu_kernels.rotary(x, self.table, self.positions)
        if self.partial_dim:
            part = x[..., : self.partial_dim]
            part.copy_(apply_rotary(part, self.cos, self.sin))
            return x
        return apply_rotary(x, self.cos, self.sin)


def _cos_signed_sin(freqs: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """float32 [N, 2, dim]: cos and signed sin of the angles freqs [N, dim/2] (HF's emb = cat(f, f)), times
    the attention factor where the rope type has one (in float32, as transformers scales them)."""
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.stack((torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)), dim=1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] rotated by its tokens' angles: HF's x * cos + rotate_half(x) * sin.

    rotate_half(x) * sin = (-x2, x1) * (s, s) = (x2, x1) * (-s, s); the rounding points are HF's.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    out = x * cos
    return out.add_(swapped.mul_(signed_sin))
