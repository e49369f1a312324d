"""Beam search over HTTP (vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions): one engine request
per prompt, a Generate with `beam` (docs/protocol.md), which the engine core runs as a beam group
(engine_core/beam_groups.py: metrale.beam_search.BeamSearch's rules, every beam a row of the batch).

Every prompt's search is submitted at once through FrontendServer.generate_local (http_run.Run): validation, the
engine and the abort of a client that leaves are those of any request. Its one final Delta carries the hypotheses;
the search ends before the answer starts, so a search the engine refuses is an HTTP error; a stream (vLLM streams the
final beams at the end) sends each choice whole. A prompt's n hypotheses, best first,
are its n choices: each gets one final Delta made here and handed to the route as a Run's would be (BeamRun), so
the route shapes text, logprobs, token ids and usage as for any choice.

Fields beam search cannot honour (sampling, penalties, stops, grammars, tools) are a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from metrale.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams
from metrale.frontend.detokenizer import IncrementalDetokenizer
from metrale.ipc.messages import BeamHypothesis, Delta, Error, TokenLogprob
from metrale.ipc.sampling import SamplingParams

from .http_errors import ApiError
from .http_params import SamplingFields, sampling_params
from .http_run import Choice, Run

if TYPE_CHECKING:
    from .server import FrontendServer

# Fields beam search cannot honour, with the values that leave them unused (absent, or vLLM's default). tools is
# chat's (a completions body has none).
_UNUSED_BY_BEAMS: tuple[tuple[str, tuple], ...] = (
    ("temperature", (None, 0.0)),
    ("top_p", (None, 1.0)),
    ("top_k", (None, 0, -1)),
    ("min_p", (None, 0.0)),
    ("presence_penalty", (None, 0.0)),
    ("frequency_penalty", (None, 0.0)),
    ("repetition_penalty", (None, 1.0)),
    ("logit_bias", (None, {})),
    ("min_tokens", (None, 0)),
    ("max_thinking_tokens", (None,)),
    ("adaptive_sampling", (None, False)),
    ("stop", (None, [])),
    ("stop_token_ids", (None, [])),
    ("structured_outputs", (None,)),
    ("tools", (None, [])),
)
_WHY = "beam search ranks the model's raw log-probabilities: no sampling, penalties, stops, grammars or tools"


class BeamRun:
    """A finished search's choices as a Run hands a route its choices: one final Delta each, nothing left running."""

    def __init__(self, texts, deltas: list[Delta], step: SamplingParams) -> None:
        self.texts = texts  # TokenTexts (Run.collect reads it)
        self.step = step  # what each beam's step ran with
        self._deltas = deltas

    async def messages(self) -> AsyncIterator[Delta | Error]:
        """Each choice's final Delta, in order."""
        for delta in self._deltas:
            yield delta

    async def collect(self, choices: list[Choice]) -> None:
        """Fold every choice's Delta in, as a live Run's collect does (it reads only messages() and texts)."""
        await Run.collect(self, choices)

    def close(self) -> None:
        """Nothing to abort: the search's requests ended before it returned."""


def refuse_unbeamable(body: SamplingFields) -> None:
    """400 naming the first field a beam search cannot honour, or an n that is not a beam width."""
    for name, unused in _UNUSED_BY_BEAMS:
        value = getattr(body, name, None)
        if value not in unused:
            raise ApiError(400, f"{name} cannot be used with use_beam_search ({_WHY})", param=name,
                           code="unsupported_value")
    if body.prompt_logprobs is not None:
        raise ApiError(400, "prompt_logprobs cannot be used with use_beam_search (its rounds compute no prompt "
                       "logprobs)", param="prompt_logprobs", code="unsupported_value")
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise ApiError(400, f"response_format cannot be used with use_beam_search ({_WHY})", param="response_format",
                       code="unsupported_value")
    if not 1 <= body.n <= MAX_BEAM_WIDTH:
        raise ApiError(400, f"n (the beam width) must be in [1, {MAX_BEAM_WIDTH}] with use_beam_search (got {body.n})",
                       param="n", code="invalid_value")


