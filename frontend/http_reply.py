"""What an HTTP request's choices become: the OpenAI response envelope, streamed as SSE events or sent whole,
with usage counted over the choices.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

from metrale.ipc.messages import Delta, Error

from .http_errors import ApiError
from .http_params import StreamOptions
from .http_run import Choice, Run
from .tokenizer import Tokenizer

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"
_REPLACEMENT = "\ufffd"  # what a token holding part of a character's bytes decodes to

ChunkOf = Callable[[Choice, Delta], list[dict]]  # a stream's choice entries for one Delta


@dataclass(slots=True)
class Reply:
    """The envelope every object of one response shares: id, object, created, model, usage.

    A stream reports usage as vLLM's does: at its end with stream_options.include_usage, and on every chunk too with
    stream_options.continuous_usage_stats; the server's --enable-force-include-usage asks for both on every stream."""

    prefix: str
    object: str
    model: str
    stream_options: StreamOptions | None
    force_usage: bool = False  # --enable-force-include-usage
    per_request_metrics: bool = False  # --enable-per-request-metrics: vLLM's "metrics" beside a one-choice usage
    prompt_token_ids: list[int] | None = None  # return_token_ids: sent once, in the first chunk
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    @property
    def include_usage(self) -> bool:
        """Whether the stream ends with a usage chunk (and every chunk carries usage: null)."""
        return self.force_usage or (self.stream_options is not None and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk carries its choice's usage so far: asked for, or forced (vLLM forces both)."""
        return self.force_usage or (self.include_usage and self.stream_options.continuous_usage_stats)

    def chunk(self, choices: list[dict], of: Choice | None = None) -> dict:
        """One streamed object (with continuous usage: that of the choice `of`)."""
        out = {"id": self.id, "object": _chunk_object(self.object), "created": self.created, "model": self.model,
               "choices": choices}
        if self.include_usage:
            out["usage"] = usage([of]) if self.continuous_usage and of is not None else None
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"], self.prompt_token_ids = self.prompt_token_ids, None
        return out

    def usage_chunk(self, choices: list[Choice]) -> dict:
        """The last streamed object when include_usage: no choices, the usage."""
        out = {**self.chunk([]), "usage": usage(choices)}
        self._add_metrics(out, choices)
        return out

    def completion(self, choices: list[Choice], entries: list[dict]) -> dict:
        """A whole (non-streamed) response, with the fields OpenAI's client declares (null when this server has no
        value): a client's parse of it then has the keys of the raw JSON, which SageMaker's /invocations is compared
        on."""
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": entries,
               "usage": usage(choices), "system_fingerprint": None}
        if self.object == "chat.completion":
            out.update(service_tier=None, metadata=None, moderation=None)
        self._add_metrics(out, choices)
        return out

    def _add_metrics(self, out: dict, choices: list[Choice]) -> None:
        """vLLM's per-request metrics, where asked for and the answer is one choice (n > 1: no one stream's timing
        is the request's, so vLLM leaves them out too)."""
        if self.per_request_metrics and len(choices) == 1:
            out["metrics"] = request_metrics(choices[0])

    @staticmethod
    def event(obj: dict) -> bytes:
        """One SSE event."""
        return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def stream(request: web.Request, run: Run, choices: list[Choice], reply: Reply, chunk_of: ChunkOf
                 ) -> web.StreamResponse:
    """Send each output as an SSE event as it comes; then usage (when asked) and [DONE]."""
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    async for msg in run.messages():
        if isinstance(msg, Error):
            await response.write(reply.event(ApiError.from_engine(msg).body()))
            continue
        choice = choices[int(msg.id)]
        choice.fold(msg)
        parts = chunk_of(choice, msg)
        if parts:
            await response.write(reply.event(reply.chunk(parts, choice)))
    if reply.include_usage:
        await response.write(reply.event(reply.usage_chunk(choices)))
    await response.write(_DONE)
    await response.write_eof()
    return response


def usage(choices: list[Choice]) -> dict:
    """Token counts: each distinct prompt once, every choice's completion (so far, for a choice still running)."""
    prompt = sum({c.prompt_index: c.prompt_tokens or len(c.prompt_ids or ()) for c in choices}.values())
    completion = sum(c.completion_tokens or len(c.token_ids) for c in choices)
    # A prompt's cached tokens as its first choice's engine request found them (n > 1: the others hit its blocks).
    cached = sum({c.prompt_index: c.cached_tokens for c in sorted(choices, key=lambda c: -c.index)}.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def request_metrics(c: Choice) -> dict:
    """vLLM's per-request timing, in ms, of one finished choice; a field whose moments are unknown is left out.
    The engine core's first step for it is the scheduling moment: queue_time_ms ends there, time_to_first_token_ms
    and tokens_per_second (every output token over first step to last token) start there; generation_time_ms is
    first token to last; mean_itl_ms its mean gap (two tokens or more)."""
    out: dict = {}
    first, last, n = c.first_token_at, c.last_token_at, len(c.token_ids)
    scheduled = c.submitted_at + c.queued_s if c.queued_s is not None else None
    if c.queued_s is not None:
        out["queue_time_ms"] = c.queued_s * 1000
    if first is not None:
        if scheduled is not None:
            out["time_to_first_token_ms"] = max(first - scheduled, 0.0) * 1000
        out["generation_time_ms"] = (last - first) * 1000
        if n > 1:
            out["mean_itl_ms"] = (last - first) / (n - 1) * 1000
        if scheduled is not None and last > scheduled:
            out["tokens_per_second"] = n / (last - scheduled)
    return out


class TokenTexts:
    """Each token's own text (special tokens spelled out), decoded once: what logprobs name tokens by; and where
    tokens' text falls in an output."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def special(self, token_id: int) -> bool:
        """Whether the token is a special one (end-of-sequence among them): it has no text in an output."""
        return token_id in self._tokenizer.special_token_ids or token_id in self._tokenizer.eos_token_ids

    def visible_chars(self, ids: list[int]) -> int:
        """Characters of the output text these tokens make, a trailing incomplete character not counted."""
        return len(self._tokenizer.decode(ids).rstrip(_REPLACEMENT))

    def __call__(self, token_id: int) -> str:
        """The text of one token."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _chunk_object(obj: str) -> str:
    """The object name of a streamed piece (OpenAI names completion chunks like whole completions)."""
    return "chat.completion.chunk" if obj == "chat.completion" else obj
