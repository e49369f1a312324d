"""SageMaker's serving contract, as vLLM answers it: GET/POST /ping (the health check: 200 with an empty body, or
503) and POST /invocations (a chat or completions body, sent to that route by its shape).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from .http_errors import ApiError

if TYPE_CHECKING:
    from .http_api import HttpApi


class SageMaker:
    """/ping and /invocations over the HTTP API's routes."""

    def __init__(self, api: HttpApi) -> None:
        self.api = api

    async def ping(self, request: web.Request) -> web.Response:
        """GET or POST /ping: 200 when the server can serve, else 503."""
        return web.Response(status=200 if self.api.server.health().healthy else 503)

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """POST /invocations: a body with messages is a chat completion, one with a prompt a completion."""
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
        if isinstance(body, dict) and "messages" in body:
            return await self.api.chat.handle(request)  # aiohttp keeps the body read, for the handler to read again
        if isinstance(body, dict) and "prompt" in body:
            return await self.api.completions.handle(request)
        raise ApiError(400, "Cannot find suitable handler for request: expected a chat completion (messages) or a "
                       "completion (prompt)", code="invalid_value")
