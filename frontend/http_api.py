"""HttpApi: the OpenAI-compatible HTTP API, served by aiohttp on the frontend's own event loop.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE streaming or one JSON answer), GET /v1/models,
GET /health, GET /metrics. docs/http.md is the reference.

Every choice of a request is one FrontendServer.generate_local request: the same validation, tokenization,
AddRequest, detokenization (stop strings included) and abort path that a ZMQ Generate frame takes. An HTTP request
answers with an error status only before its first byte of body: the handler waits for each choice's first
output (or Error) before it starts the response, so "busy" (503), "too_long" (400) and bad parameters become
HTTP errors; an error after that ends the stream with an `error` event. A client that closes its connection
cancels the handler (aiohttp's handler_cancellation), whose `finally` aborts what still runs in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from metrale.ipc.messages import Delta, Error, TokenLogprob
from metrale.ipc.sampling import SamplingParams

from .chat import ChatTemplate, ChatTemplateError, ReasoningSplitter, ReasoningTags, tag_keeping_decoder
from .metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from .server import FrontendServer

log = logging.getLogger(__name__)

MAX_CHOICES = 128  # prompts × n of one request
_STATS_ON_SCRAPE_S = 1.0  # how long /metrics waits for the engine core's counters before using the last ones
_SHUTDOWN_S = 1.0  # open streams get this long to end when the server stops
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"

# The server's error codes (docs/protocol.md §4.1) as (HTTP status, OpenAI error type, OpenAI error code).
_ENGINE_ERRORS = {
    "bad_request": (400, "invalid_request_error", "invalid_value"),
    "too_long": (400, "invalid_request_error", "context_length_exceeded"),
    "busy": (503, "server_error", "server_busy"),
    "worker_fault": (500, "server_error", "worker_fault"),
    "internal": (500, "server_error", "internal_error"),
}


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    @classmethod
    def from_engine(cls, error: Error, param: str | None = None) -> ApiError:
        """The HTTP error for the server's Error{code, message}."""
        status, kind, code = _ENGINE_ERRORS.get(error.code, (500, "server_error", "internal_error"))
        return cls(status, error.message, type=kind, code=code, param=param if status == 400 else None)

    def body(self) -> dict:
        """The JSON object sent to the client."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        """This error as an HTTP response."""
        return web.Response(status=self.status, body=msgspec.json.encode(self.body()), content_type="application/json")


# ---- request bodies ----------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields both endpoints share: OpenAI's sampling parameters and metrale's extras (vLLM's names)."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # metrale extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    max_thinking_tokens: int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    adaptive_sampling: bool | None = None
    priority: int | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/completions."""

    prompt: str | list
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatRequest(_SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None
    # metrale (and vLLM) extras
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict] | None = None


# Simple sampling fields copied as they are when given.
_PASSTHROUGH = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "top_k", "min_p",
                "min_tokens", "max_thinking_tokens", "ignore_eos", "repetition_penalty", "skip_special_tokens",
                "adaptive_sampling", "priority")


# ---- one HTTP request's engine requests ----------------------------------------------------


@dataclass(slots=True)
class Choice:
    """One choice's output so far."""

    index: int
    prompt_index: int
    splitter: ReasoningSplitter | None = None  # chat of a reasoning model
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started: bool = False  # a streamed chat choice sends its role first
    text_offset: int = 0  # characters streamed so far (completions logprobs' text_offset)


