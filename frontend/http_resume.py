"""An HTTP request's id, for re-attaching a retry to the request it repeats (docs/http.md, docs/protocol.md §5.6).

A request that names itself (the `X-Request-Id` header, or vLLM's `request_id` body field) is held by the engine core
under that id. If the frontend dies, the client's connection dies with it; its retry with the same id, served by the
restarted frontend, re-attaches to the request still running (or just ended) instead of starting it again, and its
answer carries the whole output from the first token (a stream replays what the cut stream had sent). A request
without an id is not held. An id names one request: a second request with it, while the first runs on a live
frontend, replaces the first (which ends with finish_reason "abort"); one within RESUME_WINDOW_S of the first's end
gets the first's answer.
"""

from __future__ import annotations

import contextvars

import msgspec
from aiohttp import web

HEADER = "X-Request-Id"
MAX_ID_CHARS = 256

# The id of the HTTP request this handler serves (None: it gave none); read where its choices are submitted.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("metrale_http_request_id", default=None)


class _Named(msgspec.Struct):
    """The one body field read here (every other is the route's)."""

    request_id: str | None = None


_named = msgspec.json.Decoder(_Named)


def resume_key(request_id: str, choice: int) -> str:
    """The engine core's key of one choice of the request with this id."""
    return f"h{choice}:{request_id}"


@web.middleware
async def request_ids(request: web.Request, handler) -> web.StreamResponse:
    """File the request's id (header first, else the JSON body's request_id) for the route's submissions."""
    request_id = request.headers.get(HEADER)
    if request_id is None and request.method == "POST" and request.body_exists:
        try:
            request_id = _named.decode(await request.read()).request_id
        except (msgspec.DecodeError, ValueError):
            request_id = None  # the route says what is wrong with the body
    if request_id is not None and not 0 < len(request_id) <= MAX_ID_CHARS:
        request_id = None
    token = REQUEST_ID.set(request_id)
    try:
        return await handler(request)
    finally:
        REQUEST_ID.reset(token)
