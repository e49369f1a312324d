"""Client and AsyncClient: the reference Python clients of docs/protocol.md.

Both speak ZMQ DEALER → the server's ROUTER, one msgpack frame per message, and route the answers by request id,
so any number of requests can stream at once over one client:

    with Client() as client:
        for delta in client.generate("Once upon a time", params=SamplingParams(max_tokens=32)):
            print(delta.text, end="")
        print(client.complete("2 + 2 =").text)

The sync Client (sync_client.py) owns one background thread that does all socket I/O (ZMQ sockets are not
thread-safe), so it may be used from many threads at once. AsyncClient (async_client.py) runs on the caller's
event loop. What both share (frames, errors, results) is client_protocol.py's; this module is where callers
import them from.
"""

from __future__ import annotations

from .async_client import AsyncClient
from .client_protocol import DEFAULT_PORT, DEFAULT_TIMEOUT_S, ClientClosed, Completion, RequestError, ServerUnreachable
from .sync_client import Client, DeltaStream

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT_S",
    "AsyncClient",
    "Client",
    "ClientClosed",
    "Completion",
    "DeltaStream",
    "RequestError",
    "ServerUnreachable",
]
