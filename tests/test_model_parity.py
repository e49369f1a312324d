"""Parity with Hugging Face transformers: greedy tokens and logits from our paged runner equal theirs.

Our side is driven the way the engine core drives it: a batch of prompts of different lengths,
prefilled together (optionally in chunks under a token budget, so steps mix prefill chunks with decode
rows and later chunks attend to the cached prefix), then decoded one token per row per step with the
inputs fed on the device. Theirs is `generate(do_sample=False)`, one prompt at a time.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from metrale.gpu_worker.model_runner import ModelRunner

transformers = pytest.importorskip("transformers")

NUM_NEW = 32
PROMPT_LENS = (3, 7, 12, 16, 17, 25, 33, 40)
MAX_LEN = max(PROMPT_LENS) + NUM_NEW
# Where both models run: cpu here and in CI; scripts/gpu_check.sh sets cuda on a machine with a GPU.
DEVICE = os.environ.get("METRALE_TEST_DEVICE", "cpu")
# On a GPU cuBLAS and transformers' SDPA sum in other orders than our kernels: the worst gap seen on an
# H200 was 1.08e-4 (llama3-rope, tokens still identical), so the GPU gets twice the CPU's bound.
LOGIT_ATOL = 1e-4 if DEVICE == "cpu" else 2e-4

VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "llama-linear-rope": ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    # Past max_position_embeddings (48) dynamic NTK rescales per step, as transformers does.
    "llama-dynamic-rope": (
        "llama",
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}, "max_position_embeddings": 48},
    ),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "llama-yarn-rope": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}),
}


@dataclass
class _Seq:
    """One test sequence on our side: its prompt, what is in the cache, what it generated."""

    prompt: list[int]
    blocks: list[int]
    cached: int = 0
    out: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    row: int = -1  # its row in the last step, if it sampled there


def run_greedy(runner: ModelRunner, prompts, num_new: int, plans, *, budget: int | None = None) -> list[_Seq]:
    """Greedy-generate num_new tokens per prompt, scheduling like the engine core (decodes first, then
    prefill chunks within the step's token budget); decode inputs are fed on the device."""
    seqs = [_Seq(p, plans.blocks_for(i, MAX_LEN)) for i, p in enumerate(prompts)]
    while any(len(s.out) < num_new for s in seqs):
        rows, members = [], []
        for i, s in enumerate(seqs):
            if s.cached >= len(s.prompt) and 0 < len(s.out) < num_new:
                rows.append(plans.Row([0], s.cached, s.blocks, feed_from_row=s.row, state_slot=i))
                members.append((s, 1))
        left = budget if budget is not None else 1 << 30
        left -= len(rows)
        for i, s in enumerate(seqs):
            todo = len(s.prompt) - s.cached
            if todo <= 0 or left <= 0:
                continue
            n = min(todo, left)
            left -= n
            rows.append(plans.Row(s.prompt[s.cached : s.cached + n], s.cached, s.blocks, sample=n == todo, state_slot=i))
            members.append((s, n))
        plan = plans.make_plan(rows)
        result = runner.execute(plan)
        logits = runner.read_logits()
        for r, (s, n) in enumerate(members):
            s.cached += n
            s.row = r if plan.sample[r] else -1
            if plan.sample[r]:
                s.out.append(int(result.tokens[r]))
                s.logits.append(logits[r])
    return seqs


def hf_generate(model, prompt: list[int], num_new: int):
    """Transformers' greedy tokens and per-step logits for one prompt."""
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is not None and hasattr(rotary, "original_inv_freq"):
        # Dynamic NTK state carries over between calls in transformers; start each prompt afresh.
        rotary.inv_freq = rotary.original_inv_freq.clone()
        rotary.max_seq_len_cached = rotary.original_max_seq_len
    out = model.generate(
        torch.tensor([prompt], device=DEVICE),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=DEVICE),
        do_sample=False,
        max_new_tokens=num_new,
        eos_token_id=None,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = [step[0].float().cpu().numpy() for step in out.logits]
    return tokens, logits


def _hf_model(path, dtype=torch.float32, attn="sdpa"):
    """The transformers model for a folder, greedy and quiet."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).to(DEVICE)
    model.generation_config.eos_token_id = None
    return model.eval()


def _hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    """Transformers' logits at the last position of one sequence, on the host."""
    with torch.no_grad():
        return model(torch.tensor([ids], device=DEVICE)).logits[0, -1].float().cpu()


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of PROMPT_LENS lengths (ids past the special tokens)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(16, vocab, size=n).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_and_logits_match_transformers(variant, tiny_model_dir, plans):
    arch, kw = VARIANTS[variant]
    path = tiny_model_dir(arch, **kw)
    runner = ModelRunner(path, device=DEVICE, num_kv_blocks=512, show_progress=False)
    prompts = _prompts(runner.info.vocab_size)
    ours = run_greedy(runner, prompts, NUM_NEW, plans)
    hf = _hf_model(path)
    for i, (prompt, seq) in enumerate(zip(prompts, ours)):
        tokens, logits = hf_generate(hf, prompt, NUM_NEW)
        assert seq.out == tokens, f"{variant}: prompt {i} (len {len(prompt)}) diverges"
        worst = max(float(np.abs(a - b).max()) for a, b in zip(seq.logits, logits))
        # Logits reach ~40 here, where float32 sums taken in another order (the generic CPU class's scalar kernels
        # and SSE-capped oneDNN against transformers') part by a few dozen ulps: LOGIT_ATOL for logits up to 16,
        # in proportion above.
        scale = max(1.0, max(float(np.abs(b).max()) for b in logits) / 16)
        assert worst < LOGIT_ATOL * scale, f"{variant}: prompt {i} logits differ by {worst} (scale {scale:.1f})"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_mixed_with_decodes_matches_transformers(arch, tiny_model_dir, plans):
    """A 12-token budget splits prompts into chunks (later chunks read the cached prefix) and puts
    chunks of two rows and decode rows in the same step."""
    path = tiny_model_dir(arch)
    runner = ModelRunner(path, device=DEVICE, num_kv_blocks=512, show_progress=False)
    prompts = _prompts(runner.info.vocab_size, seed=1)
    ours = run_greedy(runner, prompts, 16, plans, budget=12)
    hf = _hf_model(path)
    for i, (prompt, seq) in enumerate(zip(prompts, ours)):
        tokens, logits = hf_generate(hf, prompt, 16)
        assert seq.out == tokens, f"{arch}: prompt {i} diverges under chunked prefill"
        worst = max(float(np.abs(a - b).max()) for a, b in zip(seq.logits, logits))
        assert worst < LOGIT_ATOL


def test_one_step_mixes_two_prefill_chunks_and_decode_rows(tiny_model_dir, plans):
    """Explicitly: one plan holding a first chunk, a last chunk over a cached prefix, and two decodes."""
    path = tiny_model_dir("llama")
    runner = ModelRunner(path, device=DEVICE, num_kv_blocks=512, show_progress=False)
    a, b, c, d = _prompts(runner.info.vocab_size, seed=2)[4:]  # lengths 17, 25, 33, 40
    blocks = [plans.blocks_for(i, MAX_LEN) for i in range(4)]
    Row = plans.Row
    # Step 1: prefill c and d whole, and b's first 10 tokens.
    step1 = [Row(c, 0, blocks[2]), Row(d, 0, blocks[3]), Row(b[:10], 0, blocks[1], sample=False)]
    first = runner.execute(plans.make_plan(step1))
    # Step 2: a's first chunk, b's last chunk (attends to its 10 cached tokens), c and d decode.
    step2 = plans.make_plan(
        [
            Row(a[:9], 0, blocks[0], sample=False),
            Row(b[10:], 10, blocks[1]),
            Row([int(first.tokens[0])], len(c), blocks[2]),
            Row([int(first.tokens[1])], len(d), blocks[3]),
        ]
    )
    second = runner.execute(step2)
    logits = runner.read_logits()
    assert second.tokens[0] == -1
    hf = _hf_model(path)
    expect = {
        1: _hf_last_logits(hf, b),
        2: _hf_last_logits(hf, c + [int(first.tokens[0])]),
        3: _hf_last_logits(hf, d + [int(first.tokens[1])]),
    }
    for row, want in expect.items():
        assert int(second.tokens[row]) == int(want.argmax())
        assert np.abs(logits[row] - want.numpy()).max() < LOGIT_ATOL
    # Step 3: a's last chunk over its cached 9 tokens.
    third = runner.execute(plans.make_plan([Row(a[9:], 9, blocks[0])]))
    want = _hf_last_logits(hf, a)
    assert int(third.tokens[0]) == int(want.argmax())
    assert np.abs(runner.read_logits()[0] - want.numpy()).max() < LOGIT_ATOL


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_argmax_agrees_with_transformers_bf16_under_teacher_forcing(arch, tiny_model_dir, plans):
    path = tiny_model_dir(arch)
    runner = ModelRunner(path, device=DEVICE, dtype="bfloat16", num_kv_blocks=512, show_progress=False)
    assert runner.info.dtype == "bfloat16"
    rng = np.random.default_rng(3)
    vocab = runner.info.vocab_size
    seqs = [rng.integers(16, vocab, size=n + NUM_NEW).tolist() for n in PROMPT_LENS]
    blocks = [plans.blocks_for(i, MAX_LEN) for i in range(len(seqs))]
    ours = [[] for _ in seqs]
    # Prefill the prompts, then feed the fixed continuations from the host one token per step.
    result = runner.execute(plans.make_plan([plans.Row(s[:n], 0, b) for s, n, b in zip(seqs, PROMPT_LENS, blocks)]))
    for k in range(NUM_NEW - 1):
        for i in range(len(seqs)):
            ours[i].append(int(result.tokens[i]))
        rows = [plans.Row([s[n + k]], n + k, b) for s, n, b in zip(seqs, PROMPT_LENS, blocks)]
        result = runner.execute(plans.make_plan(rows))
    for i in range(len(seqs)):
        ours[i].append(int(result.tokens[i]))
    hf = _hf_model(path, dtype=torch.bfloat16)
    agree = total = 0
    with torch.no_grad():
        for s, n, mine in zip(seqs, PROMPT_LENS, ours):
            theirs = hf(torch.tensor([s], device=DEVICE)).logits[0, n - 1 : n - 1 + NUM_NEW].argmax(-1).tolist()
            agree += sum(x == y for x, y in zip(mine, theirs))
            total += len(theirs)
    assert agree / total >= 0.95, f"bf16 argmax agreement {agree}/{total}"


# Checkpoints transformers itself makes and saves (tests/hf_models.py): each family's own names, fusions
# and config fields. Prompts cross the sliding windows (8) mid-generation.
HF_PROMPT_LENS = (3, 12, 17, 40)
HF_NUM_NEW = 24
_LONGROPE = {
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],
    },
    "original_max_position_embeddings": 32,
}
# transformers' Phi-3 generate recomputes the whole cache when a sequence first grows past
# original_max_position_embeddings (so earlier keys get the long factors too); the runner, like vLLM, keeps the
# cache and rotates the tokens past it with the long factors. Against generate, longrope prompts therefore
# stay below 32 throughout or start past it; test_longrope_switches_per_row_as_transformers_forward covers a
# row crossing it.
_LONGROPE_LENS = (3, 5, 33, 40)
# Gemma 2's soft-capped attention has no SDPA form in transformers: its reference runs eager attention.
HF_EAGER = ("gemma2",)
HF_VARIANTS = {
    "gemma2": ("gemma2", {}, HF_PROMPT_LENS),
    "gemma3": ("gemma3", {}, HF_PROMPT_LENS),
    "phi3": ("phi3", {}, HF_PROMPT_LENS),
    "phi3-longrope": ("phi3", _LONGROPE, _LONGROPE_LENS),
    "phi3-partial-rotary": ("phi3", {"partial_rotary_factor": 0.5}, HF_PROMPT_LENS),
    "phi3-window": ("phi3", {"sliding_window": 8}, HF_PROMPT_LENS),
    "olmo2": ("olmo2", {}, HF_PROMPT_LENS),
    "qwen3_moe": ("qwen3_moe", {}, HF_PROMPT_LENS),
    "qwen3_moe-dense-layer": ("qwen3_moe", {"mlp_only_layers": [1], "norm_topk_prob": False}, HF_PROMPT_LENS),
    "mixtral": ("mixtral", {}, HF_PROMPT_LENS),
    "mixtral-window": ("mixtral", {"sliding_window": 8}, HF_PROMPT_LENS),
    "bamba": ("bamba", {}, HF_PROMPT_LENS),
}


