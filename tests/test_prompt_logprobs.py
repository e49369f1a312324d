"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and the top alternatives, equal
to transformers' log-softmax over the same positions (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metrale.gpu_worker.model_runner import ModelRunner

MAX_LEN = 64


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def hf_model(model_path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_prompt_logprobs(hf_model, ids: list[int], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """transformers' log-probability of each token after the first, and the top n at each position before it."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    raw = torch.log_softmax(logits[:-1], dim=-1)
    picked = raw.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    top = torch.topk(raw, n, dim=-1)
    return picked.numpy(), top.indices.numpy(), top.values.numpy()


def _prompts(vocab: int, lens, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(16, vocab, size=n).tolist() for n in lens]


def test_the_runner_s_prompt_logprobs_equal_transformers_across_chunks(model_path, hf_model, plans):
    """Each prompt runs in chunks (its first chunk, a middle one, the last that samples); every chunk asks for its
    positions' logprobs, a middle chunk's last position naming the next chunk's first token (prompt_lp_next)."""
    runner = ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False)
    n = 5
    prompts = _prompts(runner.info.vocab_size, (23, 9, 40), seed=4)
    cuts = [(0, 10, 17, 23), (0, 9), (0, 1, 33, 40)]  # chunk boundaries per prompt
    got = [([], [], []) for _ in prompts]
    for k in range(3):
        rows, spans = [], []
        for i, (p, c) in enumerate(zip(prompts, cuts)):
            if k + 1 < len(c):
                a, b = c[k], c[k + 1]
                rows.append(plans.Row(p[a:b], a, plans.blocks_for(i, MAX_LEN), sample=b == len(p)))
                spans.append((i, a, b))
        plan = plans.make_plan(rows)
        for r, (i, a, b) in enumerate(spans):
            last = b == len(prompts[i])
            plan.prompt_lp_n[r] = n
            plan.prompt_lp_count[r] = b - a - last  # the prompt's last position predicts the output, not the prompt
            plan.prompt_lp_next[r] = -1 if last else prompts[i][b]
        result = runner.execute(plan)
        at = 0
        for r, (i, a, b) in enumerate(spans):
            count = int(plan.prompt_lp_count[r])
            for dest, src in zip(got[i], (result.prompt_logprobs, result.prompt_top_ids, result.prompt_top_logprobs)):
                dest.extend(src[at : at + count])
            at += count
        assert at == len(result.prompt_logprobs)
    for i, p in enumerate(prompts):
        want_lp, want_ids, want_top = hf_prompt_logprobs(hf_model, p, n)
        lp, ids, top = (np.array(x) for x in got[i])
        assert lp.shape == want_lp.shape == (len(p) - 1,)
        np.testing.assert_allclose(lp, want_lp, atol=1e-4)
        np.testing.assert_allclose(top, want_top, atol=1e-4)
        assert (ids == want_ids).mean() > 0.99  # ids may swap only at a near tie


def test_a_plan_that_asks_past_a_row_s_tokens_without_a_next_token_is_refused(model_path, plans):
    from metrale.gpu_worker.errors import PlanError

    runner = ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False)
    plan = plans.make_plan([plans.Row([20, 21, 22], 0, plans.blocks_for(0, MAX_LEN), sample=False)])
    plan.prompt_lp_n[0], plan.prompt_lp_count[0] = 2, 3  # the third position's next token is not given
    with pytest.raises(PlanError, match="prompt logprobs"):
        runner.execute(plan)
    plan.prompt_lp_count[0] = 4
    with pytest.raises(PlanError, match="prompt logprobs"):
        runner.execute(plan)