class Run:
    """The engine requests behind one HTTP request, filed under one in-process client key."""

    def __init__(self, server: FrontendServer) -> None:
        self.server = server
        self.key = server.open_local()
        self.queue: asyncio.Queue[Delta | Error] = asyncio.Queue()
        self.live: set[str] = set()
        self._buffered: list[Delta | Error] = []

    def start(self, index: int, params: SamplingParams, *, prompt: str | None = None,
              token_ids: list[int] | None = None, add_special_tokens: bool = True, decoder=None) -> None:
        """Submit one choice; its messages arrive on the queue with id str(index)."""
        self.live.add(str(index))
        self.server.generate_local(self.key, str(index), self.queue.put_nowait, params, prompt=prompt,
                                   token_ids=token_ids, add_special_tokens=add_special_tokens, decoder=decoder)

    async def wait_first(self, param: str | None) -> None:
        """Wait for every choice's first message; ApiError (and the others aborted) when one is an Error."""
        pending = set(self.live)
        while pending:
            msg = await self.queue.get()
            self._buffered.append(msg)
            pending.discard(msg.id)
            if isinstance(msg, Error) or msg.finish_reason is not None:
                self.live.discard(msg.id)
            if isinstance(msg, Error):
                raise ApiError.from_engine(msg, param)

    async def messages(self) -> AsyncIterator[Delta | Error]:
        """Every message (those wait_first read, then the rest) until each choice has ended."""
        for msg in self._buffered:
            yield msg
        self._buffered.clear()
        while self.live:
            msg = await self.queue.get()
            if isinstance(msg, Error) or msg.finish_reason is not None:
                self.live.discard(msg.id)
            yield msg

    def close(self) -> None:
        """Abort what still runs (the client went away, or the handler failed)."""
        if self.live:
            self.live.clear()
            self.server.abort_local(self.key)


# ---- the application -------------------------------------------------------------------------


