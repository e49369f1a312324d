"""A recorded fake OpenAI-compatible server for benchmark tests: canned SSE streams of known token counts.

Each completion (or chat) request gets `max_tokens` tokens, two per chunk (so chunks and tokens differ, and only
the usage chunk tells the count), then a usage chunk and [DONE]; a chat stream opens with a role-only chunk.
The server reports `prompt_tokens` from the prompt's length in characters (a count the benchmark cannot know
from its tokenizer), and fails the requests whose arrival index is in `fail` with HTTP 500. Every request is
recorded, so a test compares the benchmark's totals with what the server served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from dataclasses import dataclass, field

from aiohttp import web

MODEL = "fake-model"


@dataclass
class Served:
    """One request the fake answered."""

    index: int
    chat: bool
    failed: bool
    prompt_tokens: int
    completion_tokens: int
    body: dict


@dataclass
class FakeServer:
    port: int = 0
    fail: frozenset[int] = frozenset()
    served: list[Served] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def prompt_tokens_of(text: str) -> int:
    """The fake's prompt token count: one per 3 characters, at least 1."""
    return max(1, len(text) // 3)


def _app(server: FakeServer) -> web.Application:
    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        index = len(server.served)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        n = body.get("max_completion_tokens" if chat else "max_tokens") or 16
        failed = index in server.fail
        server.served.append(Served(index, chat, failed, prompt_tokens_of(prompt), 0 if failed else n, body))
        if failed:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def event(data: object) -> None:
            await resp.write(f"data: {json.dumps(data)}\n\n".encode())

        def choice(text: str | None, role: bool = False, finish: str | None = None) -> dict:
            if chat:
                delta = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                return {"index": 0, "delta": delta, "finish_reason": finish}
            return {"index": 0, "text": text or "", "finish_reason": finish}

        if chat:
            await event({"object": obj, "choices": [choice("", role=True)]})
        sent = 0
        while sent < n:
            k = min(2, n - sent)
            sent += k
            await event({"object": obj, "choices": [choice("tok " * k, finish="length" if sent == n else None)]})
        await event({"object": obj, "choices": [], "usage": {
            "prompt_tokens": prompt_tokens_of(prompt), "completion_tokens": n,
            "total_tokens": prompt_tokens_of(prompt) + n}})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    return app


@contextlib.contextmanager
def fake_openai_server(fail: set[int] = frozenset()):
    """Yield a running FakeServer (on a free loopback port, in a thread of its own); stopped on every path."""
    server = FakeServer(fail=frozenset(fail))
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    runner = web.AppRunner(_app(server))

    async def start() -> None:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server.port = site._server.sockets[0].getsockname()[1]

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name="fake-openai", daemon=True)
    thread.start()
    try:
        assert ready.wait(30), "the fake server did not start"
        yield server
    finally:
        if ready.is_set():
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
