"""LLM.beam_search against transformers' generate(num_beams=W) on tiny fp32 models: the same hypotheses, token for
token, and the same scores; and metrale/beam_search.py's rules on hand-fed rounds.

Most tests use a llama with a 24-token vocabulary: its two eos ids (<|endoftext|> and <|im_end|>) are then
often among a round's best candidates, so hypotheses finish at many lengths and the length penalty and the
early-stopping rules decide which are returned.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from metrale import LLM, BeamSearchParams, SamplingParams
from metrale.beam_search import BeamSearch
from metrale.testing.invariants import check_pool

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL_VOCAB = 24


def _prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def _close(engine: LLM) -> None:
    """Close engine after checking that beam search left nothing behind: no request, no used block."""
    assert not engine.engine.has_unfinished()
    pool = engine.engine.pool
    check_pool(pool)
    assert pool.num_used == 0
    engine.close()


@pytest.fixture(scope="module")
def small_vocab_dir(tiny_model_dir):
    return tiny_model_dir("llama", vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="module")
def small(small_vocab_dir):
    engine = LLM(str(small_vocab_dir), show_progress=False)
    yield engine
    _close(engine)


@pytest.fixture(scope="module")
def small_hf(small_vocab_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(small_vocab_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llama(llama_dir):
    engine = LLM(str(llama_dir), show_progress=False)
    yield engine
    _close(engine)


def hf_beams(model, prompt: list[int], width: int, max_tokens: int, **kw) -> list[tuple[list[int], float]]:
    """Transformers' W hypotheses for one prompt, best first: (generated ids, eos included; score)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                         do_sample=False, max_new_tokens=max_tokens, return_dict_in_generate=True,
                         output_scores=True, pad_token_id=0, **kw)
    # A shorter hypothesis is padded to the longest; its beam indices say how many tokens it generated.
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [(out.sequences[i, len(prompt):len(prompt) + n].tolist(), float(out.sequences_scores[i]))
            for i, n in enumerate(lengths)]


def assert_equal_to_transformers(model, prompts, outputs, params: BeamSearchParams, **hf_kw) -> None:
    """Each prompt's sequences equal transformers' token for token, scores within 1e-4; the fields agree."""
    assert params.include_stop_str_in_output  # transformers keeps the eos in its sequences
    hf_kw.setdefault("length_penalty", params.length_penalty)
    hf_kw.setdefault("early_stopping", params.early_stopping)
    for prompt, out in zip(prompts, outputs, strict=True):
        theirs = hf_beams(model, prompt, params.beam_width, params.max_tokens, **hf_kw)
        assert [s.output_ids for s in out.sequences] == [ids for ids, _ in theirs]
        assert [s.score for s in out.sequences] == pytest.approx([score for _, score in theirs], abs=1e-4)
        for s in out.sequences:
            assert s.tokens == prompt + s.output_ids
            assert len(s.logprobs) == len(s.output_ids)
            assert [lp.token_id for lp in s.logprobs] == s.output_ids
            assert s.cum_logprob == pytest.approx(sum(lp.logprob for lp in s.logprobs), abs=1e-4)
            assert s.score == pytest.approx(s.cum_logprob / len(s.output_ids) ** params.length_penalty, abs=1e-4)
            ends_in_eos = s.output_ids[-1] in model.generation_config.eos_token_id
            assert s.finish_reason == ("stop" if ends_in_eos else "length")
            assert ends_in_eos or len(s.output_ids) == params.max_tokens


def _finished_early(outputs, max_tokens: int) -> int:
    """How many returned sequences ended in an eos before max_tokens."""
    return sum(s.finish_reason == "stop" and len(s.output_ids) < max_tokens for o in outputs for s in o.sequences)


