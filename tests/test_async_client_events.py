"""AsyncClient reads its socket through ZeroMQ's edge-triggered descriptor: no frame may be left unread.

A stand-in ROUTER bursts frames (many arrive under one wake-up of the descriptor) and interleaves them with the
client's own sends (a send can consume the descriptor's edge); every frame must still reach its request.
"""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from metrale.frontend.async_client import AsyncClient
from metrale.ipc.messages import ClientMessage, Delta, Generate

WAIT_S = 10.0
BURST = 500


def _delta(request_id: str, i: int, final: bool = False) -> bytes:
    return msgspec.msgpack.encode(Delta(id=request_id, token_ids=[i], finish_reason="length" if final else None))


async def _serve(router: zmq.asyncio.Socket) -> None:
    """Request "a": BURST deltas at once, but its final one only after request "b" arrives; "b": three deltas."""
    decoder = msgspec.msgpack.Decoder(ClientMessage)
    identity, frame = await router.recv_multipart()
    assert isinstance(decoder.decode(frame), Generate)
    for i in range(BURST):
        await router.send_multipart([identity, _delta("a", i)])
    identity, frame = await router.recv_multipart()
    msg = decoder.decode(frame)
    assert isinstance(msg, Generate) and msg.id == "b"
    await router.send_multipart([identity, _delta("a", BURST, final=True)])
    for i in range(3):
        await router.send_multipart([identity, _delta("b", i, final=i == 2)])


async def _stream(client: AsyncClient, request_id: str, started: asyncio.Event | None = None) -> list[int]:
    """Every token of one request, in order; sets started on its first delta."""
    tokens = []
    async for delta in client.generate(token_ids=[1, 2, 3], request_id=request_id):
        tokens.extend(delta.token_ids)
        if started is not None:
            started.set()
    return tokens


def test_a_burst_and_interleaved_sends_lose_no_frame():
    async def main():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        try:
            port = router.bind_to_random_port("tcp://127.0.0.1")
            server = asyncio.ensure_future(_serve(router))
            async with AsyncClient(address=f"tcp://127.0.0.1:{port}", timeout=WAIT_S) as client:
                started = asyncio.Event()
                a = asyncio.ensure_future(_stream(client, "a", started))
                await asyncio.wait_for(started.wait(), WAIT_S)
                b = await asyncio.wait_for(_stream(client, "b"), WAIT_S)
                assert await asyncio.wait_for(a, WAIT_S) == list(range(BURST + 1))
                assert b == [0, 1, 2]
            await asyncio.wait_for(server, WAIT_S)
        finally:
            router.close(linger=0)
            ctx.term()

    asyncio.run(main())
