"""How an admin request (worker control, `metrale serve --enable-admin`) reaches the supervisor and comes back.

The supervisor owns the child processes, so it is the one that signals a worker. It binds a ROUTER in its private
run folder (only its own children can reach it); the frontend, which has already checked the request (admin on, a
loopback peer, the API key), forwards the `Admin` message over a DEALER and relays the supervisor's `AdminReply` or
`Error` to the client. One request at a time: these are rare, operator-driven events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from .messages import Admin, AdminReply, Error

AdminAnswer = AdminReply | Error


class AdminInbox:
    """The supervisor's end: bind, and answer whatever requests wait, without blocking its watch loop."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._decoder = msgspec.msgpack.Decoder(Admin)
        self._encoder = msgspec.msgpack.Encoder()

    def serve(self, handle: Callable[[Admin], AdminAnswer]) -> None:
        """Answer every request waiting now with handle(request); a frame that does not decode is dropped."""
        while True:
            try:
                peer, data = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not [peer, payload]: not one of ours
                continue
            try:
                msg = self._decoder.decode(data)
            except msgspec.DecodeError:
                continue
            answer = handle(msg)
            try:
                self._sock.send_multipart([peer, self._encoder.encode(answer)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the frontend went away; its client times out

    def close(self) -> None:
        self._sock.close()


class AdminLink:
    """The frontend's end, on its event loop: forward one request, wait (bounded) for its answer."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._lock = asyncio.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(AdminAnswer)

    async def ask(self, msg: Admin, timeout_s: float) -> AdminAnswer:
        """The supervisor's answer to msg; Error "internal" when none comes within timeout_s."""
        async with self._lock:
            await self._sock.send(self._encoder.encode(msg))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while (left := deadline - loop.time()) > 0:
                if not await self._sock.poll(int(left * 1000) + 1):
                    break
                answer = self._decoder.decode(await self._sock.recv())
                if answer.id == msg.id:  # an answer that came after its request gave up is skipped
                    return answer
        return Error(id=msg.id, code="internal", message=f"the supervisor did not answer within {timeout_s:g} s")

    def close(self) -> None:
        self._sock.close(0)