def test_width_1_equals_greedy_generate(llama, llama_dir, small, small_hf):
    """One beam is greedy decoding: the tokens of LLM.generate at temperature 0 and of transformers' greedy
    generate, eos included, on both models (the small one stops at an eos inside the horizon)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    stopped = 0
    for engine, model, vocab in ((llama, hf, 1000), (small, small_hf, SMALL_VOCAB)):
        prompts = _prompts(4, seed=1, vocab=vocab)
        beams = engine.beam_search(prompts, BeamSearchParams(1, 16, include_stop_str_in_output=True))
        greedy = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
        for prompt, b, g in zip(prompts, beams, greedy):
            ids = torch.tensor([prompt])
            theirs = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                    pad_token_id=0)[0, len(prompt):].tolist()
            assert len(b.sequences) == 1
            assert b.sequences[0].output_ids == g.token_ids == theirs
            stopped += g.finish_reason == "stop"
    assert stopped > 0  # an eos ended a beam, and greedy, early


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beams_equal_transformers(small, small_hf, width, length_penalty):
    """Four prompts in one call: each prompt's W hypotheses equal transformers' generate(num_beams=W), with
    hypotheses finished at several lengths among them."""
    prompts = _prompts(4, seed=2, vocab=SMALL_VOCAB)
    params = BeamSearchParams(width, 10, length_penalty=length_penalty, include_stop_str_in_output=True)
    outputs = small.beam_search(prompts, params)
    assert [len(o.sequences) for o in outputs] == [width] * 4
    assert_equal_to_transformers(small_hf, prompts, outputs, params)
    assert _finished_early(outputs, 10) > 0


def test_length_penalty_decides_between_short_and_long_hypotheses(small):
    """The same search under penalties 0 and 2 returns different hypotheses (so the penalty is applied to
    hypotheses of different lengths), and 2 favours the longer ones."""
    prompts = _prompts(4, seed=2, vocab=SMALL_VOCAB)
    runs = {lp: small.beam_search(prompts, BeamSearchParams(4, 10, length_penalty=lp)) for lp in (0.0, 2.0)}
    ids = {lp: [[s.output_ids for s in o.sequences] for o in outs] for lp, outs in runs.items()}
    assert ids[0.0] != ids[2.0]
    mean_length = {lp: np.mean([len(s.output_ids) for o in outs for s in o.sequences]) for lp, outs in runs.items()}
    assert mean_length[2.0] > mean_length[0.0]


def test_early_stopping_modes_equal_transformers(small, small_hf):
    """early_stopping False, True and "never" each equal transformers, and on these prompts True and "never"
    each return something False does not (each mode's rule decided a search)."""
    prompts = _prompts(6, seed=5, vocab=SMALL_VOCAB)
    results = {}
    for mode in (False, True, "never"):
        params = BeamSearchParams(3, 12, length_penalty=1.5, early_stopping=mode, include_stop_str_in_output=True)
        outputs = small.beam_search(prompts, params)
        assert_equal_to_transformers(small_hf, prompts, outputs, params)
        results[mode] = [[s.output_ids for s in o.sequences] for o in outputs]
    assert results[True] != results[False]
    assert results["never"] != results[False]


def test_ignore_eos_continues_through_eos_as_transformers_without_eos(small, small_hf):
    """ignore_eos: an eos is an ordinary token (transformers' eos_token_id=None); every hypothesis runs to
    max_tokens, and some carry an eos inside."""
    prompts = _prompts(4, seed=4, vocab=SMALL_VOCAB)
    params = BeamSearchParams(3, 10, ignore_eos=True, include_stop_str_in_output=True)
    outputs = small.beam_search(prompts, params)
    for prompt, out in zip(prompts, outputs):
        theirs = hf_beams(small_hf, prompt, 3, 10, eos_token_id=None)
        assert [s.output_ids for s in out.sequences] == [ids for ids, _ in theirs]
        assert [s.score for s in out.sequences] == pytest.approx([score for _, score in theirs], abs=1e-4)
        assert all(s.finish_reason == "length" and len(s.output_ids) == 10 for s in out.sequences)
    eos = set(small_hf.generation_config.eos_token_id)
    assert any(eos & set(s.output_ids) for o in outputs for s in o.sequences)


def test_the_eos_is_dropped_from_tokens_and_text_unless_include_stop_str_in_output(small):
    """vLLM's default: a hypothesis that ended in an eos returns without it (tokens, output_ids, logprobs,
    text); its cum_logprob and score still count it. include_stop_str_in_output keeps it."""
    prompts = _prompts(4, seed=2, vocab=SMALL_VOCAB)
    kept = small.beam_search(prompts, BeamSearchParams(4, 10, include_stop_str_in_output=True))
    dropped = small.beam_search(prompts, BeamSearchParams(4, 10))
    assert _finished_early(kept, 10) > 0
    for prompt, k, d in zip(prompts, kept, dropped):
        for a, b in zip(k.sequences, d.sequences):
            cut = 1 if a.finish_reason == "stop" else 0
            assert b.output_ids == a.output_ids[:len(a.output_ids) - cut]
            assert b.tokens == prompt + b.output_ids
            assert [lp.token_id for lp in b.logprobs] == b.output_ids
            want = [lp.logprob for lp in a.logprobs[:len(b.logprobs)]]
            assert [lp.logprob for lp in b.logprobs] == pytest.approx(want, abs=1e-5)
            assert b.finish_reason == a.finish_reason
            # The second run's prompts hit the first's cached blocks: the same values up to rounding.
            assert (b.cum_logprob, b.score) == pytest.approx((a.cum_logprob, a.score), abs=1e-5)
            assert b.text == small.tokenizer.decode(b.output_ids)


def test_prompts_as_text_ids_and_vllm_dicts_give_the_same_beams(llama):
    """A text prompt, its ids, and vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dicts: the same
    hypotheses; the text of each is the decode of its output ids."""
    text = "def add(a, b):"
    ids = llama.tokenizer.encode(text)
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    by_text, by_ids, by_dicts = (
        llama.beam_search(text, params),
        llama.beam_search(ids, params),
        llama.beam_search([{"prompt": text}, {"prompt_token_ids": ids}], params),
    )
    want = [s.tokens for s in by_ids[0].sequences]
    assert len(by_text) == len(by_ids) == 1 and len(by_dicts) == 2
    for out in (by_text[0], *by_dicts):
        assert [s.tokens for s in out.sequences] == want
    for s in by_ids[0].sequences:
        assert s.tokens[:len(ids)] == ids
        assert s.text == llama.tokenizer.decode(s.output_ids) and s.text


def test_beams_share_their_parents_blocks(llama, monkeypatch):
    """A 64-token prompt (4 blocks of 16), 4 beams, 6 rounds: after the prompt's prefill each beam's step computes
    its new token and at most the rest of its parent's last, partial block (at most 16 + 1 tokens), not its whole
    sequence again: a forked beam shares its parent's full blocks."""
    llama.reset_prefix_cache()
    prompt = _prompts(1, seed=5, vocab=1000)[0]
    prompt = (prompt * 64)[:64]
    device = llama.engine.device
    launch = device.launch
    computed = []

    def counting(plan, *args, **kw):
        computed.append(len(plan.positions))
        return launch(plan, *args, **kw)

    monkeypatch.setattr(device, "launch", counting)
    out = llama.beam_search([prompt], BeamSearchParams(4, 6, ignore_eos=True))
    assert len(out[0].sequences) == 4
    assert computed[0] == len(prompt)
    assert sum(computed) <= len(prompt) + 5 * 4 * (16 + 1)
    assert sum(computed) < len(prompt) + 5 * 4 * len(prompt) // 2  # far from recomputing the sequences


@pytest.mark.parametrize("limits", [dict(max_waiting=3, max_num_seqs=8),
                                    dict(num_kv_blocks=12, preemption_mode="swap"),
                                    dict(num_kv_blocks=12, pipeline=False)])
def test_many_searches_under_small_limits_equal_each_search_alone(llama_dir, limits):
    """Ten prompts at once on an engine with room for few rows (forks wait for a row), or a KV cache of 12 blocks of
    16 (beam rows preempted: swapped, or recomputed in the synchronous loop): each prompt's hypotheses equal its
    search run alone on an engine with room for everything, and every block comes back (a search that waited for a
    row, or whose rows were preempted or released for room, would otherwise never end)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(3, 40))] for _ in range(10)]
    params = BeamSearchParams(4, 12, ignore_eos=True)
    small = LLM(str(llama_dir), show_progress=False, **limits)
    step, ticks = small.engine.step, []

    def bounded():  # a deadlock fails the test instead of hanging it
        ticks.append(1)
        assert len(ticks) < 5000, "the searches stopped making progress"
        return step()

    small.engine.step = bounded
    try:
        together = small.beam_search(prompts, params)
        if "num_kv_blocks" in limits:
            assert small.engine.scheduler.num_preemptions > 0
        assert small.engine.pool.num_used == 0
    finally:
        small.close()
    roomy = LLM(str(llama_dir), show_progress=False)
    try:
        alone = [roomy.beam_search([p], params)[0] for p in prompts]
    finally:
        roomy.close()
    # The ids equal; a score may move in its last bits (a row recomputed after a preemption computes its KV in a
    # prefill, not decode by decode).
    assert [[s.output_ids for s in o.sequences] for o in together] == [[s.output_ids for s in o.sequences] for o in alone]
    assert [s.score for o in together for s in o.sequences] == \
        pytest.approx([s.score for o in alone for s in o.sequences], abs=1e-5)


@pytest.mark.parametrize(
    "params, field",
    [
        (BeamSearchParams(beam_width=0, max_tokens=4), "beam_width"),
        (BeamSearchParams(beam_width=11, max_tokens=4), "beam_width"),
        (BeamSearchParams(beam_width=2.0, max_tokens=4), "beam_width"),
        (BeamSearchParams(beam_width=2, max_tokens=0), "max_tokens"),
        (BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7), "temperature"),
        (BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=math.nan), "length_penalty"),
        (BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping"),
        (BeamSearchParams(beam_width=2, max_tokens=4, early_stopping=1), "early_stopping"),
        (BeamSearchParams(beam_width=2, max_tokens=600), "max_tokens 600 after a prompt"),
    ],
)
def test_bad_params_raise_value_error_naming_the_field(small, params, field):
    with pytest.raises(ValueError, match=field):
        small.beam_search([[5, 6, 7]], params)
    assert not small.engine.has_unfinished()


def test_a_bad_prompt_raises_before_anything_is_queued(small):
    """A token past the vocabulary, or an empty prompt, in the second prompt: ValueError naming it."""
    with pytest.raises(ValueError, match="token_ids"):
        small.beam_search([[5, 6, 7], [5, SMALL_VOCAB]], BeamSearchParams(2, 4))
    with pytest.raises(ValueError, match="at least one token"):
        small.beam_search([[5, 6, 7], []], BeamSearchParams(2, 4))
    assert not small.engine.has_unfinished()
    assert small.beam_search([], BeamSearchParams(2, 4)) == []


def test_a_device_error_in_a_later_round_ends_the_search_and_frees_its_blocks(small, monkeypatch):
    """The device refuses the search's steps from its third on (a step launched ahead is only declined, the next
    one fails its rows): the error comes out, and every beam row is retired, its blocks freed."""
    from metrale.ipc.plan import DeviceError

    device = small.engine.device
    launch = device.launch
    calls = []

    def refuse_from_the_third(*args, **kw):
        calls.append(1)
        if len(calls) >= 3:
            raise DeviceError("refused for the test")
        return launch(*args, **kw)

    monkeypatch.setattr(device, "launch", refuse_from_the_third)
    with pytest.raises(RuntimeError, match="refused for the test"):
        small.beam_search([[5, 6, 7]], BeamSearchParams(3, 8, ignore_eos=True))
    assert not small.engine.has_unfinished()
    assert small.engine.pool.num_used == 0


# ---- the rules on hand-fed rounds (no model) ---------------------------------------------------------------

EOS = 0


def _round(rows: list[dict[int, float]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """A round's alternatives from {token: logprob} per beam, best first, padded to k with poor tokens."""
    ids, lps = [], []
    for row in rows:
        best = sorted(row.items(), key=lambda kv: -kv[1])
        best += [(100 + j, -50.0 - j) for j in range(k - len(best))]
        ids.append([t for t, _ in best[:k]])
        lps.append([lp for _, lp in best[:k]])
    return np.array(ids), np.array(lps, dtype=np.float32)


