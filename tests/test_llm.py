"""The offline engine, metrale.LLM, on tiny random models: exactness, seeds, the lane, bad input."""

from __future__ import annotations

import json
import random

import pytest

from metrale import LLM, SamplingParams
from metrale.frontend.detokenizer import IncrementalDetokenizer
from metrale.testing.invariants import check_pool


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(str(tiny_model_dir("llama")), show_progress=False, max_num_seqs=32) as engine:
        yield engine
        pool = engine.engine.pool
        check_pool(pool)
        assert pool.num_used == 0


def _prompts(n: int, seed: int = 0, vocab: int = 1000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_tokens_equal_transformers_generate(tiny_model_dir, arch):
    """A batch of 8 prompts of different lengths: every greedy token equals transformers' generate."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = tiny_model_dir(arch)
    prompts = _prompts(8, seed=1)
    with LLM(str(path), show_progress=False) as engine:
        ours = engine.generate(prompts, SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, ours):
        ids = torch.tensor([prompt])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        assert out.token_ids == gen[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["gemma3", "mixtral", "bamba"])
def test_new_architectures_generate_through_llm_as_transformers_does(hf_model_dir, kind):
    """The whole offline engine (scheduler, lane, bursts) on checkpoints transformers saved: greedy tokens equal
    its generate."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = hf_model_dir(kind)
    prompts = _prompts(4, seed=5)
    with LLM(str(path), show_progress=False) as engine:
        ours = engine.generate(prompts, SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, ours):
        ids = torch.tensor([prompt])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out.token_ids == gen[0, len(prompt):].tolist()


def test_pipelined_equals_synchronous_for_32_requests(tiny_model_dir, llm):
    """Greedy and seeded, 32 requests: the lane on and off give the same tokens."""
    prompts = _prompts(32, seed=2)
    params = [
        SamplingParams(max_tokens=20 + i % 7, temperature=0.0 if i % 2 else 0.9, seed=i, min_tokens=i % 3)
        for i in range(32)
    ]
    piped = llm.generate(prompts, params)
    with LLM(str(tiny_model_dir("llama")), show_progress=False, pipeline=False, max_num_seqs=32) as sync:
        plain = sync.generate(prompts, params)
    assert [o.token_ids for o in piped] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in piped] == [o.finish_reason for o in plain]


def test_seeded_request_is_batch_invariant(llm):
    """The same (prompt, seed) gives the same tokens alone and inside 16 mixed requests."""
    target = _prompts(1, seed=3)[0]
    p = SamplingParams(max_tokens=24, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([target], p)[0].token_ids
    others = _prompts(15, seed=4)
    mixed = [SamplingParams(max_tokens=10 + i, temperature=0.7, seed=i) for i in range(15)]
    batch = llm.generate(others[:7] + [target] + others[7:], mixed[:7] + [p] + mixed[7:])
    assert batch[7].token_ids == alone
    other_seed = llm.generate([target], SamplingParams(max_tokens=24, temperature=1.0, top_k=50, seed=4321, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_text_prompts_and_stop_strings(llm):
    out = llm.generate("def add(a, b):", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    stop = out.text[5:9]
    cut = llm.generate("def add(a, b):", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == out.text[: out.text.index(stop)]
    assert cut.token_ids == out.token_ids[: len(cut.token_ids)]


def _pushed_text(tokenizer, prompt: list[int], out: list[int], params: SamplingParams) -> str:
    """The text of pushing each token to a detokenizer as it came (the streaming path), then flushing."""
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    text = ""
    for token in out:
        delta, stopped = detok.push([token])
        text += delta
        if stopped:
            return text
    return text + detok.flush()


@pytest.mark.parametrize("skip", [True, False])
def test_text_is_what_pushing_each_token_gives(llm, skip):
    """Hot random sampling (character fragments, special tokens): the text made once at the end, and the
    text of requests with stop strings (pushed every step), equal pushing each token as it came."""
    prompts = _prompts(12, seed=5)
    params = [
        SamplingParams(
            max_tokens=48, temperature=2.0, seed=i, ignore_eos=True, skip_special_tokens=skip,
            stop=["e", "("] if i % 3 == 0 else [],
        )
        for i in range(12)
    ]
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.text == _pushed_text(llm.tokenizer, prompt, out.token_ids, p)
    texts = "".join(o.text for o, p in zip(outs, params) if not p.stop)
    assert "\ufffd" in texts  # broken characters were produced, so the split-character case was exercised
    specials = llm.tokenizer.special_token_ids
    assert any(t in specials for o in outs for t in o.token_ids)


def test_logit_bias_steers_greedy_and_seeded_picks_and_leaves_the_batch_alone(llm):
    """+100 on a token makes it every pick (greedy and seeded), -100 keeps one out, logprobs stay the raw
    distribution's, and unbiased requests in the same batch give what they give alone."""
    prompts = _prompts(6, seed=7)
    free = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True) for i in range(4)]
    alone = [o.token_ids for o in llm.generate(prompts[:4], free)]
    first = alone[1][0]  # a greedy request's first pick, banned below
    biased = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={77: 100.0}, logprobs=0),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={first: -100.0})]
    out = llm.generate(prompts[:4] + [prompts[4], prompts[1]], free + biased)
    assert [o.token_ids for o in out[:4]] == alone
    assert out[4].token_ids == [77] * 12
    assert all(lp.logprob < -1e-3 for lp in out[4].logprobs)  # raw: +100 would make them ~0
    assert first not in out[5].token_ids
    seeded = llm.generate([prompts[5]], SamplingParams(max_tokens=8, temperature=1.2, seed=9, logit_bias={78: 100.0}))
    assert seeded[0].token_ids == [78] * 8


