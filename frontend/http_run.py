"""One HTTP request's engine requests: a Run submits each choice to the FrontendServer in-process and hands back
their messages; a Choice holds what one choice has produced so far.

Every choice is one FrontendServer.generate_local request: the same validation, tokenization, AddRequest,
detokenization (stop strings included) and abort path that a ZMQ Generate frame takes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from metrale.ipc.messages import Delta, Error, TokenLogprob
from metrale.ipc.sampling import SamplingParams

from .chat import ReasoningSplitter
from .http_errors import ApiError
from .http_resume import REQUEST_ID, resume_key

if TYPE_CHECKING:
    from .server import FrontendServer


@dataclass(slots=True)
class Choice:
    """One choice's output so far."""

    index: int
    prompt_index: int
    splitter: ReasoningSplitter | None = None  # chat of a reasoning model
    tools: object = None  # chat with tools: its ToolParser (frontend/tool_parsers.py)
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # each kept logprob's token's place in the text
    token_ids: list[int] = field(default_factory=list)  # every output token (return_token_ids)
    prompt_ids: list[int] | None = None  # the prompt's tokens, when the handler tokenized it
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with params.prompt_logprobs: one per prompt token
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those the prefix cache held
    started: bool = False  # a streamed chat choice sends its role first
    text_chars: int = 0  # characters of output text seen so far (and, under echo, of the prompt in front)
    pending_ids: list[int] = field(default_factory=list)  # tokens whose text is not out yet (a split character)
    # vLLM's per-request metrics (http_reply.request_metrics): when it was submitted, its first and last tokens came
    # (monotonic), and how long the engine core held it before its first step
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    queued_s: float | None = None

    def kept_logprobs(self, msg: Delta, texts) -> list[tuple[TokenLogprob, int]]:
        """msg's logprobs that belong to the output, each with its token's offset into the text.

        A token's offset counts the characters before it (a token that only carries part of a character's bytes
        starts where that character does). When a stop string ends the request, the tokens whose text it cut are
        dropped, so logprobs and text agree (`[' Paris']` for text ' Paris', not `[' Paris', '.']`); an
        end-of-sequence token, which has no text, is kept. texts: the TokenTexts of the server's tokenizer."""
        before = self.text_chars
        self.text_chars += len(msg.text)
        kept = []
        for j, item in enumerate(msg.logprobs or ()):
            prior = self.pending_ids + msg.token_ids[:j]
            offset = before + (texts.visible_chars(prior) if prior else 0)
            if msg.finish_reason == "stop" and offset >= self.text_chars and not texts.special(item.token_id):
                break
            kept.append((item, offset))
        self.pending_ids = [] if msg.text else self.pending_ids + msg.token_ids
        return kept

    def fold(self, msg: Delta) -> None:
        """Count one Delta into the choice (its text is kept only when the whole answer is built at the end)."""
        self.token_ids.extend(msg.token_ids)
        if msg.token_ids:
            self.last_token_at = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = self.last_token_at
        if msg.prompt_logprobs is not None:
            self.prompt_logprobs = msg.prompt_logprobs
        if msg.finish_reason is not None:
            self.finish_reason = msg.finish_reason
            self.prompt_tokens = msg.prompt_tokens or 0
            self.completion_tokens = msg.completion_tokens or 0
            self.cached_tokens = msg.cached_tokens or 0
            self.queued_s = msg.queued_s


class Run:
    """The engine requests behind one HTTP request, filed under one in-process client key."""

    def __init__(self, server: FrontendServer, texts) -> None:
        self.server = server
        self.texts = texts  # TokenTexts: where each token's text falls (logprobs follow the text)
        self.key = server.open_local()
        self.queue: asyncio.Queue[Delta | Error] = asyncio.Queue()
        self.live: set[str] = set()
        self._buffered: list[Delta | Error] = []
        self.request_id = REQUEST_ID.get()  # X-Request-Id or the body's request_id: a retry re-attaches (http_resume.py)

    def start(self, index: int, params: SamplingParams, *, prompt: str | None = None,
              token_ids: list[int] | None = None, add_special_tokens: bool = True, decoder=None,
              cache_salt: str | None = None, strict_length: bool = False, pooling=None, lora: str | None = None,
              beam=None) -> None:
        """Submit one choice (or one input's embedding, with pooling); its messages arrive on the queue with id
        str(index)."""
        self.live.add(str(index))
        self.server.generate_local(self.key, str(index), self.queue.put_nowait, params, prompt=prompt,
                                   token_ids=token_ids, add_special_tokens=add_special_tokens, decoder=decoder,
                                   cache_salt=cache_salt, strict_length=strict_length, pooling=pooling,
                                   lora=lora, beam=beam, **self._resumable(index))

    def _resumable(self, index: int) -> dict:
        """generate_local's arguments that hold a named request's choice for a retry (none for an unnamed one)."""
        if self.request_id is None:
            return {}
        return {"resume_key": resume_key(self.request_id, index), "resume_offset": 0}

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

    async def collect(self, choices: list[Choice]) -> None:
        """Read every choice to its end (non-streamed); ApiError when one fails."""
        async for msg in self.messages():
            if isinstance(msg, Error):
                raise ApiError.from_engine(msg)
            c = choices[int(msg.id)]
            if msg.logprobs:
                for item, offset in c.kept_logprobs(msg, self.texts):
                    c.logprobs.append(item)
                    c.offsets.append(offset)
            c.text.append(msg.text)
            c.fold(msg)

    def close(self) -> None:
        """Abort what still runs (the client went away, or the handler failed)."""
        if self.live:
            self.live.clear()
            self.server.abort_local(self.key)
