"""Embeddings requests in the engine core (FakeDevice): pooled across prefill chunks, beside generating requests,
through the lane and the synchronous loop, preemption and the prefix cache; the toy model's hidden states
(fake_device.fake_hidden) give the expected vectors."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.engine_core.engine import EngineCore, EngineOptions
from metrale.testing.fake_device import FakeDevice, fake_hidden
from metrale.ipc.errors import Refused
from metrale.ipc.pooling import PoolingParams
from metrale.ipc.sampling import SamplingParams


def expected(prompt: list[int], pooling: str, normalize: bool = True, dimensions: int | None = None) -> np.ndarray:
    """The toy model's embedding of prompt as `pooling` pools it."""
    states = [fake_hidden(prompt[: i + 1]) for i in range(len(prompt))]
    vector = {"last": states[-1], "cls": states[0], "mean": np.mean(states, axis=0)}[pooling]
    vector = vector[:dimensions] if dimensions else vector
    return vector / np.linalg.norm(vector) if normalize else vector


def run(engine: EngineCore) -> tuple[dict, dict, dict]:
    """Step until idle: each request's streamed tokens, its finish reason, its embedding (reported once)."""
    tokens, finish, embeddings = {}, {}, {}
    while engine.has_unfinished():
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.embedding is not None:
                assert d.request_id not in embeddings, "an embedding reported twice"
                embeddings[d.request_id] = d.embedding
            if d.finish_reason is not None:
                finish[d.request_id] = d.finish_reason
    return tokens, finish, embeddings


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("pipeline", [True, False])
def test_embeddings_beside_generation_are_the_model_s_pooled_states_and_change_no_stream(pooling, pipeline):
    """Prompts of 1 to 30 tokens in chunks of 8, embeddings and generations interleaved: each embedding is the
    pooled, normalised hidden states of its whole prompt; the generations stream what they stream alone."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (1, 30, 9, 17, 2, 8, 23)]

    def engine(with_embeddings: bool) -> EngineCore:
        device = FakeDevice(vocab_size=512, num_kv_blocks=128, block_size=4, pooling=pooling)
        e = EngineCore(device, EngineOptions(max_num_batched_tokens=8, max_num_seqs=8, pipeline=pipeline))
        for i, p in enumerate(prompts):
            if i % 2:
                if with_embeddings:
                    e.add_request(f"e{i}", p, SamplingParams(), pooling=PoolingParams())
            else:
                e.add_request(f"g{i}", p, SamplingParams(max_tokens=6, ignore_eos=True, seed=i))
        return e

    tokens, finish, embeddings = run(engine(True))
    alone, _, _ = run(engine(False))
    assert {k: v for k, v in tokens.items() if k.startswith("g")} == alone
    assert sorted(embeddings) == ["e1", "e3", "e5"]
    for rid, vector in embeddings.items():
        assert finish[rid] == "stop" and tokens[rid] == []
        np.testing.assert_allclose(vector, expected(prompts[int(rid[1:])], pooling), rtol=1e-5, atol=1e-6)


def test_a_one_token_embedding_beside_decodes_that_burst_and_speculate():
    """A one-token prompt looks like a decode: it must never join a decode burst or a verify step (it samples
    nothing), yet it is pooled right beside rows that do both."""
    device = FakeDevice(vocab_size=512, num_kv_blocks=128, block_size=4, max_burst=4, repetitive=True)
    engine = EngineCore(device, EngineOptions(max_num_batched_tokens=64, max_num_seqs=8, stream_interval=4,
                                              speculative="ngram", num_speculative_tokens=3))
    for i in range(3):
        engine.add_request(f"g{i}", [5 + i, 7, 5 + i, 7], SamplingParams(max_tokens=24, ignore_eos=True, temperature=0))
    early = [d for _ in range(2) for d in engine.step()]
    engine.add_request("e", [42], SamplingParams(), pooling=PoolingParams(normalize=False))
    tokens, finish, embeddings = run(engine)
    for d in early:
        tokens[d.request_id] = d.new_token_ids + tokens[d.request_id]
    np.testing.assert_allclose(embeddings["e"], expected([42], "last", normalize=False), rtol=1e-5)
    assert all(len(tokens[f"g{i}"]) == 24 for i in range(3))
    assert engine.stats().spec_draft_tokens > 0


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_survive_preemption_and_use_the_prefix_cache_only_when_last_token_pooled(pooling):
    """A KV pool too small for every prompt at once preempts (recompute) requests mid-prefill; a prompt sharing
    a long prefix with an earlier one hits the prefix cache when it pools its last token only (a mean needs every
    position computed). Every embedding is still its whole prompt's."""
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 500, size=16).tolist()
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (21, 26, 19, 23)] + [shared + [7, 8], shared + [9]]
    device = FakeDevice(vocab_size=512, num_kv_blocks=18, block_size=4, pooling=pooling)
    engine = EngineCore(device, EngineOptions(max_num_batched_tokens=6, max_num_seqs=4, enable_prefix_caching=True))
    for i, p in enumerate(prompts[:4]):  # generations grow into the pool and preempt the embeddings between them
        engine.add_request(f"g{i}", p[::-1], SamplingParams(max_tokens=12, ignore_eos=True))
        engine.add_request(f"e{i}", p, SamplingParams(), pooling=PoolingParams())
    seqs = dict(engine.requests)
    _, _, embeddings = run(engine)
    assert sum(seqs[f"e{i}"].num_preemptions for i in range(4)) > 0
    engine.add_request("e4", prompts[4], SamplingParams(), pooling=PoolingParams())
    _, _, more = run(engine)
    hits = engine.pool.stats.hit_tokens
    engine.add_request("e5", prompts[5], SamplingParams(), pooling=PoolingParams())
    _, _, last = run(engine)
    embeddings |= more | last
    assert (engine.pool.stats.hit_tokens > hits) == (pooling == "last")
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(embeddings[f"e{i}"], expected(p, pooling), rtol=1e-5, atol=1e-6)


def test_dimensions_cut_and_renormalise_where_the_model_allows_them():
    device = FakeDevice(vocab_size=512, num_kv_blocks=64, block_size=4, matryoshka=True)
    engine = EngineCore(device, EngineOptions(max_num_batched_tokens=8, max_num_seqs=4))
    engine.add_request("a", [5, 6, 7], SamplingParams(), pooling=PoolingParams(dimensions=3))
    _, _, embeddings = run(engine)
    assert len(embeddings["a"]) == 3
    np.testing.assert_allclose(embeddings["a"], expected([5, 6, 7], "last", dimensions=3), rtol=1e-5)
    with pytest.raises(Refused, match="dimensions must be"):
        engine.add_request("b", [5], SamplingParams(), pooling=PoolingParams(dimensions=9))


def test_a_request_the_model_cannot_embed_is_refused_naming_why():
    engine = EngineCore(FakeDevice(vocab_size=512, num_kv_blocks=64, block_size=4), EngineOptions())
    with pytest.raises(Refused, match="Matryoshka"):
        engine.add_request("a", [5], SamplingParams(), pooling=PoolingParams(dimensions=2))
    with pytest.raises(Refused, match="no output"):
        engine.add_request("b", [5], SamplingParams(prompt_logprobs=1), pooling=PoolingParams())
    assert not engine.has_unfinished()
