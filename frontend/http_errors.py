"""The HTTP API's errors: OpenAI's error shape, the server's error codes mapped onto it, and the middleware
that answers every failure (ours, aiohttp's, and bugs) in that shape.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiohttp import web

from metrale.ipc.messages import Error

log = logging.getLogger("metrale.frontend.http_api")

# The server's error codes (docs/protocol.md §4.1) as (HTTP status, OpenAI error type, OpenAI error code).
_ENGINE_ERRORS = {
    "bad_request": (400, "invalid_request_error", "invalid_value"),
    "too_long": (400, "invalid_request_error", "context_length_exceeded"),
    "unauthorized": (401, "invalid_request_error", "invalid_api_key"),
    "admin_disabled": (403, "invalid_request_error", "admin_disabled"),
    "busy": (503, "server_error", "server_busy"),
    "shutdown": (503, "server_error", "shutting_down"),
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
        return json_response(self.body(), status=self.status)


def json_response(obj: object, status: int = 200) -> web.Response:
    """A JSON response."""
    return web.Response(status=status, body=msgspec.json.encode(obj), content_type="application/json")


@web.middleware
async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
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
