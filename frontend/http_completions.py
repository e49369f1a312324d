"""POST /v1/completions: prompts (text or token ids) × n choices, streamed or whole, with echo and logprobs in
the completions API's columnar shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from metrale.ipc.messages import Delta, TokenLogprob

from .http_errors import ApiError, json_response
from .http_access_log import CHOICES
from .http_beam import beam_search
from .http_extensions import needs_prompt_ids, prompt_ids, refuse_unserved, token_label
from .http_params import (SamplingFields, ServedModel, check_count, check_stream_options, decode_body, sampling_params,
                          seeded)
from .http_reply import Reply, TokenTexts, stream
from .http_run import Choice, Run

if TYPE_CHECKING:
    from .server import FrontendServer

Prompt = tuple[str | None, list[int] | None]  # (text, None) or (None, token ids)


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions."""

    prompt: str | list
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class Completions:
    """The /v1/completions handler over one FrontendServer."""

    def __init__(self, server: FrontendServer, model: ServedModel, texts: TokenTexts) -> None:
        self.server = server
        self.model = model
        self.texts = texts

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        body = await decode_body(request, CompletionRequest)
        self.model.check(body.model)
        _refuse_unsupported(body)
        prompts = _prompts(body.prompt)
        echo = [self._echo(text, ids) for text, ids in prompts] if body.echo else None
        if needs_prompt_ids(body) or body.use_beam_search:  # tokenized here, as the engine path would, to be
            # truncated, returned or extended by beams
            prompts = [(None, await prompt_ids(self.server, body, text, ids, True)) for text, ids in prompts]
        check_count(len(prompts) * body.n)
        choices = request[CHOICES] = [Choice(index=p * body.n + j, prompt_index=p, prompt_ids=ids)  # the access
                                      for p, (_, ids) in enumerate(prompts) for j in range(body.n)]  # log counts them
        if body.use_beam_search:  # the whole search runs here; each choice comes as one final Delta
            run = await beam_search(self.server, self.texts, body, [ids for _, ids in prompts], body.max_tokens,
                                    body.logprobs, param="prompt")
        else:
            run = await self._start(body, prompts)
        try:
            reply = Reply("cmpl", "text_completion", self.model.id, body.stream_options, self.model.force_usage)
            label = token_label(self.texts, bool(body.return_tokens_as_token_ids))
            if body.stream:
                def chunk(c: Choice, msg: Delta) -> list[dict]:
                    return self._chunk(c, msg, label, bool(body.return_token_ids))
                return await stream(request, run, choices, reply, chunk, _echo_chunks(choices, echo, body.return_token_ids))
            await run.collect(choices)
            entries = [self._choice(c, echo, label, bool(body.return_token_ids), body.logprobs is not None)
                       for c in choices]
            return json_response(reply.completion(choices, entries))
        finally:
            run.close()

    async def _start(self, body: CompletionRequest, prompts: list[Prompt]) -> Run:
        """Submit each prompt's n choices and wait for each one's first output; closed here on an error."""
        # Given, max_tokens must fit beside the prompt (400 otherwise); null: the rest of the context.
        max_tokens = body.max_tokens if body.max_tokens is not None else self.server.max_model_len or 16
        params = sampling_params(body, max_tokens, body.logprobs, self.server.vocab_size, defaults=self.model.sampling_defaults)
        run = Run(self.server, self.texts)
        try:
            for p, (text, ids) in enumerate(prompts):
                for j in range(body.n):
                    run.start(p * body.n + j, seeded(params, j), prompt=text, token_ids=ids,
                              cache_salt=body.cache_salt, strict_length=body.max_tokens is not None)
            await run.wait_first("prompt")
        except BaseException:  # refused, or the client left: nothing of it may keep running
            run.close()
            raise
        return run

    def _echo(self, text: str | None, ids: list[int] | None) -> str:
        """A prompt's text, to put in front of its choices (echo)."""
        return text if text is not None else self.server.tokenizer.decode(ids, skip_special_tokens=False)

    def _chunk(self, c: Choice, msg: Delta, label, return_token_ids: bool) -> list[dict]:
        """A completion stream's choice entries for one Delta (none when it says nothing)."""
        kept = c.kept_logprobs(msg, self.texts)
        if not msg.text and msg.finish_reason is None and not kept and not (return_token_ids and msg.token_ids):
            return []
        entry = _text_choice(c.index, msg.text, msg.finish_reason)
        if kept:
            entry["logprobs"] = _logprobs([item for item, _ in kept], [offset for _, offset in kept], label)
        if return_token_ids:
            entry["token_ids"] = msg.token_ids
            if not c.started:  # a choice's first chunk names its prompt's tokens
                entry["prompt_token_ids"] = c.prompt_ids
        c.started = True
        return [entry]

    def _choice(self, c: Choice, echo: list[str] | None, label, return_token_ids: bool, logprobs: bool) -> dict:
        """One choice of a whole completion."""
        prefix = echo[c.prompt_index] if echo else ""
        entry = _text_choice(c.index, prefix + "".join(c.text), c.finish_reason)
        if logprobs:  # asked for: an object even when no token is listed
            entry["logprobs"] = _logprobs(c.logprobs, [len(prefix) + o for o in c.offsets], label)
        if return_token_ids:
            entry["prompt_token_ids"], entry["token_ids"] = c.prompt_ids, c.token_ids
        return entry


def _logprobs(items: list[TokenLogprob], offsets: list[int], label) -> dict:
    """Logprobs in the completions API's columnar shape. label(id): how a token is named."""
    tokens, token_logprobs, top = [], [], []
    for t in items:
        name = label(t.token_id)
        tokens.append(name)
        token_logprobs.append(t.logprob)
        alternatives = {label(i): lp for i, lp in zip(t.top_ids, t.top_logprobs)}
        alternatives.setdefault(name, t.logprob)
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _echo_chunks(choices: list[Choice], echo: list[str] | None, return_token_ids: bool | None) -> list[list[dict]]:
    """The stream's first chunks under echo: each choice's prompt (its text offsets then count from its end)."""
    if echo is None:
        return []
    chunks = []
    for c in choices:
        c.text_chars = len(echo[c.prompt_index])
        entry = _text_choice(c.index, echo[c.prompt_index])
        if return_token_ids:
            entry["prompt_token_ids"] = c.prompt_ids
        c.started = True
        chunks.append([entry])
    return chunks


def _text_choice(index: int, text: str, finish_reason: str | None = None) -> dict:
    """A completions choice entry."""
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _prompts(prompt: str | list) -> list[Prompt]:
    """The prompts of a completions request: a string, a list of strings, token ids, or a list of those."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if all(_is_token(t) for t in prompt):
        return [(None, list(prompt))]
    out: list[Prompt] = []
    for item in prompt:
        if isinstance(item, str):
            out.append((item, None))
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            out.append((None, item))
        else:
            raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                           "lists of token ids", param="prompt", code="invalid_value")
    return out


def _is_token(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse_unsupported(body: CompletionRequest) -> None:
    """400 for completions options this server does not implement."""
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix", code="unsupported_value")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of other than n is not supported", param="best_of", code="unsupported_value")
    if body.echo and body.logprobs is not None:
        raise ApiError(400, "echo with logprobs (prompt logprobs) is not supported", param="echo",
                       code="unsupported_value")
    if body.logprobs is not None and body.logprobs < 0:
        raise ApiError(400, "`logprobs` must be a positive value.", param="logprobs", code="invalid_value")
    check_stream_options(body)
    refuse_unserved(body)
