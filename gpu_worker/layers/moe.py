"""A mixture-of-experts MLP: a top-k router and the experts' gated MLPs, their weights stacked.

`select_experts` turns router logits into each token's top-k experts and weights, with each family's
normalisation (softmax in float32, top-k, optionally renormalised over the k; Qwen3-MoE casts the weights
back to the logits' dtype, Mixtral keeps them in float32). `FusedMoE` holds every expert's gate/up rows
as one [E, 2I, H] tensor and down as [E, H, I]; a step sorts its (token, expert) pairs by expert and runs
each expert's two matmuls once over all the tokens routed to it (a loop over the experts that got
tokens, never over tokens), then adds each pair's weighted output into its token in expert order, as
transformers does. The experts' rows are split over the parallel group along the intermediate size
(gate/up by rows, down by columns, the output summed), so the loaders shard by rank already.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from metrale.gpu_worker.layers.activation import GatedActivation
from metrale.gpu_worker.layers.linear import ReplicatedLinear
from metrale.gpu_worker.layers.linear_method import PackedWeight, pack_weight, set_weight_attrs
from metrale.gpu_worker.layers.parallel import SINGLE, ParallelGroup

# Checkpoint names for an expert's three projections: transformers' (gate_proj / up_proj / down_proj) and
# Mixtral's originals (w1 = gate, w3 = up, w2 = down); and the stacked forms transformers holds in memory.
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}


def expert_target(name: str) -> tuple[str, tuple[int, str] | None] | None:
    """The FusedMoE parameter and shard a checkpoint expert tensor loads into (None: not an expert tensor).

    "...experts.3.up_proj.weight" -> ("...experts.w13", (3, "w3")); "...experts.gate_up_proj" -> ("...experts.w13", None).
    """
    m = _EXPERT.match(name)
    if m:
        prefix, expert, proj = m.groups()
        shard = _SHARD[proj]
        return f"{prefix}.{'w2' if shard == 'w2' else 'w13'}", (int(expert), shard)
    m = _STACKED.match(name)
    if m:
        return f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}", None
    return None


def select_experts(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool, weights_in_logits_dtype: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) from router logits [T, E]: softmax in float32, the top k, renormalised
    over them when asked, cast back to the logits' dtype when the family does."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    if weights_in_logits_dtype:
        weights = weights.to(router_logits.dtype)
    return weights, ids


class FusedMoE(nn.Module):
    """num_experts gated MLPs (act(x W1^T) * (x W3^T)) W2^T, each token through its top-k of them, weighted."""

    host_dependent = True  # its loop over the experts hit reads the step's counts on the host (no decode graph)

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: GatedActivation,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup = SINGLE,
    ):
        """Allocate the stacked experts (filled by the loader): w13 [E, 2I, H] = [gate | up] per expert, w2 [E, H, I]."""
        super().__init__()
        self.num_experts = num_experts
        self.group = group
        self.inter = group.split(intermediate_size, "moe intermediate size")
        self.activation = activation
        self.reduce = group.size > 1
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter, dtype=dtype, device=device), requires_grad=False)
        set_weight_attrs(self.w13, weight_loader=self.weight_loader, shard_ids=[(e, s) for e in range(num_experts) for s in ("w1", "w3")])
        set_weight_attrs(self.w2, weight_loader=self.weight_loader, shard_ids=[(e, "w2") for e in range(num_experts)])
        self.packed: list[tuple[PackedWeight, PackedWeight]] | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """shard_id (expert, "w1" | "w3" | "w2"): one expert's projection; None: every expert's, stacked as
        transformers holds them in memory (gate_up_proj [E, 2I, H] for w13, down_proj [E, H, I] for w2)."""
        if shard_id is None:
            if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
                raise ValueError(f"stacked experts of shape {tuple(loaded.shape)}, expected {self.num_experts} experts")
            for e in range(self.num_experts):
                if param is self.w13:
                    gate, up = loaded[e].chunk(2, dim=0)
                    self.weight_loader(param, gate, (e, "w1"))
                    self.weight_loader(param, up, (e, "w3"))
                else:
                    self.weight_loader(param, loaded[e], (e, "w2"))
            return
        expert, which = shard_id
        n, rank = self.inter, self.group.rank
        if which == "w2":
            target, source_dim = param.data[expert], 1
        else:
            target, source_dim = param.data[expert, (0 if which == "w1" else n) : (n if which == "w1" else 2 * n)], 0
        if loaded.dim() != 2 or loaded.shape[source_dim] != n * self.group.size:
            raise ValueError(f"expert {which} of shape {tuple(loaded.shape)}, expected {n * self.group.size} along dimension {source_dim}")
        source = loaded.narrow(source_dim, rank * n, n) if self.group.size > 1 else loaded
        if tuple(source.shape) != tuple(target.shape):
            raise ValueError(f"expert {which} of shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(source)

    def process_weights_after_loading(self) -> None:
        """Pack every expert's two weights for oneDNN where that is faithful (all or none)."""
        packed = [(pack_weight(self.w13[e]), pack_weight(self.w2[e])) for e in range(self.num_experts)]
        if all(a is not None and b is not None for a, b in packed):
            self.packed = packed
            self.w13 = nn.Parameter(self.w13.new_empty((0,)), requires_grad=False)
            self.w2 = nn.Parameter(self.w2.new_empty((0,)), requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] through each token's experts ids [T, k], weighted by weights [T, k]: [T, H] in x's dtype."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
        tokens = order // top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        routed = x.index_select(0, tokens)
        out = torch.empty_like(routed)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = routed[start : start + n]
            if self.packed is not None:
                w13, w2 = self.packed[e]
                out[start : start + n] = w2(self.activation(w13(rows)))
            else:
                out[start : start + n] = torch.nn.functional.linear(
                    self.activation(torch.nn.functional.linear(rows, self.w13[e])), self.w2[e]
                )
            start += n
        scaled = (out * weights.reshape(-1)[order, None]).to(x.dtype)
        result = torch.zeros_like(x).index_add_(0, tokens, scaled)
        return self.group.all_reduce(result) if self.reduce else result


class SparseMoeBlock(nn.Module):
    """The router (`gate`, a replicated [E, H] linear) and the experts (`experts`, a FusedMoE): HF's mlp module."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: GatedActivation,
        renormalize: bool,
        weights_in_logits_dtype: bool,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup = SINGLE,
    ):
        """Allocate the router and the stacked experts; the routing rule is the family's (see select_experts)."""
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_logits_dtype = weights_in_logits_dtype
        self.gate = ReplicatedLinear(hidden_size, num_experts, dtype=dtype, device=device)
        self.experts = FusedMoE(
            num_experts, hidden_size, intermediate_size, activation=activation, dtype=dtype, device=device, group=group
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: route, then the experts."""
        weights, ids = select_experts(
            self.gate(x), self.top_k, renormalize=self.renormalize, weights_in_logits_dtype=self.weights_in_logits_dtype
        )
        return self.experts(x, weights, ids)
