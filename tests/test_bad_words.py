"""bad_words (vLLM's): the frontend's tokenization of the words, and the engine's bans (FakeDevice) — a one-token
word is never picked, a longer word's last token never follows its other tokens — the same in the pipelined lane
(whose masks for a row fed ahead are checked once its token is committed) as in the synchronous loop."""

from __future__ import annotations

import pytest

from metrale.frontend.bad_words import bad_words_token_ids
from metrale.ipc.plan import FedAheadPolicy
from metrale.ipc.sampling import SamplingParams

from engine_harness import Req, run_workload

WORDS = {"cat": [7], " cat": [8], "hot dog": [3, 4, 5], " hot dog": [9, 4, 5], "dog": [4, 5], " dog": [6, 5],
         "ab": [1, 2], " ab": [10, 11, 12]}


def test_each_word_is_banned_alone_and_after_a_space_when_that_is_a_token_of_its_own():
    encode = WORDS.__getitem__
    assert bad_words_token_ids(["cat", "  hot dog"], encode) == [[7], [8], [3, 4, 5], [9, 4, 5]]
    assert bad_words_token_ids(["ab"], encode) == [[1, 2]]  # " ab" has another length: not a word token
    with pytest.raises(ValueError, match="non-empty"):
        bad_words_token_ids(["  "], encode)


def _reqs(bad: list[list[int]] | None, temperatures=(0.0, 0.0, 0.7)) -> list[Req]:
    return [Req([5 + i, 9, 11], SamplingParams(max_tokens=40, temperature=t, seed=30 + i, ignore_eos=True,
                                               bad_words_token_ids=bad))
            for i, t in enumerate(temperatures)]


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def _bad_words_from(free: dict[str, list[int]]) -> list[list[int]]:
    """A one-token word and two two-token words that the unconstrained outputs hold."""
    greedy = free["0"]
    pairs = [greedy[i : i + 2] for i in range(len(greedy) - 1) if greedy[i] != greedy[i + 1]]
    assert len(pairs) >= 2, greedy
    return [[greedy[0]], pairs[0], pairs[-1]]


@pytest.mark.parametrize("policy", [FedAheadPolicy.REWIND, FedAheadPolicy.REPICK_ONLY])
def test_bad_words_are_never_generated_and_the_lane_streams_what_the_synchronous_loop_streams(policy):
    free = run_workload(_reqs(None), pipeline=False, policy=policy, repetitive=True)
    bad = _bad_words_from(free.streams)
    reference = run_workload(_reqs(bad), pipeline=False, policy=policy, repetitive=True)
    piped = run_workload(_reqs(bad), pipeline=True, policy=policy, repetitive=True, count_effects=True)
    assert piped.streams == reference.streams
    for i in ("0", "1", "2"):
        assert len(reference.streams[i]) == 40
        assert not any(_contains(reference.streams[i], w) for w in bad), (bad, reference.streams[i])
    assert reference.streams["0"] != free.streams["0"]
    # A row fed ahead is picked under the one-token bans alone; once its prefix token is committed, the row's mask
    # holds the word's last token too: a stale mask, rewound or repicked on the host.
    stale = piped.effects["trim"] if policy == FedAheadPolicy.REWIND else piped.engine.io.repicks
    assert stale > 0, "no row met a prefix while fed ahead: the test did not test"


def test_a_long_word_is_banned_only_after_its_whole_prefix():
    """[a, b, c]: c is banned after a b only — after b alone it stays allowed (the greedy pick there)."""
    free = run_workload(_reqs(None, (0.0,)), pipeline=False, repetitive=True)
    out = free.streams["0"]
    i = next(i for i in range(1, len(out) - 1) if out[i - 1] != out[i] and [out[i], out[i + 1]] != out[i - 1: i + 1])
    other = next(t for t in range(4, 48) if t not in out)
    bad = [[other, out[i], out[i + 1]]]  # a prefix the output never has
    assert run_workload(_reqs(bad, (0.0,)), pipeline=True, repetitive=True).streams["0"] == out
