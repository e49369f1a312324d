"""The soak's traffic: a seeded open-loop mix of OpenAI HTTP requests, each run by its own client and judged.

`draw_requests(seed, duration_s, rate)` gives the schedule: arrival times (Poisson) and what each request is —
chat or completions, streamed or not, greedy / seeded / unseeded sampling, a JSON schema, tools, a shared
prefix, n > 1, stop strings — and how its client behaves: reads to the end, aborts after a few chunks, sends
and disconnects without reading, or has its connection reset mid-stream. `run_request` sends one and returns
its `Outcome`: the text of each choice and its finish reason, a typed error (HTTP status and the error's
code), or `lost` (no final answer by the deadline, or a connection the server dropped without one).

Not a benchmark of its own: scripts/soak.py drives it.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import time
from dataclasses import dataclass, field

import aiohttp

WORDS = ("river stone light market engine winter orange signal garden paper silver window music number "
         "harbor forest copper morning letter bridge cloud table story ocean field").split()
SHARED_PREFIX = "You are a careful assistant. Answer briefly and exactly. " * 6
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer"}}, "required": ["name", "count"]}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                           "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                                                          "required": ["word"]}}}]
BEHAVIOURS = (("read", 0.8), ("abort", 0.1), ("disconnect", 0.05), ("reset", 0.05))


@dataclass
class Spec:
    """One request of the schedule."""

    idx: int
    at: float  # seconds after the start
    route: str  # "completions" | "chat"
    stream: bool
    sampling: str  # "greedy" | "seeded" | "free"
    body: dict
    behaviour: str = "read"  # "read" | "abort" (after abort_after chunks) | "disconnect" | "reset"
    abort_after: int = 3

    @property
    def comparable(self) -> bool:
        """Whether its answer is fixed by the request (so a replay must give the same)."""
        return self.sampling != "free" and self.behaviour == "read"


@dataclass
class Outcome:
    """What one request's client saw."""

    idx: int
    sent_at: float = 0.0  # monotonic
    first_at: float | None = None  # first token's arrival
    done_at: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrivals of streamed chunks with text
    texts: dict[int, str] = field(default_factory=dict)  # choice index -> text (or tool calls as JSON)
    finish: dict[int, str | None] = field(default_factory=dict)
    status: str = "pending"  # "ok" | "error" (typed) | "aborted" (by its client, as planned) | "lost"
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.sent_at


def draw_requests(seed: int, duration_s: float, rate: float, model: str, max_tokens: int) -> list[Spec]:
    """The seeded schedule: Poisson arrivals at `rate` per second over duration_s, each request drawn from the mix."""
    rng = random.Random(seed)
    specs, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return specs
        specs.append(_draw_one(rng, len(specs), t, model, max_tokens))


