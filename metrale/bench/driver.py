"""One benchmark request: sent to an OpenAI-compatible endpoint as a stream, timed chunk by chunk.

The timings mean what vLLM's bench means by them: TTFT from the send to the first chunk that carries a choice,
one ITL per later such chunk (the gap since the one before), the latency from the send to the last such chunk.
A chat stream's opening chunk that names the role counts too, as in vLLM's bench: metrale's and vLLM's servers
send it with the first token. The output token count is the server's (`stream_options.include_usage`); a server
that reports none is counted by the tokenizer.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass, field

import aiohttp

from .datasets import SampleRequest

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass(slots=True)
class RequestResult:
    """What one request gave: success or the error, the text, token counts and the timings (seconds)."""

    prompt_len: int
    success: bool = False
    error: str = ""
    generated_text: str = ""
    output_tokens: int | None = None  # from the server's usage; None when it sent none
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # time.perf_counter() at the send
    queue_time: float = 0.0  # waiting for a --max-concurrency slot before the send


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how requests go: the endpoint's URL and kind, the model name, and body fields every request has."""

    url: str
    chat: bool
    model: str
    extra_body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)

    @classmethod
    def make(cls, base_url: str, endpoint: str, model: str, extra_body: dict | None = None,
             headers: dict | None = None) -> Target:
        """A Target for base_url + endpoint; ValueError for an endpoint that is neither completions nor chat."""
        if not endpoint.endswith(("/completions",)):
            raise ValueError(f"--endpoint {endpoint}: use {COMPLETIONS} or {CHAT}")
        return cls(base_url.rstrip("/") + endpoint, endpoint.endswith("chat/completions"), model,
                   dict(extra_body or {}), dict(headers or {}))

    def body(self, req: SampleRequest, ignore_eos: bool) -> dict:
        """The JSON body of one streamed request."""
        body = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
            body["max_completion_tokens"] = req.expected_output_len
        else:
            body["prompt"] = req.prompt
            body["max_tokens"] = req.expected_output_len
        if ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


async def send(session: aiohttp.ClientSession, target: Target, req: SampleRequest, ignore_eos: bool) -> RequestResult:
    """Send one request and time its stream; every failure (HTTP status, connection, no chunk) is in the result."""
    out = RequestResult(prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    out.start_time = start
    got_token = False
    try:
        async with session.post(target.url, json=target.body(req, ignore_eos), headers=target.headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status} {resp.reason or ''}: {(await resp.text())[:500]}".strip()
                return out
            text: list[str] = []
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, SSE comments (pings), other fields
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if isinstance(data, dict) and "error" in data and not data.get("choices"):
                    out.error = f"the stream ended with an error: {data['error']}"
                    return out
                choices = data.get("choices")
                if choices:
                    piece = _piece(choices[0], target.chat)
                    if got_token:
                        out.itl.append(now - last)
                    else:
                        out.ttft, got_token = now - start, True
                    last = now
                    text.append(piece)
                elif usage := data.get("usage"):
                    out.output_tokens = usage.get("completion_tokens")
                    if usage.get("prompt_tokens") is not None:
                        out.prompt_len = usage["prompt_tokens"]
            out.generated_text = "".join(text)
            out.latency = last - start
            out.success = got_token
            if not got_token:
                out.error = "the stream carried no token"
    except Exception:  # noqa: BLE001 - any failure of one request is that request's error, not the run's
        out.error = traceback.format_exc(limit=3)
    return out


def _piece(choice: dict, chat: bool) -> str:
    """The text a choice chunk carries ("" for a token with no text, or a chat chunk with only the role)."""
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("reasoning_content") or delta.get("reasoning") or "") + (delta.get("content") or "")