def test_only_the_best_w_candidates_may_finish():
    """An eos ranked below the W best candidates of the round is not a hypothesis; one ranked among them is,
    and the beams that run on are the W best that did not finish."""
    search = BeamSearch([7], BeamSearchParams(2, 5, include_stop_str_in_output=True), eos_token_ids=[EOS])
    k = search.num_logprobs
    search.advance(*_round([{1: -0.1, 2: -0.2, 3: -0.3, EOS: -5.0}], k))
    assert [b.output_ids for b in search.beams] == [[1], [2]]
    # Round 2: beam [1]'s eos is the second best candidate (finishes), beam [2]'s eos the fourth (does not).
    beams = search.advance(*_round([{4: -0.1, EOS: -0.2, 5: -3.0}, {6: -0.15, EOS: -0.5}], k))
    assert [b.output_ids for b in beams] == [[1, 4], [2, 6]]
    assert [(s.output_ids, s.finish_reason) for s in search.results()] == [([1, EOS], "stop")]
    assert search.results()[0].score == pytest.approx(-0.3 / 2)


def test_hypotheses_keep_the_w_best_scores_and_stop_when_none_can_improve():
    """Two hypotheses in (W = 2); the next round's best live beam, scored at its length, is below the worse
    of them, so the search is done (early_stopping False) and returns them best first."""
    search = BeamSearch([7], BeamSearchParams(2, 10, include_stop_str_in_output=True), eos_token_ids=[EOS])
    k = search.num_logprobs
    search.advance(*_round([{EOS: -0.1, 1: -0.2, 2: -0.3}], k))  # [EOS] finishes: score -0.1
    assert not search.done
    search.advance(*_round([{EOS: -0.1, 3: -2.0}, {4: -3.0, 5: -3.5}], k))  # [1, EOS]: -0.3 / 2
    assert search.done and search.beams == []
    assert [(s.output_ids, s.finish_reason) for s in search.results()] == [([EOS], "stop"), ([1, EOS], "stop")]
    assert [s.score for s in search.results()] == pytest.approx([-0.1, -0.15])


def test_advance_refuses_rows_that_do_not_match_the_beams():
    search = BeamSearch([7], BeamSearchParams(2, 4), eos_token_ids=[EOS])
    ids, lps = _round([{1: -0.1}, {2: -0.2}], search.num_logprobs)  # two rows for the one starting beam
    with pytest.raises(ValueError, match="advance"):
        search.advance(ids, lps)
    with pytest.raises(ValueError, match="advance"):
        search.advance(ids[:1, :2], lps[:1, :2])  # fewer alternatives than num_logprobs
