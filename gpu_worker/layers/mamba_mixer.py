"""The Mamba 2 mixer (the SSD layer of Mamba 2 and of hybrids such as Bamba), over state slots.

in_proj makes [gate | x B C | dt] per token; x B C go through a causal depthwise conv (kernel K, SiLU) that
continues from the slot's last K-1 inputs; then the selective scan

    h_t = exp(dt_t * A) h_{t-1} + dt_t x_t B_t^T      y_t = h_t C_t + D x_t          (per head, h: [P, N])

with dt_t = softplus(dt_t + dt_bias) clamped to the time-step limits, A = -exp(A_log), B and C shared by the
heads of a group; y * silu(gate) is RMS-normed per group and projected out. A decode row takes one recurrence
step from its slot; a chunk runs the scan in blocks of chunk_size tokens (quadratic within a block, the state
carried between blocks, the decays as segment sums, as transformers' torch path computes them), so nothing
loops over tokens. Arithmetic is float32 (or the model's dtype if wider) from the conv's output on, the state's
too, as in transformers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from metrale.gpu_worker.layers.linear import ReplicatedLinear
from metrale.gpu_worker.layers.recurrent_state import StateShape, StateStep
from metrale.gpu_worker.models.context import ModelContext


class GatedRMSNorm(nn.Module):
    """weight * rmsnorm(x * silu(gate)) over groups of group_size features, in float32 (transformers' form)."""

    def __init__(self, dim: int, group_size: int, eps: float, *, dtype: torch.dtype, device: torch.device):
        """Allocate the weight (filled by the loader)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x [T, dim] (the scan's dtype), gate [T, dim] -> [T, dim] (x's dtype times the weight's)."""
        x = x * F.silu(gate.to(x.dtype))
        groups = x.view(x.shape[0], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.view_as(x)


class _Conv1d(nn.Module):
    """The depthwise conv's parameters under the checkpoint's names (conv1d.weight [C, 1, K], conv1d.bias)."""

    def __init__(self, channels: int, kernel: int, bias: bool, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(channels, dtype=dtype, device=device), requires_grad=False) if bias else None


class Mamba2Mixer(nn.Module):
    """One Mamba 2 layer over the step's rows; its state lives in RecurrentState layer `state_layer`."""

    def __init__(
        self, ctx: ModelContext, prefix: str, state_layer: int, *, hidden_size: int, num_heads: int, head_dim: int,
        state_size: int, n_groups: int, conv_kernel: int, chunk_size: int, eps: float, conv_bias: bool = True,
        proj_bias: bool = False, time_step_limit: tuple[float, float] = (0.0, math.inf),
    ):
        """Allocate the projections, the conv, dt_bias, A_log, D and the gated norm."""
        super().__init__()
        if ctx.group.size > 1:
            raise ValueError("the Mamba 2 mixer is not implemented under tensor parallelism")
        dtype, device = ctx.dtype, ctx.device
        self.compute_dtype = torch.promote_types(dtype, torch.float32)
        self.state_layer = state_layer
        self.num_heads, self.head_dim, self.state_size, self.n_groups = num_heads, head_dim, state_size, n_groups
        self.intermediate = num_heads * head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * state_size
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.in_proj = ReplicatedLinear(
            hidden_size, self.intermediate + self.conv_dim + num_heads, bias=proj_bias, dtype=dtype, device=device,
            quant_method=ctx.linear_method(f"{prefix}.in_proj"),
        )
        self.conv1d = _Conv1d(self.conv_dim, conv_kernel, conv_bias, dtype=dtype, device=device)
        self.dt_bias = nn.Parameter(torch.ones(num_heads, dtype=dtype, device=device), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(num_heads, dtype=dtype, device=device), requires_grad=False)
        self.D = nn.Parameter(torch.ones(num_heads, dtype=dtype, device=device), requires_grad=False)
        self.norm = GatedRMSNorm(self.intermediate, self.intermediate // n_groups, eps, dtype=dtype, device=device)
        self.out_proj = ReplicatedLinear(
            self.intermediate, hidden_size, bias=proj_bias, dtype=dtype, device=device,
            quant_method=ctx.linear_method(f"{prefix}.out_proj"),
        )
        self._A = self._D = self._dt_bias = None

    def state_shape(self, num_layers: int) -> StateShape:
        """The slot layout num_layers such mixers need."""
        return StateShape(num_layers, self.conv_dim, self.conv_kernel - 1, self.num_heads, self.head_dim, self.state_size)

    def process_weights_after_loading(self) -> None:
        """The compute-dtype forms the scan reads: A = -exp(A_log), D, dt_bias."""
        self._A = -torch.exp(self.A_log.to(self.compute_dtype))
        self._D = self.D.to(self.compute_dtype)
        self._dt_bias = self.dt_bias.to(self.compute_dtype)

    def forward(self, x: torch.Tensor, step: StateStep) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; advances each row's slot past its tokens."""
        proj = self.in_proj(x)
        gate, xbc, dt = proj.split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        conv_state = step.state.conv[self.state_layer]
        ssm_state = step.state.ssm[self.state_layer]
        y = torch.empty(x.shape[0], self.intermediate, dtype=self.compute_dtype, device=x.device)
        if step.decode_slots is not None:
            idx = step.decode_token_idx
            rows = slice(None) if idx is None else idx
            y[rows] = self._decode(xbc[rows], dt[rows], conv_state, ssm_state, step.decode_slots)
        for chunk in step.prefills:
            span = slice(chunk.start, chunk.end)
            y[span] = self._prefill(xbc[span], dt[span], conv_state, ssm_state, chunk.slot)
        return self.out_proj(self.norm(y, gate).to(x.dtype))

    # ---- decode rows: one recurrence step each ---------------------------------------------------

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
        """[Rd, conv_dim] inputs of one token per row -> y [Rd, intermediate]; updates their slots."""
        window = torch.cat([conv_state[slots], xbc[:, :, None].to(conv_state.dtype)], dim=-1)  # [Rd, C, K]
        conv_state[slots] = window[:, :, 1:]
        conv = F.conv1d(window, self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)[:, :, 0]
        xs, B, C = self._split(F.silu(conv).to(self.compute_dtype))
        n = xs.shape[0]
        dt = self._time_steps(dt)  # [Rd, H]
        h = ssm_state[slots]  # [Rd, H, P, N]
        x_heads = xs.view(n, self.num_heads, self.head_dim)
        h = h * torch.exp(dt * self._A)[:, :, None, None] + (dt[:, :, None] * B)[:, :, None, :] * x_heads[..., None]
        ssm_state[slots] = h
        out = (h @ C[..., None])[..., 0] + x_heads * self._D[:, None]
        return out.view(n, self.intermediate)

    # ---- chunks: the scan in blocks ------------------------------------------------------------------

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                 slot: int) -> torch.Tensor:
        """[L, conv_dim] inputs of one row's chunk -> y [L, intermediate]; updates its slot."""
        length = xbc.shape[0]
        window = torch.cat([conv_state[slot], xbc.t().to(conv_state.dtype)], dim=-1)  # [C, K-1+L]
        conv_state[slot] = window[:, window.shape[1] - (self.conv_kernel - 1) :]
        conv = F.conv1d(window[None], self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)[0]
        xs, B, C = self._split(F.silu(conv.t()).to(self.compute_dtype))  # [L, ...]
        x_heads = xs.view(length, self.num_heads, self.head_dim)
        dt = self._time_steps(dt)  # [L, H]
        h = ssm_state[slot]  # [H, P, N]
        out = torch.empty_like(x_heads)
        for c0 in range(0, length, self.chunk_size):
            c1 = min(c0 + self.chunk_size, length)
            out[c0:c1], h = self._scan_block(x_heads[c0:c1], dt[c0:c1], B[c0:c1], C[c0:c1], h)
        ssm_state[slot] = h
        out += x_heads * self._D[:, None]
        return out.view(length, self.intermediate)

    def _scan_block(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, h: torch.Tensor):
        """One block of l tokens from state h [H, P, N]: outputs [l, H, P] (without D) and the state after it.

        seg[t, s, h] = sum of dt * A over (s, t] — the decay from token s to token t, summed rather than
        taken as a difference of cumulative sums, which would lose the small decays of long blocks."""
        l = x.shape[0]
        a = dt * self._A  # [l, H]
        causal = torch.ones(l, l, dtype=torch.bool, device=x.device).tril_()
        steps = a[:, None, :].expand(l, l, -1).masked_fill(~causal.tril(-1)[:, :, None], 0.0)  # [t, s, H]: a[t] for s < t
        seg = steps.cumsum(dim=0).masked_fill_(~causal[:, :, None], -math.inf)  # [t, s, H]
        xdt = x * dt[..., None]  # [l, H, P]
        scores = torch.einsum("thn,shn->tsh", C, B) * torch.exp(seg)
        y = torch.einsum("tsh,shp->thp", scores, xdt)
        cum = torch.cumsum(a, dim=0)  # [l, H]: the decay from the block's start, for the carried state
        y += torch.einsum("thn,hpn->thp", C, h) * torch.exp(cum)[..., None]
        to_end = torch.exp(seg[-1])  # [s, H]: the decay from token s to the block's end
        h = h * torch.exp(cum[-1])[:, None, None] + torch.einsum("sh,shn,shp->hpn", to_end, B, xdt)
        return y, h

    # ---- shared -----------------------------------------------------------------------------------------

    def _split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [n, conv_dim] (compute dtype) as x [n, intermediate], and B, C [n, H, N] (each group's
        B and C repeated for its heads)."""
        n = conv_out.shape[0]
        xs, B, C = conv_out.split([self.intermediate, self.n_groups * self.state_size, self.n_groups * self.state_size], -1)
        per_group = self.num_heads // self.n_groups
        B = B.view(n, self.n_groups, self.state_size).repeat_interleave(per_group, dim=1, output_size=self.num_heads)
        C = C.view(n, self.n_groups, self.state_size).repeat_interleave(per_group, dim=1, output_size=self.num_heads)
        return xs, B, C

    def _time_steps(self, dt: torch.Tensor) -> torch.Tensor:
        """softplus(dt + dt_bias) [n, H] in the compute dtype, clamped to the time-step limits."""
        dt = F.softplus(dt.to(self.compute_dtype) + self._dt_bias)
        low, high = self.time_step_limit
        if low > 0.0 or high != math.inf:
            dt = dt.clamp(min=low, max=high)
        return dt
