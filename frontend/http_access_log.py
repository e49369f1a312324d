"""The HTTP API's access log: one INFO line per request — method, path, status, latency, the tokens it ran —
unless `metrale serve --disable-log-requests`. A handler that runs choices files them under CHOICES on the request,
so the line counts their prompt and completion tokens (also for a stream, once it has ended)."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from .http_reply import usage

log = logging.getLogger("metrale.frontend.access")

CHOICES = web.RequestKey("choices", list)
_CLIENT_CLOSED = 499  # nginx's code for a client that left before the answer ended


@web.middleware
async def access_log(request: web.Request, handler) -> web.StreamResponse:
    """Run the handler, then log one line for the request, whatever became of it."""
    start = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = _CLIENT_CLOSED
        raise
    finally:
        ms = (time.perf_counter() - start) * 1000
        choices = request.get(CHOICES)
        tokens = ""
        if choices:
            counts = usage(choices)
            tokens = f" prompt_tokens={counts['prompt_tokens']} completion_tokens={counts['completion_tokens']}"
        log.info("HTTP %s %s %s %d %.1f ms%s", request.remote, request.method, request.path, status, ms, tokens)