def test_logprobs_are_returned_per_token(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0.0
        assert len(lp.top_ids) == 3 and lp.top_ids[0] == tok  # greedy: the pick is the top-1


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([5, 6], SamplingParams(max_tokens=-1), "max_tokens"),
        ([5, 6], SamplingParams(top_p=0.0), "top_p"),
        ([5, 6], SamplingParams(top_p=1.5), "top_p"),
        ([5] * 5000, SamplingParams(max_tokens=4), "prompt has 5000 tokens"),
        ([5, 10**7], SamplingParams(max_tokens=4), "token_ids"),
        ([5, 6], SamplingParams(logit_bias={10**7: 1.0}), "logit_bias ids must be token ids of the vocabulary"),
        ([5, 6], SamplingParams(logit_bias={5: -101.0}), "logit_bias values"),
    ],
)
def test_bad_input_raises_value_error_naming_the_field(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([[5, 6, 7], prompt], [SamplingParams(max_tokens=4), params])
    assert not llm.engine.has_unfinished()
    assert llm.engine.pool.num_used == 0


def test_unsupported_architecture_is_refused_by_name(tiny_model_dir, tmp_path):
    import shutil

    src = tiny_model_dir("llama")
    dst = tmp_path / "odd"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    cfg["model_type"] = "mamba"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MambaForCausalLM"):
        LLM(str(dst), show_progress=False)


def test_a_recurrent_model_repairs_stale_masks_on_the_host_and_streams_as_the_synchronous_loop(hf_model_dir):
    """Bamba (Mamba state in state slots, RepickOnly) through the pipelined lane: prompts that open <think> with a
    budget of a few tokens, min_tokens, greedy and seeded rows. The step launched after a forced </think> was
    picked under a mask now stale; the host picks it again from the worker's logits, so the tokens equal the
    synchronous loop's, and the repairs are counted."""
    from metrale.gpu_worker.tiny_model import SPECIAL_TOKENS, THINK

    path = str(hf_model_dir("bamba"))
    think = SPECIAL_TOKENS.index(THINK)
    prompts = [p + [think] for p in _prompts(6, seed=9, vocab=2000)]
    params = [
        SamplingParams(max_tokens=14, min_tokens=6, max_thinking_tokens=1 + i % 3,
                       temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=100 + i, logprobs=2 if i == 1 else None)
        for i in range(len(prompts))
    ]
    outs = {}
    for pipeline in (False, True):
        with LLM(path, show_progress=False, pipeline=pipeline, max_num_seqs=8) as engine:
            outs[pipeline] = engine.generate(prompts, params)
            stats = engine.stats()
        assert (stats.repicks > 0) == pipeline
    for sync, piped in zip(outs[False], outs[True]):
        assert piped.token_ids == sync.token_ids
        assert piped.finish_reason == sync.finish_reason
    lp_sync, lp_piped = outs[False][1].logprobs, outs[True][1].logprobs
    assert [t.token_id for t in lp_piped] == [t.token_id for t in lp_sync]
    assert [t.logprob for t in lp_piped] == pytest.approx([t.logprob for t in lp_sync], abs=1e-4)


def test_a_recurrent_model_preempted_by_recompute_streams_as_with_room(hf_model_dir):
    """Bamba in a KV pool too small for its batch: preempted sequences give their state slot back and recompute
    from position 0 in the next one (swap asked for, recompute used); tokens equal a run with room to spare."""
    path = str(hf_model_dir("bamba"))
    prompts = [[30 + 11 * i + j for j in range(10)] for i in range(4)]  # 30 tokens each: 4 blocks of 8, 9 in the pool
    params = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0 if i % 2 else 0.7, seed=i) for i in range(4)]
    with LLM(path, show_progress=False) as roomy:
        want = roomy.generate(prompts, params)
    with LLM(path, show_progress=False, num_kv_blocks=9, block_size=8, preemption_mode="swap", swap_space_gb=0.01) as tight:
        got = tight.generate(prompts, params)
        assert tight.stats().preemptions > 0
        assert tight.engine.options.preemption_mode == "recompute"
    assert [o.finish_reason for o in got] == ["length"] * 4
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_offline_logprobs_follow_max_logprobs(default_model):
    """LLM(max_logprobs=N) serves up to N alternatives, prompt logprobs too; more is a ValueError naming the field."""
    from metrale import LLM, SamplingParams

    with LLM(str(default_model), max_logprobs=30) as llm:
        out = llm.generate(["def f(x):"], SamplingParams(max_tokens=1, logprobs=30, prompt_logprobs=25))[0]
        assert len(out.outputs[0].logprobs[0].top_ids) == 30
        assert all(len(entry.top_ids) == 25 for entry in out.prompt_logprobs[1:])
        with pytest.raises(ValueError, match="logprobs"):
            llm.generate(["x"], SamplingParams(max_tokens=1, logprobs=31))
