"""Beam search as transformers' `generate(num_beams=W)` runs it, one round at a time, with no model inside.

`BeamSearch` holds one prompt's search: its live beams, and the W best finished hypotheses. Each round its
caller runs one decode step per live beam (anyhow: `metrale.LLM.beam_search` submits each beam as a request of
max_tokens=1 asking for `num_logprobs` top alternatives; an HTTP route may do the same asynchronously) and hands
the alternatives to `advance`, which returns the next round's beams. The rules are transformers 5's
(`GenerationMixin._beam_search`), so the hypotheses equal its `num_return_sequences=W` outputs:

- Candidates: every live beam times every token, scored by the summed log-probability of the beam's generated
  tokens (float32, as transformers sums). Only the W best candidates may finish (end in an eos id, or reach
  max_tokens); a finished one enters the hypotheses with score = sum / generated_length ** length_penalty
  (the eos counted in the length), and the W best hypotheses are kept. The W best candidates that did not
  finish are the next beams (transformers' top (num_eos + 1) * W holds W of them).
- Stopping: at max_tokens; with early_stopping=True, once W hypotheses are in; else once W are in and the
  best live beam, scored at its current length (at max_tokens for early_stopping="never" with a positive
  length_penalty), does not beat the worst of them (transformers' heuristic, kept for equality).
- Result: the W hypotheses, best score first.

Where this differs from vLLM's beam search (adapted from transformers' older code): vLLM takes the W best of
all beams' alternatives, finishes those that end in an eos and runs on with the rest (fewer than W beams after
an eos), has no early stopping, and scores a hypothesis by its whole length, prompt included, eos excluded. The
returned sequences' fields are vLLM's (`tokens` with the prompt, the eos dropped unless
include_stop_str_in_output), plus `output_ids` and `score`; `text` is the output's (vLLM's offline text decodes
the prompt too).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from metrale.ipc.beam_params import MAX_BEAM_WIDTH, BeamSearchParams, _check  # noqa: F401 - re-exported
from metrale.ipc.messages import TokenLogprob
from metrale.ipc.sampling import MAX_LOGPROBS

@dataclass(slots=True)
class BeamSearchSequence:
    """One returned hypothesis (vLLM's name). cum_logprob sums every generated token's log-probability, the
    eos included even when output_ids drop it; score is what ranked it (transformers' sequences_scores)."""

    tokens: list[int]  # the prompt's ids, then output_ids
    output_ids: list[int]
    logprobs: list[TokenLogprob]  # one per output id: its log-probability and its step's top alternatives
    cum_logprob: float
    score: float
    finish_reason: str  # "stop": it ended in an eos; "length": it reached max_tokens
    text: str = ""  # the text of output_ids (filled by the caller, which has the tokenizer)


@dataclass(slots=True)
class BeamSearchOutput:
    """One prompt's result: beam_width sequences, best first."""

    sequences: list[BeamSearchSequence]


@dataclass(slots=True)
class Beam:
    """A live hypothesis: its generated tokens, their log-probabilities and their sum."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cum_logprob: np.float32 = np.float32(0.0)  # float32: transformers sums in float32, and ties follow the sums


@dataclass(order=True, slots=True)
class _Finished:
    """A finished hypothesis in the heap: ordered by score, then by arrival (the older wins a tie)."""

    score: float
    newness: int  # minus its arrival number
    beam: Beam = field(compare=False)
    finish_reason: str = field(compare=False)


def candidates_per_beam(beam_width: int, num_eos: int) -> int:
    """How many top alternatives each beam's step must report: 2 * beam_width (what vLLM asks), or more when
    there are more eos ids than beams. Enough for transformers' rules: a beam's share of the W best candidates,
    and of the W best that do not end in an eos, is within its own best W + num_eos."""
    return max(2 * beam_width, beam_width + num_eos)


class BeamSearch:
    """One prompt's beam search, fed each round's top alternatives of its live beams (see the module)."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Sequence[int],
                 num_logprobs: int = 0):
        """num_logprobs: report more alternatives per step than the rules need (a client's top-N logprobs of each
        returned token); more leave the hypotheses as they are (a beam's extra candidates rank below its own best)."""
        params.validate()
        self.prompt = list(prompt_token_ids)
        self.params = params
        # ignore_eos: an eos is an ordinary token (transformers with eos_token_id=None, vLLM's ignore_eos).
        self.eos_ids = np.array([] if params.ignore_eos else sorted(set(eos_token_ids)), dtype=np.int64)
        self.num_logprobs = max(candidates_per_beam(params.beam_width, len(self.eos_ids)), num_logprobs)
        _check(self.num_logprobs <= MAX_LOGPROBS, "beam_width",
               f"+ the model's {len(self.eos_ids)} eos ids must be at most {MAX_LOGPROBS}", params.beam_width)
        self.beams: list[Beam] = [Beam()]  # one beam to start: W copies of the prompt would propose the same tokens
        self.parents: list[int] = []  # after advance(): the row of the beams it took that each next beam continues
        self._finished: list[_Finished] = []  # a min-heap: the worst kept hypothesis first
        self._arrivals = 0
        self.done = False

    def next_inputs(self) -> list[list[int]]:
        """Each live beam's whole sequence (prompt + generated), in the order advance() takes their rows."""
        return [self.prompt + beam.output_ids for beam in self.beams]

    def advance(self, top_ids: np.ndarray, top_logprobs: np.ndarray) -> list[Beam]:
        """Take this round's alternatives: row i is live beam i's best token ids and their log-probabilities
        (the raw model distribution, best first, at least num_logprobs of them). Returns the next beams, none
        once the search is done."""
        if self.done:
            raise RuntimeError("advance() after the beam search is done")
        k, width = self.num_logprobs, self.params.beam_width
        top_ids = np.asarray(top_ids, dtype=np.int64)
        top_logprobs = np.asarray(top_logprobs, dtype=np.float32)
        rows_fit = top_ids.ndim == 2 and top_ids.shape[0] == len(self.beams) and top_ids.shape[1] >= k
        if not rows_fit or top_logprobs.shape != top_ids.shape:
            raise ValueError(f"advance() takes [{len(self.beams)}, >={k}] ids and log-probs "
                             f"(got {top_ids.shape} and {top_logprobs.shape})")
        top_ids, top_logprobs = top_ids[:, :k], top_logprobs[:, :k]
        cums = np.array([b.cum_logprob for b in self.beams], dtype=np.float32)
        scores = (cums[:, None] + top_logprobs).ravel()
        order = np.argsort(-scores, kind="stable")  # best first; a tie goes to the earlier beam, then the better rank
        length = len(self.beams[0].output_ids) + 1  # every live beam has generated as many tokens
        at_limit = length >= self.params.max_tokens
        ends_in_eos = np.isin(top_ids.ravel()[order], self.eos_ids)
        stops = ends_in_eos | at_limit
        divisor = np.float32(length ** self.params.length_penalty)
        for rank in np.flatnonzero(stops[:width]):  # only the W best may finish; the rest keep W beams running
            self._offer(self._extend(order[rank], top_ids, top_logprobs, scores), scores[order[rank]] / divisor,
                        "stop" if ends_in_eos[rank] else "length")
        chosen = order[~stops][:width]
        self.beams = [self._extend(i, top_ids, top_logprobs, scores) for i in chosen]
        self.parents = (chosen // k).tolist()  # each next beam's parent row: an engine forks that row's KV
        self.done = at_limit or not self.beams or self._cannot_improve(length)
        if self.done:
            self.beams, self.parents = [], []
        return self.beams

    def results(self) -> list[BeamSearchSequence]:
        """The kept hypotheses, best first: beam_width of them once the search is done."""
        include_eos = self.params.include_stop_str_in_output
        out = []
        for f in sorted(self._finished, reverse=True):
            beam = f.beam
            keep = len(beam.output_ids) - (f.finish_reason == "stop" and not include_eos)
            ids = beam.output_ids[:keep]
            out.append(BeamSearchSequence(tokens=self.prompt + ids, output_ids=ids, logprobs=beam.logprobs[:keep],
                                          cum_logprob=float(beam.cum_logprob), score=float(f.score),
                                          finish_reason=f.finish_reason))
        return out

    def _extend(self, flat: int, top_ids: np.ndarray, top_logprobs: np.ndarray, scores: np.ndarray) -> Beam:
        """The beam candidate `flat` (row-major in the alternatives) makes: its parent beam and one more token."""
        row, col = divmod(int(flat), top_ids.shape[1])
        parent = self.beams[row]
        picked = TokenLogprob(int(top_ids[row, col]), float(top_logprobs[row, col]),
                              top_ids[row].tolist(), top_logprobs[row].tolist())
        return Beam(parent.output_ids + [picked.token_id], parent.logprobs + [picked], scores[flat])

    def _offer(self, beam: Beam, score: np.float32, reason: str) -> None:
        """Keep a finished hypothesis if it is among the W best so far."""
        self._arrivals += 1
        entry = _Finished(float(score), -self._arrivals, beam, reason)
        if len(self._finished) < self.params.beam_width:
            heapq.heappush(self._finished, entry)
        elif entry > self._finished[0]:
            heapq.heapreplace(self._finished, entry)

    def _cannot_improve(self, length: int) -> bool:
        """True when no live beam can enter the W hypotheses any more, by transformers' rules (module doc)."""
        p = self.params
        if len(self._finished) < p.beam_width:
            return False
        if p.early_stopping is True:
            return True
        best_length = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0.0 else length
        best_possible = self.beams[0].cum_logprob / np.float32(best_length ** p.length_penalty)
        return not best_possible > np.float32(self._finished[0].score)