def _hf_prompts(vocab: int, lens) -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [rng.integers(16, vocab, size=n).tolist() for n in lens]


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_transformers_made_checkpoints_match_transformers(variant, hf_model_dir, plans):
    kind, kw, lens = HF_VARIANTS[variant]
    path = hf_model_dir(kind, **kw)
    runner = ModelRunner(path, device=DEVICE, num_kv_blocks=256, show_progress=False)
    prompts = _hf_prompts(runner.info.vocab_size, lens)
    ours = run_greedy(runner, prompts, HF_NUM_NEW, plans)
    hf = _hf_model(path, attn="eager" if kind in HF_EAGER else "sdpa")
    for i, (prompt, seq) in enumerate(zip(prompts, ours)):
        tokens, logits = hf_generate(hf, prompt, HF_NUM_NEW)
        assert seq.out == tokens, f"{variant}: prompt {i} (len {len(prompt)}) diverges"
        worst = max(float(np.abs(a - b).max()) for a, b in zip(seq.logits, logits))
        # Logits reach ~40 here, where float32 sums taken in another order (the generic CPU class's scalar kernels
        # and SSE-capped oneDNN against transformers') part by a few dozen ulps: LOGIT_ATOL for logits up to 16,
        # in proportion above.
        scale = max(1.0, max(float(np.abs(b).max()) for b in logits) / 16)
        assert worst < LOGIT_ATOL * scale, f"{variant}: prompt {i} logits differ by {worst} (scale {scale:.1f})"


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "bamba"])
def test_transformers_made_checkpoints_under_chunked_prefill(kind, hf_model_dir, plans):
    """A 12-token budget: later chunks read their cached prefix through sliding and global layers (Gemma 2's
    soft-capped ones on the eager path), or continue their recurrent state from the slot (Bamba)."""
    path = hf_model_dir(kind)
    runner = ModelRunner(path, device=DEVICE, num_kv_blocks=256, show_progress=False)
    prompts = _hf_prompts(runner.info.vocab_size, HF_PROMPT_LENS)
    ours = run_greedy(runner, prompts, 8, plans, budget=12)
    hf = _hf_model(path, attn="eager" if kind in HF_EAGER else "sdpa")
    for i, (prompt, seq) in enumerate(zip(prompts, ours)):
        tokens, logits = hf_generate(hf, prompt, 8)
        assert seq.out == tokens, f"{kind}: prompt {i} diverges under chunked prefill"
        assert max(float(np.abs(a - b).max()) for a, b in zip(seq.logits, logits)) < LOGIT_ATOL


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "olmo2", "qwen3_moe", "bamba"])
def test_transformers_made_checkpoints_in_bf16_agree_with_transformers_bf16(kind, hf_model_dir, plans):
    """bf16 (the float32-scale norms off the native kernel, the eager soft-capped path, bf16 routing, a bf16
    conv state beside a float32 SSM state): teacher-forced argmaxes agree with transformers' own bf16 run."""
    path = hf_model_dir(kind)
    runner = ModelRunner(path, device=DEVICE, dtype="bfloat16", num_kv_blocks=256, show_progress=False)
    seqs = _hf_prompts(runner.info.vocab_size, (9, 20, 33))
    blocks = [plans.blocks_for(i, MAX_LEN) for i in range(len(seqs))]
    result = runner.execute(plans.make_plan([plans.Row(s[:-8], 0, b, state_slot=i) for i, (s, b) in enumerate(zip(seqs, blocks))]))
    ours = [[int(t)] for t in result.tokens]
    for k in range(7):
        rows = [plans.Row([s[len(s) - 8 + k]], len(s) - 8 + k, b, state_slot=i) for i, (s, b) in enumerate(zip(seqs, blocks))]
        result = runner.execute(plans.make_plan(rows))
        for i, t in enumerate(result.tokens):
            ours[i].append(int(t))
    hf = _hf_model(path, dtype=torch.bfloat16, attn="eager" if kind in HF_EAGER else "sdpa")
    agree = total = 0
    with torch.no_grad():
        for s, mine in zip(seqs, ours):
            theirs = hf(torch.tensor([s], device=DEVICE)).logits[0, len(s) - 9 : len(s) - 1].argmax(-1).tolist()
            agree += sum(x == y for x, y in zip(mine, theirs))
            total += len(theirs)
    assert agree / total >= 0.9, f"{kind}: bf16 argmax agreement {agree}/{total}"


