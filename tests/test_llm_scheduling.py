"""Scheduler features on the real tiny model: the outputs never depend on how the work was scheduled."""

from __future__ import annotations

import random

import pytest

from metrale import LLM, SamplingParams
from metrale.testing.invariants import check_pool


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama", max_position_embeddings=2048))


def _run(model: str, prompts, params, **kw):
    with LLM(model, show_progress=False, **kw) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.stats()
        check_pool(llm.engine.pool)
        assert llm.engine.pool.num_used == 0
    return [o.token_ids for o in outs], stats


def test_chunked_prefill_gives_the_same_tokens_as_whole_prefill(model):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (700, 90, 300, 12)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    chunked, _ = _run(model, prompts, params, max_num_batched_tokens=64)
    whole, _ = _run(model, prompts, params, max_num_batched_tokens=4096)
    assert chunked == whole


def test_prefix_cache_hits_and_changes_no_token(model):
    rng = random.Random(6)
    prefix = [rng.randrange(3, 2000) for _ in range(512)]
    prompts = [prefix + [rng.randrange(3, 2000) for _ in range(5)] for _ in range(16)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(model, show_progress=False, max_num_batched_tokens=4096) as llm:
        first = llm.generate(prompts[:1], params)  # computes the prefix once
        rest = llm.generate(prompts[1:], params)
        cached = [o.token_ids for o in first + rest]
        hit_rate = llm.stats().prefix_cache_hit_rate
    plain, _ = _run(model, prompts, params, enable_prefix_caching=False, max_num_batched_tokens=4096)
    assert cached == plain
    assert hit_rate > 0.8
    # Each request says what it found: nothing for the first, the prefix's whole blocks for the rest.
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [512] * len(rest)


def test_reset_prefix_cache_forgets_every_cached_block(model):
    """After a reset the same prompt hits nothing and gives the same tokens; the pool stays whole."""
    rng = random.Random(8)
    prompt = [rng.randrange(3, 2000) for _ in range(100)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(model, show_progress=False) as llm:
        pool = llm.engine.pool
        first = llm.generate([prompt], params)[0].token_ids
        assert pool.num_cached > 0
        hits = pool.stats.hit_tokens
        assert llm.generate([prompt], params)[0].token_ids == first
        assert pool.stats.hit_tokens > hits
        assert llm.reset_prefix_cache()
        assert pool.num_cached == 0
        check_pool(pool)
        hits = pool.stats.hit_tokens
        assert llm.generate([prompt], params)[0].token_ids == first
        assert pool.stats.hit_tokens == hits


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_small_pool_serves_32_long_requests_identically(model, mode):
    """A pool for ~8 sequences, 32 requests of 16 + 48 tokens: all complete, tokens equal a roomy run."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 2000) for _ in range(16)] for _ in range(32)]
    params = [SamplingParams(max_tokens=48, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True) for i in range(32)]
    roomy, _ = _run(model, prompts, params, max_num_seqs=32)
    tight, stats = _run(model, prompts, params, max_num_seqs=32, num_kv_blocks=8 * 4, preemption_mode=mode, swap_space_gb=0.01)
    assert tight == roomy
    assert stats.preemptions > 0
    if mode == "swap":
        assert stats.swapped_out_blocks > 0 and stats.swapped_in_blocks == stats.swapped_out_blocks
