"""The fused native decode step (models/fused_decode.py): the module path's bits, and only where it applies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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


def test_layers_outside_the_llama_form_keep_the_modules(tiny_model_dir):
    """Qwen3's per-head q/k norms are not in the fused step: the model runs its modules."""
    runner = ModelRunner(tiny_model_dir("qwen3"), device="cpu", num_kv_blocks=16, show_progress=False)
    assert runner.model.fused_decode is None
