"""The error codes a request can end with, end to end: engine core -> frontend -> client (docs/protocol.md §4.1).

A code travels as its own field (RequestOutputDelta.error_code, Error.code), never inside a message string, so
nobody parses it back out of text. `Refused` is the exception a process raises for a request it will not run.
"""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    """Why a request failed; the value is what clients see."""

    BAD_REQUEST = "bad_request"  # fix the request
    TOO_LONG = "too_long"  # the prompt (or prompt + max_tokens, over HTTP) does not fit max_model_len
    BUSY = "busy"  # the server cannot take it now (queue full, engine not ready): retry later
    SHUTDOWN = "shutdown"  # the server is shutting down: retry against another, or later
    INTERNAL = "internal"  # the engine failed the request
    WORKER_FAULT = "worker_fault"  # the GPU worker failed while running the request
    UNKNOWN_ID = "unknown_id"  # an abort for an id that is not running
    UNAUTHORIZED = "unauthorized"  # a missing or wrong API key (the server runs with --api-key)
    ADMIN_DISABLED = "admin_disabled"  # an admin request to a server without --enable-admin (or from afar)
    RESUME_LOST = "resume_lost"  # a Resume of a request the server no longer holds (it ended long ago, or died)

    def __str__(self) -> str:
        return self.value


class Refused(ValueError):
    """A request that will not run: its code and a message naming the field or the limit."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
