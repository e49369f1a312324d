"""The fused native decode step (models/fused_decode.py): the module path's bits, and only where it applies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_models import random_k_quant_encoder

from metrale.gpu_worker.layers import cpu_kernels
from metrale.gpu_worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels unavailable")

PROMPT_LENS = (5, 17, 30)
MAX_LEN = 64


def _logits_both_ways(runner, plans, prompts, steps):
    """Prefill, then `steps` host-fed decode steps, each run fused and then by the modules: both logits per step."""
    fused = runner.model.fused_decode
    rows = [plans.Row(p, 0, plans.blocks_for(i, MAX_LEN)) for i, p in enumerate(prompts)]
    tokens = runner.execute(plans.make_plan(rows)).tokens
    pairs = []
    for k in range(steps):
        plan = plans.make_plan(
            [plans.Row([int(tokens[i])], len(p) + k, plans.blocks_for(i, MAX_LEN)) for i, p in enumerate(prompts)]
        )
        got = []
        for path in (fused, None):  # both write the same keys and values into the same slots
            runner.model.fused_decode = path
            got.append(runner.forward_only(plan).clone())
        runner.model.fused_decode = fused
        pairs.append(got)
        tokens = got[0].argmax(-1).numpy()
    return pairs


@pytest.mark.parametrize(("arch", "dtype", "kw"), [
    ("llama", "float32", {}),
    ("llama", "bfloat16", {}),
    ("qwen2", "bfloat16", {}),  # biases on q/k/v
    ("mistral", "float32", {"sliding_window": 8}),  # rows past the window
])
def test_fused_decode_gives_the_module_paths_bits(tiny_model_dir, plans, arch, dtype, kw):
    runner = ModelRunner(tiny_model_dir(arch, **kw), device="cpu", dtype=dtype, num_kv_blocks=256, show_progress=False)
    assert runner.model.fused_decode is not None
    rng = np.random.default_rng(0)
    prompts = [rng.integers(16, runner.info.vocab_size, size=n).tolist() for n in PROMPT_LENS]
    for step, (fused, modules) in enumerate(_logits_both_ways(runner, plans, prompts, 4)):
        assert torch.equal(fused, modules), f"step {step}: fused and module logits differ"


# Shapes whose rows are whole 256-value K-quant super-blocks; the scale keeps random blocks' products finite.
K_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def _q4_k_m(name: str, values: np.ndarray):
    """llama.cpp's Q4_K_M mix: Q6_K attn_v and ffn_down beside Q4_K (a stacked qkv of two kernels)."""
    kind = "q6_k" if (".attn_v." in name or ".ffn_down." in name) else "q4_k"
    return random_k_quant_encoder(kind, scale=2e-4)(name, values)


@pytest.mark.parametrize("source", ["int8", "int4", "q8_0", "q4_1", "q5_0", "q4_k_m", "q5_k", "q6_k"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_projections_run_fused_with_the_module_paths_bits(tiny_model_dir, tmp_path, plans, source, dtype):
    """Each quantized linear method's native products, called by the step through the dispatcher (a mix of
    kernels in one stacked projection included), give the module path's bits."""
    from metrale.gpu_worker.gguf_export import write_gguf

    folder = tiny_model_dir("llama", **K_SHAPE)
    kw = {}
    if source in ("int8", "int4"):
        path, kw = folder, {"quantization": source}
    else:
        path = tmp_path / f"tiny.{source}.gguf"
        if source == "q4_k_m":
            write_gguf(folder, path, "f32", encode=_q4_k_m)
        elif source in ("q5_k", "q6_k"):
            write_gguf(folder, path, "f32", encode=random_k_quant_encoder(source, scale=2e-4))
        else:
            write_gguf(folder, path, source)
    runner = ModelRunner(path, device="cpu", dtype=dtype, num_kv_blocks=256, show_progress=False, **kw)
    assert runner.model.fused_decode is not None
    rng = np.random.default_rng(0)
    prompts = [rng.integers(16, runner.info.vocab_size, size=n).tolist() for n in PROMPT_LENS]
    for step, (fused, modules) in enumerate(_logits_both_ways(runner, plans, prompts, 3)):
        assert torch.isfinite(modules).all()
        assert torch.equal(fused, modules), f"step {step}: fused and module logits differ"


def test_a_quantized_method_without_native_products_keeps_the_modules(tiny_model_dir, monkeypatch):
    """A dense reference product (no kernel: GgufLinearMethod(reference=True)'s form) is not a native product."""
    from metrale.gpu_worker.layers import quantization

    monkeypatch.setattr(quantization, "_kernel", lambda name, device: None)
    runner = ModelRunner(tiny_model_dir("llama"), device="cpu", quantization="int8", num_kv_blocks=16, show_progress=False)
    assert runner.model.fused_decode is None


def test_layers_outside_the_llama_form_keep_the_modules(tiny_model_dir):
    """Qwen3's per-head q/k norms are not in the fused step: the model runs its modules."""
    runner = ModelRunner(tiny_model_dir("qwen3"), device="cpu", num_kv_blocks=16, show_progress=False)
    assert runner.model.fused_decode is None