def _draw_one(rng: random.Random, idx: int, at: float, model: str, max_tokens: int) -> Spec:
    route = rng.choice(("completions", "chat"))
    sampling = rng.choices(("greedy", "seeded", "free"), (0.45, 0.4, 0.15))[0]
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
    text = (SHARED_PREFIX + words) if rng.random() < 0.3 else words
    body: dict = {"model": model, "max_tokens": rng.randint(max_tokens // 4, max_tokens)}
    if sampling == "greedy":
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.8, top_p=0.95)
        if sampling == "seeded":
            body["seed"] = rng.randint(0, 2**31 - 1)
    if rng.random() < 0.1:
        body["stop"] = [rng.choice(WORDS)[:3]]
    extra = rng.random()
    if route == "chat":
        body["messages"] = [{"role": "user", "content": text}]
        if extra < 0.1:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
            body.pop("stop", None)
        elif extra < 0.2:
            body.update(tools=TOOLS, tool_choice="required")
            body.pop("stop", None)
    else:
        body["prompt"] = text
        if extra < 0.1 and sampling != "greedy":  # n > 1 of one seed: the choices differ and are each fixed
            body["n"] = 2
    stream = rng.random() < 0.7
    behaviour = rng.choices([b for b, _ in BEHAVIOURS], [w for _, w in BEHAVIOURS])[0]
    if not stream and behaviour in ("abort", "reset"):
        behaviour = "disconnect"
    return Spec(idx, at, route, stream, sampling, body, behaviour, abort_after=rng.randint(1, 6))


async def run_request(session: aiohttp.ClientSession, base: str, spec: Spec, deadline_s: float,
                      live: dict[int, tuple] | None = None) -> Outcome:
    """Send spec and read its answer as its client would; never raises. While a stream is read to its end it
    is in live (index -> (response, outcome)), where reset_live can cut it."""
    out = Outcome(spec.idx, sent_at=time.monotonic())
    url = f"{base}/v1/{'chat/completions' if spec.route == 'chat' else 'completions'}"
    body = dict(spec.body, stream=spec.stream)
    try:
        if spec.behaviour == "disconnect":
            await _send_and_leave(base, url, body)
            out.status = "aborted"
        else:
            await asyncio.wait_for(_exchange(session, url, body, spec, out, live), deadline_s)
    except TimeoutError:
        out.status, out.error = "lost", f"no final answer within {deadline_s:.0f} s"
    except (aiohttp.ClientError, ConnectionError) as e:
        if out.status == "pending":
            out.status, out.error = "lost", f"connection lost without an answer: {e!r}"
    out.done_at = time.monotonic()
    return out


async def _exchange(session: aiohttp.ClientSession, url: str, body: dict, spec: Spec, out: Outcome,
                    live: dict[int, tuple] | None) -> None:
    async with session.post(url, json=body) as resp:
        if live is not None and spec.stream and spec.behaviour == "read":
            live[spec.idx] = (resp, out)
        try:
            await _read(resp, spec, out)
        finally:
            if live is not None:
                live.pop(spec.idx, None)


async def _read(resp: aiohttp.ClientResponse, spec: Spec, out: Outcome) -> None:
    """The answer, whole or streamed, into out (a stream until [DONE], its error event, or its planned abort)."""
    if resp.status != 200:
        _typed_error(out, resp.status, await resp.text())
        return
    if not spec.stream:
        _whole(out, spec, await resp.json())
        return
    chunks = 0
    async for line in resp.content:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            out.status = "ok" if out.status == "pending" else out.status
            return
        event = json.loads(data)
        if "error" in event:
            _typed_error(out, 200, json.dumps(event))
            return
        if _chunk(out, spec, event):
            chunks += 1
            if spec.behaviour in ("abort", "reset") and chunks >= spec.abort_after:
                if spec.behaviour == "reset":
                    _reset(resp)
                out.status = "aborted"
                return
    if out.status == "pending":
        out.status, out.error = "lost", "the stream ended without [DONE]"


def _chunk(out: Outcome, spec: Spec, event: dict) -> bool:
    """Fold one streamed chunk in; whether it carried text."""
    now, carried = time.monotonic(), False
    for choice in event.get("choices", []):
        i = choice.get("index", 0)
        piece = choice.get("text")
        if piece is None:
            delta = choice.get("delta") or {}
            piece = (delta.get("content") or "") + "".join(  # a call's id is random: not part of the answer
                json.dumps({k: v for k, v in c.items() if k != "id"}, sort_keys=True) for c in delta.get("tool_calls") or [])
        if piece:
            carried = True
            out.texts[i] = out.texts.get(i, "") + piece
        if choice.get("finish_reason") is not None:
            out.finish[i] = choice["finish_reason"]
    if carried:
        out.chunk_times.append(now)
        if out.first_at is None:
            out.first_at = now
    return carried


def _whole(out: Outcome, spec: Spec, reply: dict) -> None:
    out.first_at = time.monotonic()
    for choice in reply.get("choices", []):
        i = choice.get("index", 0)
        if spec.route == "chat":
            msg = choice.get("message") or {}
            out.texts[i] = (msg.get("content") or "") + "".join(
                json.dumps({"function": c.get("function")}, sort_keys=True) for c in msg.get("tool_calls") or [])
        else:
            out.texts[i] = choice.get("text", "")
        out.finish[i] = choice.get("finish_reason")
    out.status = "ok"


def _typed_error(out: Outcome, status: int, text: str) -> None:
    """A refusal or failure the server explained (an error object with a type or code) is typed; else lost."""
    try:
        err = json.loads(text)["error"]
        out.status, out.error = "error", f"{status} {err.get('code') or err.get('type')}: {err.get('message', '')[:200]}"
    except (ValueError, KeyError, TypeError):
        out.status, out.error = "lost", f"HTTP {status} without an error object: {text[:200]!r}"


def reset_live(live: dict[int, tuple], rng: random.Random, k: int) -> int:
    """Reset up to k of the live streams (their outcome: aborted by the client); how many."""
    chosen = rng.sample(sorted(live), min(k, len(live)))
    for idx in chosen:
        resp, out = live.pop(idx)
        out.status, out.error = "aborted", "reset by a client_reset fault"
        _reset(resp)
    return len(chosen)


def _reset(resp: aiohttp.ClientResponse) -> None:
    """Cut the connection with a TCP reset (SO_LINGER 0), as a crashed client or a proxy does."""
    conn = resp.connection
    sock = conn.transport.get_extra_info("socket") if conn is not None and conn.transport is not None else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    resp.close()


async def _send_and_leave(base: str, url: str, body: dict) -> None:
    """Send the request on a raw connection and close it without reading a byte of the answer."""
    host, port = base.removeprefix("http://").split(":")
    path = url.removeprefix(base)
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    writer.close()
    await writer.wait_closed()
