"""The mixture-of-experts layer: routing rules, the grouped expert matmuls against a token-by-token reference,
and both checkpoint forms of the experts loading into the same stacked weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.gpu_worker.layers.activation import GatedActivation
from metrale.gpu_worker.layers.moe import FusedMoE, expert_target, select_experts

CPU = dict(dtype=torch.float32, device=torch.device("cpu"))
E, H, I = 5, 16, 24


def _experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    gate, up, down = (torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g))
    return gate, up, down


def _load_split(moe, gate, up, down):
    for e in range(E):
        moe.w13.weight_loader(moe.w13, gate[e], (e, "w1"))
        moe.w13.weight_loader(moe.w13, up[e], (e, "w3"))
        moe.w2.weight_loader(moe.w2, down[e], (e, "w2"))


def test_routing_softmaxes_in_float32_then_keeps_the_top_k():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]], dtype=torch.bfloat16)
    w, ids = select_experts(logits, 2, renormalize=False, weights_in_logits_dtype=False)
    probs = torch.softmax(logits.float(), dim=-1)
    assert ids.tolist() == [[1, 2]] and w.dtype == torch.float32
    assert torch.equal(w, probs[:, [1, 2]])
    w, _ = select_experts(logits, 2, renormalize=True, weights_in_logits_dtype=True)
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, (probs[:, [1, 2]] / probs[:, [1, 2]].sum()).to(torch.bfloat16))


def test_grouped_experts_equal_a_token_by_token_reference():
    gate, up, down = _experts()
    moe = FusedMoE(E, H, I, activation=GatedActivation("silu"), **CPU)
    _load_split(moe, gate, up, down)
    moe.process_weights_after_loading()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, H, generator=g)
    weights, ids = select_experts(torch.randn(9, E, generator=g), 2, renormalize=True, weights_in_logits_dtype=True)
    want = torch.zeros_like(x)
    for t in range(9):
        for w, e in zip(weights[t], ids[t]):
            want[t] += w * F.linear(F.silu(F.linear(x[t], gate[e])) * F.linear(x[t], up[e]), down[e])
    assert torch.allclose(moe(x, weights, ids), want, atol=1e-4, rtol=1e-5)


def test_stacked_and_per_expert_checkpoints_load_the_same_weights():
    gate, up, down = _experts(2)
    split = FusedMoE(E, H, I, activation=GatedActivation("silu"), **CPU)
    _load_split(split, gate, up, down)
    stacked = FusedMoE(E, H, I, activation=GatedActivation("silu"), **CPU)
    stacked.w13.weight_loader(stacked.w13, torch.cat((gate, up), dim=1), None)  # transformers' gate_up_proj
    stacked.w2.weight_loader(stacked.w2, down, None)
    assert torch.equal(split.w13, stacked.w13) and torch.equal(split.w2, stacked.w2)


def test_expert_names_map_to_the_stacked_parameters():
    assert expert_target("model.layers.2.mlp.experts.7.up_proj.weight") == ("model.layers.2.mlp.experts.w13", (7, "w3"))
    assert expert_target("model.layers.0.mlp.experts.1.w2.weight") == ("model.layers.0.mlp.experts.w2", (1, "w2"))
    assert expert_target("model.layers.0.mlp.experts.gate_up_proj") == ("model.layers.0.mlp.experts.w13", None)
    assert expert_target("model.layers.0.mlp.gate_proj.weight") is None