class HttpApi:
    """The OpenAI-compatible routes over one FrontendServer."""

    def __init__(self, server: FrontendServer) -> None:
        self.server = server
        self.tokenizer = server.tokenizer
        cfg = server.config
        self.model_dir = cfg.model_dir
        self.model_id = cfg.served_model_name or Path(cfg.model_dir).name
        self.created = int(time.time())
        try:
            self.chat = ChatTemplate.load(cfg.model_dir, self.tokenizer)
            self.chat_error = None
        except ChatTemplateError as exc:  # a broken template fails chat requests, not the server
            self.chat, self.chat_error = None, str(exc)
        self.reasoning = ReasoningTags.of(self.tokenizer, self.tokenizer.chat_template)
        self.chat_decoder = tag_keeping_decoder(self.tokenizer, self.reasoning)
        self._token_text: dict[int, str] = {}
        self.app = web.Application(middlewares=[_errors_as_json], client_max_size=cfg.max_frame_bytes)
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ])
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> str:
        """Listen on host:port (0: any free port); return the base URL."""
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=_SHUTDOWN_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        url = f"http://{host}:{bound[1]}"
        log.info("frontend: OpenAI-compatible HTTP API on %s", url)
        return url

    async def stop(self) -> None:
        """Stop listening and end open requests."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- routes ---------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        body = await _decode(request, CompletionRequest)
        self._check_model(body.model)
        _refuse_unsupported_completion(body)
        prompts = _completion_prompts(body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else self.server.max_model_len or 16
        params = self._sampling(body, max_tokens, body.logprobs)
        _check_count(len(prompts) * body.n)
        run = Run(self.server)
        try:
            choices = []
            for p, (text, ids) in enumerate(prompts):
                for j in range(body.n):
                    choices.append(Choice(index=len(choices), prompt_index=p))
                    run.start(len(choices) - 1, _seeded(params, j), prompt=text, token_ids=ids)
            await run.wait_first("prompt")
            echo = [self._echo(text, ids) for text, ids in prompts] if body.echo else None
            reply = _Reply("cmpl", "text_completion", self.model_id, body.stream_options)
            if body.stream:
                return await self._stream(request, run, choices, reply, self._completion_chunk, echo)
            await _collect(run, choices)
            return _json(reply.completion(choices, [self._completion_choice(c, echo) for c in choices]))
        finally:
            run.close()

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        body = await _decode(request, ChatRequest)
        self._check_model(body.model)
        _refuse_unsupported_chat(body)
        prompt = self._render(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = self.server.max_model_len or 16  # the engine core stops at max_model_len
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        params = self._sampling(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        _check_count(body.n)
        decoder = self.chat_decoder if params.skip_special_tokens else None
        opens_reasoning = self.reasoning is not None and self.reasoning.open_at_end_of(prompt)
        run = Run(self.server)
        try:
            choices = []
            for j in range(body.n):
                splitter = ReasoningSplitter(self.reasoning, opens_reasoning) if self.reasoning else None
                choices.append(Choice(index=j, prompt_index=0, splitter=splitter))
                run.start(j, _seeded(params, j), prompt=prompt, add_special_tokens=False, decoder=decoder)
            await run.wait_first("messages")
            reply = _Reply("chatcmpl", "chat.completion", self.model_id, body.stream_options)
            if body.stream:
                return await self._stream(request, run, choices, reply, self._chat_chunk, None)
            await _collect(run, choices)
            return _json(reply.completion(choices, [self._chat_choice(c) for c in choices]))
        finally:
            run.close()

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the one model this server serves."""
        model = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "metrale",
                 "root": str(self.model_dir), "parent": None, "max_model_len": self.server.max_model_len}
        return _json({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 when every process is up, else 503; the body says which."""
        health = self.server.health()
        body = msgspec.to_builtins(health)
        body.pop("id", None)
        body.pop("type", None)
        return _json(body, status=200 if health.healthy else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: Prometheus text; engine gauges asked for now (the last ones if it does not answer)."""
        collector = self.server.metrics.engine
        try:
            collector.update(stats=await self.server.engine_stats(_STATS_ON_SCRAPE_S))
        except Exception as exc:  # not up, or slow: serve the last snapshot
            log.debug("frontend: /metrics without fresh engine stats: %s", exc)
        collector.update(health=self.server.health())
        return web.Response(body=self.server.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # ---- request → engine -------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        """404 unless model names this server's model (or is left out)."""
        if model is not None and model not in (self.model_id, str(self.model_dir)):
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")

    def _sampling(self, body: _SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams; 400 naming the field when one is out of range."""
        kw = {name: getattr(body, name) for name in _PASSTHROUGH if getattr(body, name) is not None}
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, stop=stop,
                                stop_token_ids=list(body.stop_token_ids or []), **kw)
        try:
            params.validate(self.server.vocab_size)
        except ValueError as exc:
            message = str(exc)
            raise ApiError(400, message, param=message.split(" ", 1)[0], code="invalid_value") from None
        return params

    def _render(self, body: ChatRequest) -> str:
        """The chat prompt; 400 when the model has no template or the messages do not render."""
        if self.chat is None:
            why = self.chat_error or ("the model has no chat template (no chat_template in tokenizer_config.json "
                                      "and no chat_template.jinja); use /v1/completions")
            raise ApiError(400, why, param="messages", code="chat_template_missing")
        try:
            return self.chat.render(body.messages, add_generation_prompt=body.add_generation_prompt,
                                    continue_final_message=body.continue_final_message, tools=body.tools,
                                    documents=body.documents, extra=body.chat_template_kwargs)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages", code="invalid_value") from None

    def _echo(self, text: str | None, ids: list[int] | None) -> str:
        """A prompt's text, to put in front of its choices (echo)."""
        return text if text is not None else self.tokenizer.decode(ids, skip_special_tokens=False)

    # ---- engine → response ----------------------------------------------------------------------

    async def _stream(self, request: web.Request, run: Run, choices: list[Choice], reply: _Reply,
                      chunk_of, echo: list[str] | None) -> web.StreamResponse:
        """Send each output as an SSE event as it comes; then usage (when asked) and [DONE]."""
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        if echo is not None:
            for c in choices:
                c.text_offset = len(echo[c.prompt_index])
                await response.write(reply.event(reply.chunk([_text_choice(c.index, echo[c.prompt_index])])))
        async for msg in run.messages():
            if isinstance(msg, Error):
                await response.write(b"data: " + msgspec.json.encode(ApiError.from_engine(msg).body()) + b"\n\n")
                continue
            choice = choices[int(msg.id)]
            _fold(choice, msg)
            parts = chunk_of(choice, msg)
            if parts:
                await response.write(reply.event(reply.chunk(parts)))
        if reply.include_usage:
            await response.write(reply.event(reply.usage_chunk(choices)))
        await response.write(_DONE)
        await response.write_eof()
        return response

    def _completion_chunk(self, c: Choice, msg: Delta) -> list[dict]:
        """A completion stream's choice entries for one Delta (none when it says nothing)."""
        if not msg.text and msg.finish_reason is None and not msg.logprobs:
            return []
        entry = _text_choice(c.index, msg.text, msg.finish_reason)
        if msg.logprobs:
            entry["logprobs"] = self._completion_logprobs(msg.logprobs, c.text_offset)
        c.text_offset += len(msg.text)
        return [entry]

    def _chat_chunk(self, c: Choice, msg: Delta) -> list[dict]:
        """A chat stream's choice entry for one Delta (the first one carries the role; none when it says nothing)."""
        reasoning, content = c.splitter.push(msg.text) if c.splitter else ("", msg.text)
        if msg.finish_reason is not None and c.splitter:
            r, t = c.splitter.flush()
            reasoning, content = reasoning + r, content + t
        delta: dict = {}
        if not c.started:
            c.started = True
            delta = {"role": "assistant", "content": ""}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if not delta and msg.finish_reason is None and not msg.logprobs:
            return []
        entry = _chat_delta(c.index, delta, msg.finish_reason)
        if msg.logprobs:
            entry["logprobs"] = {"content": self._chat_logprobs(msg.logprobs)}
        return [entry]

    def _completion_choice(self, c: Choice, echo: list[str] | None) -> dict:
        """One choice of a whole completion."""
        prefix = echo[c.prompt_index] if echo else ""
        entry = _text_choice(c.index, prefix + "".join(c.text), c.finish_reason)
        if c.logprobs:
            entry["logprobs"] = self._completion_logprobs(c.logprobs, len(prefix))
        return entry

    def _chat_choice(self, c: Choice) -> dict:
        """One choice of a whole chat completion."""
        text = "".join(c.text)
        message: dict = {"role": "assistant"}
        if c.splitter is not None:
            reasoning, content = c.splitter.push(text)
            r, t = c.splitter.flush()
            message["reasoning_content"] = (reasoning + r) or None
            message["content"] = content + t
        else:
            message["content"] = text
        message["tool_calls"] = []
        entry = {"index": c.index, "message": message, "logprobs": None, "finish_reason": c.finish_reason}
        if c.logprobs:
            entry["logprobs"] = {"content": self._chat_logprobs(c.logprobs)}
        return entry

    def _text(self, token_id: int) -> str:
        """A token's own text (special tokens spelled out), cached."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _completion_logprobs(self, items: list[TokenLogprob], offset: int) -> dict:
        """Logprobs in the completions API's columnar shape."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for t in items:
            text = self._text(t.token_id)
            tokens.append(text)
            token_logprobs.append(t.logprob)
            alternatives = {self._text(i): lp for i, lp in zip(t.top_ids, t.top_logprobs)}
            alternatives.setdefault(text, t.logprob)
            top.append(alternatives)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, items: list[TokenLogprob]) -> list[dict]:
        """Logprobs in the chat API's per-token shape."""
        out = []
        for t in items:
            top = [self._logprob_entry(i, lp) for i, lp in zip(t.top_ids, t.top_logprobs)]
            out.append({**self._logprob_entry(t.token_id, t.logprob), "top_logprobs": top})
        return out

    def _logprob_entry(self, token_id: int, logprob: float) -> dict:
        """{token, logprob, bytes} of one token."""
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


@dataclass(slots=True)
class _Reply:
    """The envelope every object of one response shares: id, object, created, model, usage."""

    prefix: str
    object: str
    model: str
    stream_options: StreamOptions | None
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def chunk(self, choices: list[dict]) -> dict:
        """One streamed object."""
        out = {"id": self.id, "object": _chunk_object(self.object), "created": self.created, "model": self.model,
               "choices": choices}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, choices: list[Choice]) -> dict:
        """The last streamed object when include_usage: no choices, the usage."""
        return {**self.chunk([]), "usage": _usage(choices)}

    def completion(self, choices: list[Choice], entries: list[dict]) -> dict:
        """A whole (non-streamed) response."""
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": entries, "usage": _usage(choices)}

    @staticmethod
    def event(obj: dict) -> bytes:
        """One SSE event."""
        return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _chunk_object(obj: str) -> str:
    """The object name of a streamed piece (OpenAI names completion chunks like whole completions)."""
    return "chat.completion.chunk" if obj == "chat.completion" else obj


def _text_choice(index: int, text: str, finish_reason: str | None = None) -> dict:
    """A completions choice entry."""
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _chat_delta(index: int, delta: dict, finish_reason: str | None = None) -> dict:
    """A chat stream choice entry."""
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def _fold(c: Choice, msg: Delta) -> None:
    """Count one Delta into its choice (its text is kept only when the whole answer is built at the end)."""
    if msg.finish_reason is not None:
        c.finish_reason = msg.finish_reason
        c.prompt_tokens = msg.prompt_tokens or 0
        c.completion_tokens = msg.completion_tokens or 0


async def _collect(run: Run, choices: list[Choice]) -> None:
    """Read every choice to its end (non-streamed); ApiError when one fails."""
    async for msg in run.messages():
        if isinstance(msg, Error):
            raise ApiError.from_engine(msg)
        c = choices[int(msg.id)]
        c.text.append(msg.text)
        if msg.logprobs:
            c.logprobs.extend(msg.logprobs)
        _fold(c, msg)


def _usage(choices: list[Choice]) -> dict:
    """Token counts: each distinct prompt once, every choice's completion."""
    prompt = sum({c.prompt_index: c.prompt_tokens for c in choices}.values())
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _seeded(params: SamplingParams, j: int) -> SamplingParams:
    """The params of a request's j-th choice: with a seed, seed + j (so n choices differ yet repeat)."""
    if j == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + j) % 2**63)


