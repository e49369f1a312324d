"""The layers' building blocks against transformers' own, to the bit where transformers' arithmetic is
deterministic: RMSNorm's three forms in bfloat16, the gated activations, every rope type's frequencies and
attention factor."""

from __future__ import annotations

import pytest
import torch

from metrale.gpu_worker.layers.activation import GatedActivation
from metrale.gpu_worker.layers.norm import RMSNorm
from metrale.gpu_worker.layers.rope_scaling import RopeConfig, inv_freq
from metrale.model_facts import facts_from_config

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "module, kw",
    [
        ("transformers.models.llama.modeling_llama.LlamaRMSNorm", {}),
        ("transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm", {"scale_in_float32": True}),
        ("transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm", {"offset": 1.0}),
    ],
)
@pytest.mark.parametrize("native", [False, True])
def test_rmsnorm_forms_are_bit_identical_to_transformers_in_bf16(module, kw, native):
    from metrale.gpu_worker.layers import cpu_kernels

    if native and not cpu_kernels.available():
        pytest.skip("native CPU kernels unavailable")
    path, name = module.rsplit(".", 1)
    theirs = getattr(__import__(path, fromlist=[name]), name)(96, eps=1e-6).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    weight = (0.1 if kw.get("offset") else 1.0) * torch.randn(96, generator=g)
    with torch.no_grad():
        theirs.weight.copy_(weight)
    ours = RMSNorm(96, 1e-6, dtype=torch.bfloat16, device=CPU, native=native, **kw)
    ours.weight.data.copy_(weight)
    ours.process_weights_after_loading()
    x = (3 * torch.randn(7, 96, generator=g)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(x.clone()), theirs(x))


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_gated_activation_is_transformers_act_times_up(act):
    g = torch.Generator().manual_seed(4)
    gate_up = torch.randn(5, 32, generator=g).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    want = transformers.activations.ACT2FN[act](gate) * up
    assert torch.equal(GatedActivation(act)(gate_up.clone()), want)


def test_an_unknown_activation_is_refused_by_name():
    with pytest.raises(ValueError, match="relu2"):
        GatedActivation("relu2")


_HEAD_DIM = 32
_ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + i / 10 for i in range(16)],
                 "long_factor": [1.0 + i for i in range(16)], "original_max_position_embeddings": 128},
}


@pytest.mark.parametrize("name", list(_ROPES))
def test_rope_frequencies_and_attention_factor_equal_transformers(name):
    params = {"rope_theta": 50_000.0, **_ROPES[name]}
    hf_config = transformers.LlamaConfig(
        hidden_size=4 * _HEAD_DIM, num_attention_heads=4, max_position_embeddings=512, rope_parameters=dict(params)
    )
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS.get(params["rope_type"])
    if init is None:  # transformers keeps "default" with each model
        want = 1.0 / (50_000.0 ** (torch.arange(0, _HEAD_DIM, 2, dtype=torch.int64).float() / _HEAD_DIM))
        want_factor = 1.0
    else:
        want, want_factor = init(hf_config, CPU)
    config = hf_config.to_dict()
    cfg = RopeConfig.from_hf(config, _HEAD_DIM)
    assert torch.equal(inv_freq(cfg, CPU), want)
    assert cfg.attention_factor == pytest.approx(want_factor, rel=1e-12)
    if params["rope_type"] == "longrope":
        long, _ = init(hf_config, CPU, seq_len=129)
        assert torch.equal(inv_freq(cfg, CPU, long=True), long)


def test_model_facts_read_both_rope_forms_and_gemma3s_two_rotaries():
    old = {"num_hidden_layers": 2, "vocab_size": 10, "model_type": "gemma3_text", "max_position_embeddings": 512,
           "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    new = {**old, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    del new["rope_theta"], new["rope_local_base_freq"], new["rope_scaling"]
    for config in (old, new):
        full = RopeConfig.from_hf(config, 16, "full_attention")
        local = RopeConfig.from_hf(config, 16, "sliding_attention")
        assert (full.rope_type, full.factor, full.theta) == ("linear", 8.0, 1e6)
        assert (local.rope_type, local.theta) == ("default", 1e4)
        assert facts_from_config(config, {}, path="p", name="n").max_model_len == 512  # already the long context


@pytest.mark.parametrize(
    "config, want_type, want_len",
    [
        # Qwen2.5 with YaRN: the original length stretched by the factor.
        ({"model_type": "qwen2", "max_position_embeddings": 32768,
          "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, "yarn", 131072),
        # Phi-3 128k: "su" is its longrope; max_position_embeddings already states the long context.
        ({"model_type": "phi3", "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
          "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}}, "longrope", 131072),
        ({"model_type": "llama", "max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}},
         "linear", 8192),
    ],
)
def test_model_facts_standardise_rope_fields_and_derive_the_length(config, want_type, want_len):
    config = {"num_hidden_layers": 2, "vocab_size": 10, **config}
    facts = facts_from_config(config, {}, path="p", name="n")
    assert (facts.rope_type, facts.max_model_len) == (want_type, want_len)
