"""Speculative decoding on the real model runner: metrale.LLM and `metrale serve` with --speculative ngram give
the tokens (and logprobs) of decoding without it, greedy and seeded.

The tiny model's weights are random, so its outputs seldom repeat (few n-gram drafts, most wrong): the runner's
verify step is also driven through the Proposer seam, with drafts that are all right (an oracle that knows the
plain output) and all wrong, so both the accepting and the rejecting paths run on the real sampler.
"""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.engine_core.sequence import Sequence

from serve_fixture import running_server

PROMPTS = ["the cat sat on the mat; the cat sat on the", "import os\nimport", "def add(a, b):\n    return a +",
           "one two three four one two"]
MAX_TOKENS = 120  # long enough that the random model repeats a token or two (n-gram drafts)


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 == 0 else 0.8, seed=i, ignore_eos=True,
                          logprobs=2 if i == 1 else None)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    with LLM(str(tiny_model_dir("llama")), show_progress=False) as llm:
        return llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])


class Oracle:
    """Drafts the plain output's next tokens (right = True) or tokens it does not pick (right = False)."""

    def __init__(self, reference, right: bool) -> None:
        self.outputs = {tuple(r.prompt_token_ids): r.token_ids for r in reference}
        self.right = right

    def propose(self, seq: Sequence, k: int) -> list[int]:
        out = self.outputs[tuple(seq.tokens[: seq.num_prompt])]
        nxt = out[seq.num_output : seq.num_output + k]
        return nxt if self.right else [(t + 1) % 1000 for t in nxt]


def _assert_equal(outs, reference) -> None:
    for ref, out in zip(reference, outs):
        assert out.token_ids == ref.token_ids
        assert [(t.token_id, t.top_ids) for t in out.logprobs or []] == [(t.token_id, t.top_ids) for t in ref.logprobs or []]
        assert [t.logprob for t in out.logprobs or []] == pytest.approx([t.logprob for t in ref.logprobs or []], abs=1e-4)


@pytest.mark.parametrize("proposer", ["ngram", "right", "wrong"])
def test_llm_with_drafts_equals_plain_decoding(tiny_model_dir, reference, proposer):
    """n-gram, always-right and always-wrong drafts: every token and logprob equals decoding without drafts."""
    with LLM(str(tiny_model_dir("llama")), show_progress=False, speculative="ngram", num_speculative_tokens=4) as llm:
        if proposer != "ngram":
            llm.engine.speculator.proposer = Oracle(reference, proposer == "right")
        outs = llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
        stats = llm.stats()
    _assert_equal(outs, reference)
    assert stats.spec_draft_tokens > 0
    if proposer == "right":  # the seeded rows' picks are the plain ones too: every draft is kept
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    if proposer == "wrong":
        assert stats.spec_accepted_tokens == 0


def test_serve_with_ngram_drafts_streams_what_the_offline_engine_gives(tiny_model_dir, reference):
    """Through the worker process and the ticket ring (a verify step's picks come back as a burst's results)."""
    with running_server(tiny_model_dir("llama"), "--speculative", "ngram", "--num-speculative-tokens", "3") as server:
        with server.client() as client:
            for i, prompt in enumerate(PROMPTS):
                out = client.complete(prompt, params=_params(i))
                assert out.token_ids == reference[i].token_ids, i
            stats = client.stats()
    assert stats.spec_draft_tokens > 0
