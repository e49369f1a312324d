"""One HTTP request's engine requests: a Run submits each choice to the FrontendServer in-process and hands back
their messages; a Choice holds what one choice has produced so far.

Every choice is one FrontendServer.generate_local request: the same validation, tokenization, AddRequest,
detokenization (stop strings included) and abort path that a ZMQ Generate frame takes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from metrale.ipc.messages import Delta, Error, TokenLogprob
from metrale.ipc.sampling import SamplingParams

from .chat import ReasoningSplitter
from .http_errors import ApiError

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
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started: bool = False  # a streamed chat choice sends its role first
    text_offset: int = 0  # characters streamed so far (completions logprobs' text_offset)
    text_chars: int = 0  # characters of output text seen so far
    logprob_chars: int = 0  # characters of the tokens whose logprobs were kept

    def kept_logprobs(self, msg: Delta, token_text) -> list[TokenLogprob]:
        """msg's logprobs that belong to the output text: when a stop string ends the request, the tokens
        whose text it cut are dropped, so logprobs and text agree (`[' Paris']` for text ' Paris', not
        `[' Paris', '.']`). token_text(id) is a token's own text."""
        self.text_chars += len(msg.text)
        kept = []
        for item in msg.logprobs or ():
            if msg.finish_reason == "stop" and self.logprob_chars >= self.text_chars:
                break
            kept.append(item)
            self.logprob_chars += len(token_text(item.token_id))
        return kept

    def fold(self, msg: Delta) -> None:
        """Count one Delta into the choice (its text is kept only when the whole answer is built at the end)."""
        if msg.finish_reason is not None:
            self.finish_reason = msg.finish_reason
            self.prompt_tokens = msg.prompt_tokens or 0
            self.completion_tokens = msg.completion_tokens or 0


class Run:
    """The engine requests behind one HTTP request, filed under one in-process client key."""

    def __init__(self, server: FrontendServer, token_text=None) -> None:
        self.server = server
        self.token_text = token_text or (lambda token_id: "")  # a token's own text (logprobs follow the text)
        self.key = server.open_local()
        self.queue: asyncio.Queue[Delta | Error] = asyncio.Queue()
        self.live: set[str] = set()
        self._buffered: list[Delta | Error] = []

    def start(self, index: int, params: SamplingParams, *, prompt: str | None = None,
              token_ids: list[int] | None = None, add_special_tokens: bool = True, decoder=None,
              cache_salt: str | None = None, strict_length: bool = False) -> None:
        """Submit one choice; its messages arrive on the queue with id str(index)."""
        self.live.add(str(index))
        self.server.generate_local(self.key, str(index), self.queue.put_nowait, params, prompt=prompt,
                                   token_ids=token_ids, add_special_tokens=add_special_tokens, decoder=decoder,
                                   cache_salt=cache_salt, strict_length=strict_length)

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
            c.text.append(msg.text)
            if msg.logprobs:
                c.logprobs.extend(c.kept_logprobs(msg, self.token_text))
            c.fold(msg)

    def close(self) -> None:
        """Abort what still runs (the client went away, or the handler failed)."""
        if self.live:
            self.live.clear()
            self.server.abort_local(self.key)
