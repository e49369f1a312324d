"""POST /v1/completions: prompts (text or token ids) × n choices, streamed or whole, with echo and logprobs in
the completions API's columnar shape. Echo with logprobs lists the prompt's tokens first, with their logprobs (the
engine's prompt logprobs; the first token's null), and `max_tokens: 0` with echo answers the prompt alone: how
OpenAI's legacy completions (and vLLM) score a text. vLLM's prompt_logprobs comes on each whole choice.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from metrale.ipc.messages import Delta, Error, TokenLogprob
from metrale.ipc.sampling import SamplingParams

from .detokenizer import IncrementalDetokenizer
from .http_errors import ApiError, json_response
from .http_access_log import CHOICES
from .http_beam import beam_search
from .http_extensions import check_pinned, needs_prompt_ids, prompt_ids, prompt_logprob_dicts, refuse_unserved, token_label
from .http_params import (SamplingFields, ServedModel, check_count, check_stream_options, decode_body, sampling_params,
                          seeded)
from .http_reply import Reply, TokenTexts, stream
from .http_run import Choice, Run

if TYPE_CHECKING:
    from .server import FrontendServer

Prompt = tuple[str | None, list[int] | None]  # (text, None) or (None, token ids)


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions."""

    prompt: str | list | None = None  # None (or empty): refused with vLLM's sentence
    prompt_embeds: object = None  # vLLM's: refused unless empty (this server takes no embeddings as input)
    max_tokens: int | None = 16  # 0 only with echo: the prompt alone (OpenAI's way of scoring one)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


@dataclass(slots=True)
class Echo:
    """What echo puts in front of one prompt's choices: its text and, with logprobs, where each of its tokens (those
    the engine ran, after truncate_prompt_tokens) starts in that text."""

    text: str
    starts: list[int] | None = None


