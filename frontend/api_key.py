"""The server's API key (`metrale serve --api-key`): who may use it, over ZMQ and HTTP, compared in constant time.

Over ZMQ every client message carries the key in its `api_key` field (docs/protocol.md §3); over HTTP a request to
/v1/* sends `Authorization: Bearer KEY`, as OpenAI's clients do. Health checks stay open (a load balancer or an
orchestrator probes them without the key), as vLLM's /health does. A server started without a key lets everyone in.
"""

from __future__ import annotations

import hmac

UNAUTHORIZED_MESSAGE = ("a missing or wrong API key: this server was started with --api-key; pass the key "
                        "(api_key= in the client, --api-key on the command line, Authorization: Bearer over HTTP)")


class ApiKey:
    """One server's key, or none (then every request is allowed)."""

    def __init__(self, key: str | None) -> None:
        self._key = key.encode() if key else None

    @property
    def required(self) -> bool:
        return self._key is not None

    def allows(self, given: str | None) -> bool:
        """Whether a request that carries `given` may run; hmac.compare_digest, so timing says nothing of the key."""
        if self._key is None:
            return True
        return given is not None and hmac.compare_digest(given.encode(), self._key)

    def allows_header(self, authorization: str | None) -> bool:
        """Whether an HTTP request with this Authorization header may run (`Bearer KEY`)."""
        if self._key is None:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and self.allows(token.strip())