def _completion_prompts(prompt: str | list) -> list[tuple[str | None, list[int] | None]]:
    """The prompts of a completions request: a string, a list of strings, token ids, or a list of those."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if all(_is_token(t) for t in prompt):
        return [(None, list(prompt))]
    out: list[tuple[str | None, list[int] | None]] = []
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
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(count: int) -> None:
    """400 unless 1 <= n (times the prompts) <= MAX_CHOICES."""
    if not 1 <= count <= MAX_CHOICES:
        raise ApiError(400, f"n (times the number of prompts) must be in [1, {MAX_CHOICES}] (got {count})",
                       param="n", code="invalid_value")


def _refuse_unsupported_completion(body: CompletionRequest) -> None:
    """400 for completions options this server does not implement."""
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix", code="unsupported_value")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of other than n is not supported", param="best_of", code="unsupported_value")
    if body.echo and body.logprobs is not None:
        raise ApiError(400, "echo with logprobs (prompt logprobs) is not supported", param="echo",
                       code="unsupported_value")
    _refuse_logit_bias(body)


def _refuse_unsupported_chat(body: ChatRequest) -> None:
    """400 for chat options this server does not implement."""
    kind = (body.response_format or {}).get("type", "text")
    if kind != "text":
        raise ApiError(400, f"response_format {kind!r} is not supported (only 'text')", param="response_format",
                       code="unsupported_value")
    if body.tool_choice not in (None, "none", "auto"):
        raise ApiError(400, "tool_choice other than 'none' or 'auto' is not supported (tool calls are not parsed)",
                       param="tool_choice", code="unsupported_value")
    _refuse_logit_bias(body)


def _refuse_logit_bias(body: _SamplingFields) -> None:
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_value")


async def _decode(request: web.Request, kind: type[msgspec.Struct]):
    """The JSON body as `kind`; 400 naming the field when it does not fit."""
    data = await request.read()
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = message.rsplit("at `$.", 1)[1].rstrip("`").split("[")[0].split(".")[0] if "at `$." in message else None
        raise ApiError(400, message, param=param, code="invalid_value") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None


def _json(obj: object, status: int = 200) -> web.Response:
    """A JSON response."""
    return web.Response(status=status, body=msgspec.json.encode(obj), content_type="application/json")


@web.middleware
async def _errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    """Every error in OpenAI's shape: ApiError, aiohttp's own (404, 405, 413), and bugs (500)."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        return ApiError(exc.status, exc.text or exc.reason, code=code).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("frontend: HTTP handler failed for %s %s", request.method, request.path)
        return ApiError(500, "internal error", type="server_error", code="internal_error").response()