def test_fake_device_prompt_logprobs_through_the_engine_pipelined_and_synchronous():
    """Chunked prefill (8 tokens a step) of prompts asking for prompt logprobs, beside plain requests, through the
    lane and the synchronous loop: every prompt token's entry is the toy model's log-probability of it, once."""
    from metrale.engine_core.engine import EngineCore, EngineOptions
    from metrale.testing.fake_device import FakeDevice
    from metrale.testing.host_sampler import logprob_of
    from metrale.ipc.sampling import SamplingParams

    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (1, 2, 9, 30, 17)]
    for pipeline in (True, False):
        device = FakeDevice(vocab_size=512, num_kv_blocks=64, block_size=4)
        engine = EngineCore(device, EngineOptions(max_num_batched_tokens=8, max_num_seqs=8, pipeline=pipeline))
        for i, p in enumerate(prompts):
            asks = 3 if i % 2 == 0 else None
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=asks))
        got = {}
        while engine.has_unfinished():
            for d in engine.step():
                if d.prompt_logprobs is not None:
                    assert d.request_id not in got, "prompt logprobs reported twice"
                    got[d.request_id] = d.prompt_logprobs
        assert sorted(got) == ["r0", "r2", "r4"]
        for rid, entries in got.items():
            p = prompts[int(rid[1:])]
            assert len(entries) == len(p) and entries[0] is None
            for i in range(1, len(p)):
                want = logprob_of(device._logits_for(np.array(p[:i])), p[i], 3, 512)
                e = entries[i]
                assert (e.token_id, e.top_ids) == (p[i], want.top_ids)
                assert e.logprob == pytest.approx(want.logprob, abs=1e-6)


def test_llm_prompt_logprobs_equal_transformers_with_chunked_prefill(model_path, hf_model):
    """LLM.generate with prompt_logprobs (prefill chunks of 16 tokens): RequestOutput.prompt_logprobs is
    transformers' log-softmax at every prompt position, the first entry None; a request beside it without them
    reports none; n > 1 samples share one prompt's entries."""
    from metrale import LLM, SamplingParams

    llm = LLM(str(model_path), max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)
    prompts = _prompts(llm.engine.info.vocab_size, (40, 7, 2), seed=11)
    asked = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=4, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], asked)
    plain = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=3, temperature=0.0))
    assert plain[0].prompt_logprobs is None
    for p, out in zip(prompts, outs):
        want_lp, want_ids, want_top = hf_prompt_logprobs(hf_model, p, 4)
        entries = out.prompt_logprobs
        assert len(entries) == len(p) and entries[0] is None
        assert [e.token_id for e in entries[1:]] == p[1:]
        np.testing.assert_allclose([e.logprob for e in entries[1:]], want_lp, atol=1e-4)
        np.testing.assert_allclose([e.top_logprobs for e in entries[1:]], want_top, atol=1e-4)
        assert np.mean(np.array([e.top_ids for e in entries[1:]]) == want_ids) > 0.99


def test_prompt_logprobs_survive_preemption_once_each():
    """A KV pool too small for every prompt at once preempts (recompute) requests mid-prefill and after: each
    prompt token's entry is still reported once, equal to the toy model's."""
    from metrale.engine_core.engine import EngineCore, EngineOptions
    from metrale.testing.fake_device import FakeDevice
    from metrale.testing.host_sampler import logprob_of
    from metrale.ipc.sampling import SamplingParams

    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (21, 26, 19, 23)]
    device = FakeDevice(vocab_size=512, num_kv_blocks=18, block_size=4)
    engine = EngineCore(device, EngineOptions(max_num_batched_tokens=6, max_num_seqs=4))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=0))
    got = {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.prompt_logprobs is not None:
                got.setdefault(d.request_id, []).append(d.prompt_logprobs)
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        (entries,) = got[f"r{i}"]
        assert len(entries) == len(p)
        for k in range(1, len(p)):
            want = logprob_of(device._logits_for(np.array(p[:k])), p[k], 0, 512)
            assert entries[k].token_id == p[k] and entries[k].top_ids == []
            assert entries[k].logprob == pytest.approx(want.logprob, abs=1e-6)