def _kept_cache(model, out) -> dict:
    """The forward keyword that hands a model output's cache back (transformers 5 renamed it `cache`)."""
    cache = getattr(out, "cache", None) or out.past_key_values
    return {"cache": cache} if "cache" in inspect.signature(model.forward).parameters else {"past_key_values": cache}


def test_longrope_switches_per_row_as_transformers_forward(hf_model_dir, plans):
    """Rows crossing original_max_position_embeddings (32) mid-decode, batched with a row past it from the
    start: each row's tokens past 32 take the long factors, its cached keys stay, as transformers' forward over
    a kept cache computes them (teacher-forced with our tokens)."""
    path = hf_model_dir("phi3", **_LONGROPE)
    runner = ModelRunner(path, device=DEVICE, num_kv_blocks=256, show_progress=False)
    prompts = _hf_prompts(runner.info.vocab_size, (12, 17, 40))
    ours = run_greedy(runner, prompts, HF_NUM_NEW, plans)
    hf = _hf_model(path)
    for prompt, seq in zip(prompts, ours):
        with torch.no_grad():
            out = hf(torch.tensor([prompt], device=DEVICE), use_cache=True)
            theirs = [out.logits[0, -1].float().cpu().numpy()]
            for tok in seq.out[:-1]:
                out = hf(torch.tensor([[tok]], device=DEVICE), use_cache=True, **_kept_cache(hf, out))
                theirs.append(out.logits[0, -1].float().cpu().numpy())
        assert [int(t.argmax()) for t in theirs] == seq.out
        worst = max(float(np.abs(a - b).max()) for a, b in zip(seq.logits, theirs))
        scale = max(1.0, max(float(np.abs(b).max()) for b in theirs) / 16)  # as above: ulps grow with the logits
        assert worst < LOGIT_ATOL * scale, f"logits differ by {worst} (scale {scale:.2f})"