async def beam_search(server: FrontendServer, texts, body: SamplingFields, prompts: list[list[int]],
                      max_tokens: int | None, logprobs: int | None, *, param: str, decoder=None) -> BeamRun:
    """Search each prompt's n best hypotheses; their final Deltas, prompt by prompt, best first (choice p * n + j).

    max_tokens None: up to the model's length. logprobs: top-N alternatives per token, None when not asked. param:
    what an engine error or a prompt too long names (prompt, messages). decoder: the route's, for the text. 400
    naming the field when the search cannot run; every search still running is aborted when this raises or is
    cancelled (the client left)."""
    refuse_unbeamable(body)
    checked = sampling_params(body, 1, logprobs, server.vocab_size)  # the usual ranges: logprobs, priority, seed
    asked = checked.logprobs
    searches = [_search(server, body, ids, max_tokens, param, asked or 0) for ids in prompts]  # 400s before any runs
    width = searches[0].num_logprobs  # what the rules need, or the top-N the client asked for
    step = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=width, priority=checked.priority)
    found = await _run_searches(server, texts, searches, asked, checked.priority, body.cache_salt, param)
    detok = SamplingParams(skip_special_tokens=checked.skip_special_tokens)
    deltas = []
    for s, (hypotheses, hit) in zip(searches, found):
        for h in hypotheses:
            text = IncrementalDetokenizer(decoder or server.tokenizer, s.prompt, detok).finish(h.token_ids)
            deltas.append(Delta(id=str(len(deltas)), text=text, token_ids=h.token_ids,
                                finish_reason=h.finish_reason, logprobs=_top(h.logprobs, asked),
                                prompt_tokens=len(s.prompt), completion_tokens=len(h.token_ids), cached_tokens=hit))
    return BeamRun(texts, deltas, step)


def _search(server: FrontendServer, body: SamplingFields, ids: list[int], max_tokens: int | None,
            param: str, num_logprobs: int) -> BeamSearch:
    """One prompt's search, to check it (the engine core runs it); 400 when the prompt and max_tokens do not fit the
    model or a field is out of range."""
    limit = server.max_model_len
    if limit is not None and len(ids) >= limit:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; max_model_len is {limit} (the prompt and at least "
                       "one new token must fit)", param=param, code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = limit - len(ids) if limit is not None else 16
    elif limit is not None and len(ids) + max_tokens > limit:
        raise ApiError(400, f"this model's maximum context length is {limit} tokens, but {len(ids) + max_tokens} were "
                       f"requested ({len(ids)} in the prompt, {max_tokens} in the completion); reduce the prompt or "
                       "max_tokens", param=param, code="context_length_exceeded")
    params = BeamSearchParams(
        beam_width=body.n, max_tokens=max_tokens, ignore_eos=bool(body.ignore_eos),
        length_penalty=1.0 if body.length_penalty is None else body.length_penalty,
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        early_stopping=False if body.early_stopping is None else body.early_stopping)
    try:
        return BeamSearch(ids, params, server.facts.eos_token_ids, num_logprobs)
    except ValueError as exc:  # BeamSearch's messages start with the field's name
        name = str(exc).split(" ", 1)[0]
        raise ApiError(400, str(exc), param="n" if name == "beam_width" else name, code="invalid_value") from None


async def _run_searches(server: FrontendServer, texts, searches: list[BeamSearch], asked: int | None, priority: int,
                        cache_salt: str | None, param: str) -> list[tuple[list[BeamHypothesis], int]]:
    """Run every search in the engine core (one request each, Generate.beam) to its end, all at once under one Run;
    each one's hypotheses and the prompt tokens the prefix cache held. Whatever runs when this raises or is
    cancelled is aborted."""
    run = Run(server, texts)
    found: dict[str, tuple[list[BeamHypothesis], int]] = {}
    try:
        for i, s in enumerate(searches):
            params = SamplingParams(max_tokens=s.params.max_tokens, temperature=0.0, ignore_eos=True, logprobs=asked,
                                    priority=priority)
            run.start(i, params, token_ids=s.prompt, cache_salt=cache_salt, beam=s.params)
        async for msg in run.messages():
            if isinstance(msg, Error):
                raise ApiError.from_engine(msg, param)
            if msg.finish_reason is not None:
                if msg.beams is None:
                    raise ApiError(500, f"a beam search ended {msg.finish_reason!r} without its hypotheses",
                                   type="server_error", code="internal_error")
                found[msg.id] = (msg.beams, msg.cached_tokens or 0)
    finally:
        run.close()
    return [found[str(i)] for i in range(len(searches))]


def _top(logprobs: list[TokenLogprob], asked: int | None) -> list[TokenLogprob] | None:
    """A hypothesis' logprobs with the top-N alternatives the client asked for; None when it asked for none."""
    if asked is None:
        return None
    return [TokenLogprob(t.token_id, t.logprob, t.top_ids[:asked], t.top_logprobs[:asked]) for t in logprobs]