class Completions:
    """The /v1/completions handler over one FrontendServer."""

    def __init__(self, server: FrontendServer, model: ServedModel, texts: TokenTexts) -> None:
        self.server = server
        self.model = model
        self.texts = texts

    def _encode(self, text: str) -> list[int]:
        """text's token ids without special tokens (bad_words)."""
        return self.server.tokenizer.encode(text, False)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        body = await decode_body(request, CompletionRequest)
        self.model.check(body.model)
        _refuse_unsupported(body)
        given = prompts = _prompts(body.prompt, self.server.vocab_size)
        scored = body.echo and body.logprobs is not None  # the echoed prompt's tokens are listed with their logprobs
        # Tokenized here, as the engine path would, to be truncated, returned, counted per chunk, extended by beams
        # or listed.
        if needs_prompt_ids(body, self.model.force_usage) or body.use_beam_search or scored:
            prompts = [(None, await prompt_ids(self.server, body, text, ids, True)) for text, ids in given]
        echo = None
        if body.echo:
            echo = [Echo(self._echo_text(text, ids)) for text, ids in given]
            if scored:
                for e, (text, ids), (_, kept) in zip(echo, given, prompts):
                    e.starts = await self._starts(text, ids, kept)
        check_count(len(prompts) * body.n)
        choices = request[CHOICES] = [Choice(index=p * body.n + j, prompt_index=p, prompt_ids=ids)  # the access
                                      for p, (_, ids) in enumerate(prompts) for j in range(body.n)]  # log counts them
        if body.use_beam_search:  # the whole search runs here; each choice comes as one final Delta
            run = await beam_search(self.server, self.texts, body, [ids for _, ids in prompts], body.max_tokens,
                                    body.logprobs, param="prompt")
        else:
            run = await self._start(body, prompts)
        try:
            reply = Reply("cmpl", "text_completion", self.model.reply_name(body.model), body.stream_options, self.model.force_usage,
                          per_request_metrics=self.model.per_request_metrics)
            label = token_label(self.texts, self.model.tokens_as_ids(body.return_tokens_as_token_ids))
            if body.stream:
                return await stream(request, run, choices, reply, lambda c, msg: self._chunk(c, msg, label, body, echo))
            await run.collect(choices)
            return json_response(reply.completion(choices, [self._choice(c, label, body, echo) for c in choices]))
        finally:
            run.close()

    async def _start(self, body: CompletionRequest, prompts: list[Prompt]) -> Run | PromptOnly:
        """Submit each prompt's n choices and wait for each one's first output; closed here on an error."""
        # Given, max_tokens must fit beside the prompt (400 otherwise); null: the rest of the context.
        max_tokens = body.max_tokens if body.max_tokens is not None else self.server.max_model_len or 16
        prompt_only = body.echo and max_tokens == 0  # each choice runs the one token the engine must, then drops it
        check_pinned(body, body.logprobs, self.server.vocab_size, self.server.max_logprobs)
        logprobs = 0 if body.logprob_token_ids is not None else body.logprobs  # the ids take the top-N's place
        params = sampling_params(body, 1 if prompt_only else max_tokens, logprobs, self.server.vocab_size,
                                 defaults=self.model.sampling_defaults, prompt_logprobs=_prompt_logprobs(body),
                                 max_logprobs=self.server.max_logprobs, encode=self._encode)
        adapter = self.model.adapter(body.model)
        run = Run(self.server, self.texts)
        try:
            for p, (text, ids) in enumerate(prompts):
                for j in range(body.n):
                    run.start(p * body.n + j, seeded(params, j), prompt=text, token_ids=ids,
                              cache_salt=body.cache_salt, strict_length=body.max_tokens is not None, lora=adapter)
            await run.wait_first("prompt")
        except BaseException:  # refused, or the client left: nothing of it may keep running
            run.close()
            raise
        return PromptOnly(run) if prompt_only else run

    def _echo_text(self, text: str | None, ids: list[int] | None) -> str:
        """A prompt's text, to put in front of its choices (echo)."""
        return text if text is not None else self.server.tokenizer.decode(ids, skip_special_tokens=False)

    async def _starts(self, text: str | None, ids: list[int] | None, kept: list[int]) -> list[int]:
        """Where each of a prompt's kept tokens (its last ones, after truncation) starts in its echoed text: for a
        text prompt, where the tokenizer found it; for token ids, the characters of the ids before it."""
        if text is not None:
            starts = await self.server.tokenizer.char_starts(text)
        else:
            starts = _decoded_starts(self.server.tokenizer, ids)
        return starts[len(starts) - len(kept):]

    def _chunk(self, c: Choice, msg: Delta, label, body: CompletionRequest, echo: list[Echo] | None) -> list[dict]:
        """A completion stream's choice entries for one Delta (none when it says nothing). Under echo, a choice's
        first chunk carries its prompt in front of its first output (with logprobs, the prompt's tokens' first)."""
        shown = echo[c.prompt_index] if echo is not None and not c.started else None
        prefix = shown.text if shown is not None else ""
        c.text_chars += len(prefix)  # the output's offsets count from the prompt's end
        kept = c.kept_logprobs(msg, self.texts)
        text = prefix + msg.text
        said = text or msg.finish_reason is not None or kept or (body.return_token_ids and msg.token_ids)
        if shown is None and not said:
            return []
        entry = _text_choice(c.index, text, msg.finish_reason)
        if kept or (shown is not None and shown.starts is not None):
            entry["logprobs"] = _logprobs(c, shown, [item for item, _ in kept], [offset for _, offset in kept],
                                          label, _listed(body))
        if body.return_token_ids:
            entry["token_ids"] = msg.token_ids
            if not c.started:  # a choice's first chunk names its prompt's tokens
                entry["prompt_token_ids"] = c.prompt_ids
        c.started = True
        return [entry]

    def _choice(self, c: Choice, label, body: CompletionRequest, echo: list[Echo] | None) -> dict:
        """One choice of a whole completion."""
        shown = echo[c.prompt_index] if echo is not None else None
        prefix = shown.text if shown is not None else ""
        entry = _text_choice(c.index, prefix + "".join(c.text), c.finish_reason)
        if body.logprobs is not None:  # asked for: an object even when no token is listed
            entry["logprobs"] = _logprobs(c, shown, c.logprobs, [len(prefix) + o for o in c.offsets], label,
                                          _listed(body))
        # vLLM's fields, null when not asked for (clients read them as attributes)
        entry["prompt_logprobs"] = None if body.prompt_logprobs is None else \
            prompt_logprob_dicts(c.prompt_logprobs or [], body.prompt_logprobs, self.texts)
        entry["prompt_token_ids"], entry["token_ids"] = (c.prompt_ids, c.token_ids) if body.return_token_ids else (None, None)
        return entry


class PromptOnly:
    """The choices of `max_tokens: 0` with echo, as OpenAI's legacy completions (and vLLM) answer it: each ran the
    one token the engine must generate, which is dropped (its text, logprobs and count), so a choice is its prompt
    alone (and, with logprobs, the prompt's) and ends as "length"."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.texts = run.texts  # Run.collect reads it

    async def messages(self) -> AsyncIterator[Delta | Error]:
        """The run's messages, each Delta without its output."""
        async for msg in self.run.messages():
            if isinstance(msg, Delta):
                msg = msgspec.structs.replace(
                    msg, text="", token_ids=[], logprobs=None,
                    finish_reason=None if msg.finish_reason is None else "length",
                    completion_tokens=None if msg.completion_tokens is None else 0)
            yield msg

    async def collect(self, choices: list[Choice]) -> None:
        """Read every choice to its end, as a Run's collect does (it reads only messages() and texts)."""
        await Run.collect(self, choices)

    def close(self) -> None:
        """Abort what still runs."""
        self.run.close()