def test_recurrent_state_slots_are_reset_and_kept_apart(hf_model_dir, plans):
    """Bamba's Mamba state lives in state slots: generating again in slots other sequences left dirty (a row
    at position 0 resets its slot), and in another assignment of slots, gives the same tokens and logits."""
    path = hf_model_dir("bamba")
    runner = ModelRunner(path, device=DEVICE, num_kv_blocks=256, show_progress=False, max_num_seqs=8)
    assert runner.info.fed_ahead_policy.value == "repick_only" and runner.info.num_state_slots == 8
    prompts = _hf_prompts(runner.info.vocab_size, HF_PROMPT_LENS)
    first = run_greedy(runner, prompts, 8, plans)
    again = run_greedy(runner, prompts[::-1], 8, plans)[::-1]  # every slot now holds another prompt's state
    for a, b in zip(first, again):
        assert a.out == b.out
        assert max(float(np.abs(x - y).max()) for x, y in zip(a.logits, b.logits)) < 1e-5


def test_a_recurrent_model_refuses_plans_without_their_state_slots(hf_model_dir, plans):
    """No slot, a slot outside the state, two rows in one slot, or drafts: a ValueError before anything runs."""
    runner = ModelRunner(hf_model_dir("bamba"), device=DEVICE, num_kv_blocks=256, show_progress=False, max_num_seqs=4)
    blocks = [plans.blocks_for(i, MAX_LEN) for i in range(2)]
    for slots, why in (((-1, -1), "state slot"), ((0, 4), "state slot"), ((1, 1), "share a state slot")):
        rows = [plans.Row([20, 21], 0, blocks[i], state_slot=slots[i]) for i in range(2)]
        plan = plans.make_plan(rows)
        with pytest.raises(ValueError, match=why):
            runner.execute(plan)
    # Drafts (a verify step) would run through the state, which cannot drop the rejected ones.
    rows = [plans.Row([20, 21], 0, blocks[i], state_slot=i) for i in range(2)]
    plan = plans.make_plan(rows)
    plan.num_drafts = np.array([1, 0], dtype=np.int32)
    with pytest.raises(ValueError, match="draft tokens for a recurrent model"):
        runner.execute_verify(plan)