def _listed(body: CompletionRequest) -> int:
    """The alternatives each token lists besides itself: logprobs, or every logprob_token_ids id (vLLM's)."""
    return len(body.logprob_token_ids) if body.logprob_token_ids is not None else body.logprobs


def _logprobs(c: Choice, shown: Echo | None, items: list[TokenLogprob], offsets: list[int], label, top: int) -> dict:
    """Logprobs in the completions API's columnar shape: items (output tokens at offsets), after the echoed prompt's
    tokens when the choice shows them (shown with starts: their entries, the first null). label(id): how a token is
    named; top: the alternatives listed per token (besides itself, whose entry comes first: a client takes a
    position's token from its first key, as vLLM lists them)."""
    ids = [t.token_id for t in items]
    entries: list[TokenLogprob | None] = list(items)
    if shown is not None and shown.starts is not None:
        ids, entries, offsets = c.prompt_ids + ids, c.prompt_logprobs + entries, shown.starts + offsets
    tokens, token_logprobs, tops = [], [], []
    for token_id, t in zip(ids, entries):
        name = label(token_id)
        tokens.append(name)
        if t is None:  # the prompt's first token: nothing before it to predict it
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(t.logprob)
        alternatives = {name: t.logprob}  # the token itself first, then the top ones (vLLM's order)
        alternatives.update((label(i), lp) for i, lp in zip(t.top_ids[:top], t.top_logprobs[:top]))
        tops.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _decoded_starts(tokenizer, ids: list[int]) -> list[int]:
    """Where each of ids starts in their text (special tokens spelled out): the characters the ids before it make
    (a token holding some bytes of a character starts where that character does)."""
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    starts, chars = [], 0
    for token_id in ids:
        starts.append(chars)
        text, _ = detok.push([token_id])
        chars += len(text)
    return starts


def _prompt_logprobs(body: CompletionRequest) -> int | None:
    """The top-N each prompt token's entry lists: vLLM's prompt_logprobs, and with echo and logprobs the echoed
    prompt's top-N (the larger of the two; -1, the whole vocabulary, stays -1 to be refused); None for neither."""
    asked = [n for n in (body.prompt_logprobs, body.logprobs if body.echo else None) if n is not None]
    if not asked:
        return None
    return -1 if -1 in asked else max(asked)


def _text_choice(index: int, text: str, finish_reason: str | None = None) -> dict:
    """A completions choice entry."""
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


_NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."  # vLLM's words


def _prompts(prompt: str | list | None, vocab_size: int) -> list[Prompt]:
    """The prompts of a completions request: a string, a list of strings, token ids, or a list of those; 400 for none,
    or for a token id outside the vocabulary (in vLLM's words, which clients match)."""
    if prompt is None or (isinstance(prompt, list) and not prompt):
        raise ApiError(400, _NO_PROMPT, param="prompt", code="invalid_value")
    if isinstance(prompt, str):
        return [(prompt, None)]
    if all(_is_token(t) for t in prompt):
        out: list[Prompt] = [(None, list(prompt))]
    else:
        out = []
        for item in prompt:
            if isinstance(item, str):
                out.append((item, None))
            elif isinstance(item, list) and item and all(_is_token(t) for t in item):
                out.append((None, item))
            else:
                raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                               "lists of token ids", param="prompt", code="invalid_value")
    for _, ids in out:
        bad = [t for t in ids or () if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, f"Token id {bad[0]} is out of vocabulary (this model's ids are 0 to {vocab_size - 1})",
                           param="prompt", code="invalid_value")
    return out


def _is_token(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse_unsupported(body: CompletionRequest) -> None:
    """400 for completions options this server does not implement."""
    if body.prompt_embeds not in (None, [], ""):
        raise ApiError(400, "prompt_embeds is not supported: send prompt (text or token ids)", param="prompt_embeds",
                       code="unsupported_value")
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix", code="unsupported_value")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of other than n is not supported", param="best_of", code="unsupported_value")
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens must be at least 1 (0 only with echo: the prompt alone)", param="max_tokens",
                       code="invalid_value")
    if body.echo and body.logprobs is not None and body.use_beam_search:
        raise ApiError(400, "echo with logprobs (the prompt's logprobs) cannot be used with use_beam_search",
                       param="echo", code="unsupported_value")
    if body.logprobs is not None and body.logprobs < 0:
        raise ApiError(400, "`logprobs` must be a positive value.", param="logprobs", code="invalid_value")
    if body.logprob_token_ids is not None and body.echo and body.max_tokens == 0:
        raise ApiError(400, "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no "
                       "output tokens are generated.", param="logprob_token_ids", code="unsupported_value")
    check_stream_options(body)
    refuse_unserved(body)
